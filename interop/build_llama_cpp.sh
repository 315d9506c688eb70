#!/usr/bin/env bash
# Build llama-cpp-python 0.3.36 (CPU only) from its source distribution into a cache outside the repository:
#   CACHE/llama_cpp_python-0.3.36/   the unpacked sdist (its vendor/llama.cpp has convert_hf_to_gguf.py, gguf-py)
#   CACHE/wheels/*.whl, CACHE/site/   the built wheel and an install of it (no change to the project's venv)
# Needs cmake and a C++ compiler (the Makefile's interop target installs them). ~12 minutes on 2 cores.
# Idempotent: an existing build is reused.
set -euo pipefail
PY=${PY:-python3}
CACHE=${1:-$HOME/.cache/openglm/llama-cpp}
VERSION=0.3.36
mkdir -p "$CACHE"
cd "$CACHE"
if [ -f "site/llama_cpp/__init__.py" ] && [ -d "llama_cpp_python-$VERSION" ]; then
  echo "llama-cpp-python $VERSION already built in $CACHE"; exit 0
fi
[ -f "llama_cpp_python-$VERSION.tar.gz" ] || \
  "$PY" -m pip download -q --no-deps --no-binary :all: -d . "llama-cpp-python==$VERSION"
[ -d "llama_cpp_python-$VERSION" ] || tar xzf "llama_cpp_python-$VERSION.tar.gz"
export CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
ls wheels/llama_cpp_python-$VERSION-*.whl >/dev/null 2>&1 || \
  nice -n 10 flock /tmp/openglm-bench.lock "$PY" -m pip wheel -q --no-deps -w wheels "llama_cpp_python-$VERSION.tar.gz"
"$PY" -m pip install -q --no-deps --target site wheels/llama_cpp_python-$VERSION-*.whl diskcache
echo "built llama-cpp-python $VERSION in $CACHE"

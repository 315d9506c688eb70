# Two commands: `make demo` (the main job) and `make test` (the suite). Both create .venv if absent.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Local CPU wheel of torch on these machines; never let pip fall back to a CUDA build.
FIND_LINKS := $(if $(wildcard /opt/wheels),-f /opt/wheels,)
STAMP  := $(VENV)/.installed

.PHONY: demo test install system-deps bench clean interop lint-docker

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(FIND_LINKS) torch==2.13.0
	$(BIN)/python -m pip install -q $(FIND_LINKS) -e ".[test,retrieval]"
	touch $(STAMP)

install: $(STAMP)

# redis-server is needed by the agent store tests (a real server, started by the fixtures).
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null); \
	  else echo "redis-server is missing: install it (e.g. apt-get install redis-server)"; exit 1; fi; }
	@# setsid (util-linux) and pgrep (procps): the process-confinement tests start escaping children with them.
	@command -v setsid >/dev/null 2>&1 && command -v pgrep >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq util-linux procps >/dev/null); \
	  else echo "setsid / pgrep are missing: install util-linux and procps"; exit 1; fi; }
	@# bubblewrap (bwrap) is the sandbox of the agent's task commands (openglm/util/sandbox.py); without it they are refused.
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null); \
	  else echo "bwrap is missing: install bubblewrap (e.g. apt-get install bubblewrap)"; exit 1; fi; }
	@# A C compiler builds the DSA kernels on first use (openglm/model/native.py); without one the torch-op path runs.
	@command -v cc >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc >/dev/null) \
	      || echo "note: could not install gcc: DSA will run its slower torch-op path"; \
	  else echo "note: no C compiler (cc): DSA runs its slower torch-op path, and its native-kernel tests skip"; fi; }
	@# Headless Chromium for the agent dashboard's browser tests (Playwright drives /usr/bin/chromium; nothing downloaded).
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null); \
	  else echo "chromium is missing: install it (e.g. apt-get install chromium chromium-driver)"; exit 1; fi; }

demo: $(STAMP)
	$(BIN)/openglm demo

test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q

# No container engine runs on the test machines: the Dockerfile is linted instead of built (docs/scaling.md).
lint-docker: $(STAMP)
	$(BIN)/hadolint Dockerfile

# Opt-in (not part of `make test`): build llama-cpp-python 0.3.36 from its sdist (CPU; ~12 min on 2 cores) into
# $(LLAMA_CACHE), convert openglm checkpoints with its convert_hf_to_gguf.py, compare greedy continuations.
LLAMA_CACHE ?= $(HOME)/.cache/openglm/llama-cpp
interop: $(STAMP)
	@command -v cmake >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ >/dev/null); \
	  else echo "interop needs cmake and a C++ compiler"; exit 1; fi; }
	PY=$(abspath $(BIN))/python bash interop/build_llama_cpp.sh $(LLAMA_CACHE)
	$(BIN)/python -m pytest -q interop --llama-cache $(LLAMA_CACHE)

clean:
	rm -rf $(VENV) runs .pytest_cache

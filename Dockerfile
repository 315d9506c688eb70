# openglm's CPU stack in one image: `openglm serve` (OpenAI API), `openglm agent-server` and `openglm worker`.
# torch comes from PyTorch's CPU wheel index, so no CUDA build is ever pulled; the GPU variant is in
# docs/scaling.md (build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128).
FROM python:3.11-slim-bookworm

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    OPENGLM_CACHE=/var/cache/openglm

# gcc builds the native DSA / decode kernels on first use (without it the torch-op paths run); git is used by
# the SWE tools; bubblewrap is the sandbox of the agent's task commands (it needs user namespaces in the container).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev git bubblewrap \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/openglm
COPY pyproject.toml README.md ./
COPY openglm ./openglm
RUN pip install --index-url "${TORCH_INDEX}" torch==2.13.0 \
    && pip install . \
    && useradd --create-home --uid 1000 openglm \
    && mkdir -p /var/cache/openglm /data \
    && chown openglm:openglm /var/cache/openglm /data

USER 1000
WORKDIR /data
EXPOSE 8000 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s CMD ["python", "-c", "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["openglm"]
CMD ["serve", "--config", "/data/deploy.yaml"]

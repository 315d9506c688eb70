"""A live `openglm serve` subprocess on loopback (the real CLI), plus an in-process factory for
servers with unusual settings. Both use a random-weight tiny checkpoint."""

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from testutil import free_port

torch.set_num_threads(1)  # small matmuls on a shared 2-core machine

API_KEY = "test-key-123"
MODEL = "tiny-test"


def wait_healthy(url: str, proc=None, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy in {timeout}s")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from openglm.engine.random_checkpoint import build_random_checkpoint

    # 16 indexer heads: see tests/engine/conftest.py (no exact DSA top-k ties)
    return build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", index_n_heads=16)


@pytest.fixture(scope="session")
def server(checkpoint):
    """`openglm serve` with an API key (from $OPENGLM_API_KEY: never argv), context 256, a 96-block pool."""
    port = free_port()
    cmd = [sys.executable, "-m", "openglm", "serve", str(checkpoint), "--port", str(port),
           "--served-model-name", MODEL, "--max-model-len", "256", "--num-kv-blocks", "96", "--threads", "1",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "OPENGLM_API_KEY": API_KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def api_key():
    return API_KEY


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def async_client(server):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def start_server(checkpoint):
    """Factory: an in-process uvicorn server (background thread) with custom engine settings;
    `app_kw` goes to create_app (api_key, public_metrics), `limits` to the app and uvicorn."""
    import uvicorn

    from openglm.engine import EngineConfig, LLMEngine
    from openglm.server.app import create_app
    from openglm.server.limits import ServerLimits, uvicorn_config

    started = []

    def start(app_kw=None, limits=None, **engine_kw):
        engine = LLMEngine.from_pretrained(checkpoint, EngineConfig(**engine_kw))
        limits = limits or ServerLimits()
        app = create_app(engine, MODEL, limits=limits, **(app_kw or {}))
        port = free_port()
        srv = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, limits, log_level="warning"))
        thread = threading.Thread(target=srv.run, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        started.append((srv, thread))
        return url, engine

    yield start
    for srv, thread in started:
        srv.should_exit = True
        thread.join(timeout=15)


@pytest.fixture(scope="session")
def metric():
    """metric(base_url, name) -> the value of an unlabelled Prometheus sample."""

    def read(url: str, name: str) -> float:
        text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"metric {name} not found")

    return read

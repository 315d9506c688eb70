"""A live `openglm serve` subprocess on loopback (the real CLI), plus an in-process factory for
servers with unusual settings, and an in-process server whose model writes a scripted reply. All use a
random-weight tiny checkpoint."""

import os
import threading

import httpx
import pytest
import torch
from testutil import free_port, openglm_serve, wait_healthy

torch.set_num_threads(1)  # small matmuls on a shared 2-core machine

API_KEY = "test-key-123"
MODEL = "tiny-test"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from openglm.engine.random_checkpoint import build_random_checkpoint

    # 16 indexer heads: see tests/engine/conftest.py (no exact DSA top-k ties)
    return build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", index_n_heads=16)


@pytest.fixture(scope="session")
def server(checkpoint):
    """`openglm serve` with an API key (from $OPENGLM_API_KEY: never argv), context 256, a 96-block pool."""
    with openglm_serve(checkpoint, "--served-model-name", MODEL, "--max-model-len", "256", "--num-kv-blocks", "96",
                       "--threads", "1", "--log-level", "warning",
                       env={**os.environ, "OMP_NUM_THREADS": "1", "OPENGLM_API_KEY": API_KEY}) as url:
        yield url


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
    from openglm.server.limits import ServerLimits
    from openglm.util.http_limits import uvicorn_config

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


class ScriptedModel(torch.nn.Module):
    """The checkpoint's model, whose next token is forced to follow a script once the prompt's last
    token (the generation prompt's `</think>`) has been read: the server's real path (template,
    engine, detokenizer, parsers, SSE) runs on a reply we choose."""

    def __init__(self, inner, start_tokens: set[int]):
        super().__init__()
        self.inner, self.config, self.start_tokens = inner, inner.config, start_tokens
        self.script: list[int] = []
        self.start = None

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        out = self.inner(input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache)
        logits = out.logits.clone()
        for row in range(input_ids.shape[0]):
            past = attention_mask.shape[1] - input_ids.shape[1]
            n = int(attention_mask[row].sum()) - int(attention_mask[row, :past].sum())
            last, pos = int(input_ids[row, n - 1]), int(position_ids[row, n - 1])
            if last in self.start_tokens and n > 1:  # a prefill ending with the generation prompt
                self.start = pos
            k = pos - self.start if self.start is not None else -1
            if 0 <= k < len(self.script):
                logits[row, n - 1] = -1e9
                logits[row, n - 1, self.script[k]] = 1e9
        out.logits = logits
        return out


@pytest.fixture(scope="module")
def scripted(start_server):
    """An in-process server whose model writes the reply a test scripts: (OpenAI client, reply(text))."""
    from openai import OpenAI

    url, engine = start_server(max_model_len=1024, num_kv_blocks=256)
    tok = engine.tokenizer
    model = ScriptedModel(engine.runner.model, {tok.marker_id("</think>"), tok.marker_id("<think>")})
    engine.runner.model = model

    def reply(text: str):
        model.script, model.start = tok.encode(text) + [tok.token_id("<|observation|>")], None

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120), reply

"""The FastAPI application: routes, API-key check and OpenAI-style error handling.

Routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/v1/responses`, vLLM's `/tokenize`,
`/detokenize` and `/version`, `/health`, `/metrics`, `/status` (+ `/v1/status`).

`create_app(engine, ...)` wires an `LLMEngine` behind the OpenAI API; the engine runs in its own
thread, started and stopped with the app's lifespan. With a key, everything but `/health` needs it
(`/metrics` too, unless `public_metrics`); the interactive docs pages are off (they load their
assets from a CDN) and the OpenAPI schema is served behind the key.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import json
import time

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from openglm.server.async_engine import AsyncEngine
from openglm.server.errors import APIError, validation_message
from openglm.server.limits import BodyLimit, ServerLimits
from openglm.server.metrics import ServerMetrics
from openglm.server.protocol import ChatCompletionRequest, CompletionRequest
from openglm.server.serving import OpenAIServing
from openglm.server.status_page import register as register_status_page
from openglm.util.auth import Access, access

try:
    VERSION = importlib.metadata.version("openglm")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
    VERSION = "unknown"


async def json_body(request: Request):
    """The request body as JSON (routes whose body is validated in several shapes read it themselves)."""
    try:
        return json.loads(await request.body())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise APIError(400, "the request body is not valid JSON", param="body") from None


def create_app(engine, model_name: str, api_key: str | None = None, public_metrics: bool = False,
               limits: ServerLimits | None = None, json_whitespace: str = "compact",
               default_chat_template_kwargs: dict | None = None, thinking_token_budget: int | None = None) -> FastAPI:
    """`default_chat_template_kwargs` and `thinking_token_budget` apply where a chat request sets neither
    (server/thinking.py)."""
    if api_key is not None and not api_key.strip():
        raise ValueError("the API key is empty: pass a non-empty key, or none to serve without one")
    limits = limits or ServerLimits()
    metrics = ServerMetrics()
    async_engine = AsyncEngine(engine, limits.max_queue, metrics)
    serving = OpenAIServing(async_engine, model_name, json_whitespace, default_chat_template_kwargs,
                            thinking_token_budget, limits)
    metrics.observe_engine(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        serving.prepare.start()  # the worker processes that render, tokenise and compile grammars
        async_engine.start()
        # What exists now (the model, the modules: ~350k objects) lives as long as the server; a full collection
        # scanned it all (~0.2 s with the GIL held: the event loop and the engine stood still), and a request that
        # makes many objects (a schema of 10,000 properties) set one off. Frozen, it is never scanned again.
        gc.collect()
        gc.freeze()
        yield
        gc.unfreeze()  # (for a process that goes on: tests start and stop servers)
        async_engine.shutdown()
        serving.prepare.close()

    app = FastAPI(title="openglm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limits=limits)
    app.state.engine, app.state.async_engine, app.state.metrics = engine, async_engine, metrics

    # A dependency rather than an HTTP middleware: Starlette's BaseHTTPMiddleware wraps `receive`,
    # which hides client disconnects from the handlers (and then aborts would never happen).
    async def check_api_key(request: Request):
        given = request.headers.get("authorization", "")
        if access(given, api_key) is Access.DENIED:
            msg = "missing API key" if not given else "invalid API key"
            raise APIError(401, f"{msg}: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        metrics.errors.labels(status=str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return await api_error(request, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        param = "body" if exc.status_code == 400 else None
        return await api_error(request, APIError(exc.status_code, str(exc.detail), param=param))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        return await api_error(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health():
        if async_engine.error is not None or not async_engine.thread.is_alive():
            return JSONResponse({"status": "error"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", dependencies=[] if public_metrics else [Depends(check_api_key)])
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/openapi.json", dependencies=[Depends(check_api_key)], include_in_schema=False)
    async def openapi_schema():
        return app.openapi()

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "openglm",
                "max_model_len": engine.max_model_len}

    @v1.get("/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name:path}")
    async def get_model(name: str):
        serving.check_model(name)
        return model_card()

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await serving.completions(req, request)

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await serving.chat(req, request)

    @v1.post("/responses")
    async def responses(request: Request):
        return await serving.responses(await json_body(request), request)

    # vLLM's utility routes (outside /v1, behind the key like everything but /health)
    @app.post("/tokenize", dependencies=[Depends(check_api_key)])
    async def tokenize(request: Request):
        return await serving.tokenize(await json_body(request))

    @app.post("/detokenize", dependencies=[Depends(check_api_key)])
    async def detokenize(request: Request):
        return await serving.detokenize(await json_body(request))

    @app.get("/version", dependencies=[Depends(check_api_key)])
    async def version():
        return {"version": VERSION}

    app.include_router(v1)
    register_status_page(app, metrics, v1.dependencies)  # /status page, its data at /v1/status
    return app

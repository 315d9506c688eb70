"""The OpenAI-compatible server's limits: what clients may cost the server before a request is refused.

The connection and body limits (head deadline, whole-body deadline with a minimum rate, lingering close
after a refused upload, ready requests counted apart from connections) are `openglm.util.http_limits`,
shared with the agent's task API; here are the server's own:

- `max_queue` caps the engine requests in flight (the AsyncEngine answers 503 + Retry-After beyond it).
- Preparing a request (rendering the chat template, tokenising, compiling an output grammar) runs in
  `prepare_workers` worker processes with budgets (`template_timeout_s`, `grammar_timeout_s`):
  `server/prepare.py`.
- `refuse`: a refusal of `BodyLimit` as an OpenAI-style error body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from openglm.util.http_limits import HTTPLimits, refusal_headers


@dataclass
class ServerLimits(HTTPLimits):
    max_queue: int = 256  # requests in flight (queued or running) beyond which new ones get 503 + Retry-After
    prepare_workers: int = 2  # worker processes that render templates, tokenise and check grammars
    template_timeout_s: float = 2.0  # the most seconds one request's chat template may render for (400)
    grammar_timeout_s: float = 5.0  # the most seconds one request's output grammar may compile for (400)


ERROR_CODES = {408: "request_timeout", 413: "request_too_large", 503: "server_busy"}


async def refuse(send, status: int, message: str) -> None:
    """`BodyLimit`'s refusal in the OpenAI error format (a 503 carries Retry-After)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": ERROR_CODES[status]}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *refusal_headers(status)]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

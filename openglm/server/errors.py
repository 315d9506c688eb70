"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} with a matching status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after  # seconds; only on errors that a retry can get past

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def validation_message(errors: list[dict]) -> tuple[str, str]:
    """A readable message and the offending field from pydantic/FastAPI validation errors (`body` when the
    fault is the body as a whole)."""
    first = errors[0] if errors else {}
    # drop "body" and the union-member tags pydantic adds ("min_p.int", "prompt.list[int]")
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_type_tag(str(x))]
    param = ".".join(loc)
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", "body"
    if first.get("type") == "extra_forbidden":
        return f"{param}: unknown field (docs/serving.md lists the fields openglm accepts)", param or "body"
    return (f"{param}: {msg}" if param else f"the request body: {msg}"), param or "body"


def _is_type_tag(part: str) -> bool:
    return part in ("int", "float", "str", "bool", "list", "dict", "none") or "[" in part

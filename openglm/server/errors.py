"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} with a matching status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A readable message and the offending field from pydantic/FastAPI validation errors."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x not in ("body",)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    return (f"{param}: {msg}" if param else msg), param

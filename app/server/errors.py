"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the server gives (bad JSON, unknown fields, a bad key, a prompt that can
never fit, a full queue, an unknown route) goes out in this one shape, so an OpenAI
client raises its usual typed exception (`BadRequestError`, `AuthenticationError`,
`RateLimitError`, ...) with our message.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

INVALID = "invalid_request_error"


def error_body(message: str, *, type: str = INVALID, param: str | None = None,
               code: str | None = None) -> dict:
    """The JSON body of an OpenAI error."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """A request the server refuses; answered with ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = INVALID,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.type, self.param, self.code = type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: a field is missing, unknown, of the wrong type or out of range."""
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str) -> APIError:
    """400: a real OpenAI field whose value this server does not implement."""
    return APIError(400, f"{what} is not supported by this server", param=param,
                    code="unsupported_value")


def context_length(message: str, param: str | None) -> APIError:
    """400 with OpenAI's ``context_length_exceeded`` code: the request can never fit."""
    return APIError(400, message, param=param, code="context_length_exceeded")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key")


def queue_full(waiting: int, retry_after_s: int) -> APIError:
    """429 with Retry-After: the bounded waiting queue is full right now."""
    return APIError(429, f"the server is busy: {waiting} requests are already waiting; "
                    f"retry after {retry_after_s} s", type="requests",
                    code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)})


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down and takes no new requests",
                    type="server_error", code="server_shutting_down")


async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404 / 405 / 400s, in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                   code=code),
                        status_code=exc.status_code, headers=exc.headers)


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A bug: the client gets a 500 in the usual shape, never a traceback."""
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type="server_error"),
                        status_code=500)


EXCEPTION_HANDLERS = {APIError: on_api_error, HTTPException: on_http_error,
                      Exception: on_unexpected}

"""What every route does first: find the server state, authenticate, read the JSON body."""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request

from app.server import errors
from app.server.errors import APIError
from app.server.keys import Principal, bearer_key
from app.server.state import ServerState

MAX_BODY_BYTES = 8 << 20  # prompts are bounded far below this by the context (serving)


def _state(request: Request) -> ServerState:
    return request.app.state.kvchat


def authenticate(request: Request) -> Principal:
    """The request's principal from its bearer key (or Anthropic's ``x-api-key``); 401
    for a missing or unknown key."""
    key = bearer_key(request.headers.get("authorization")) or request.headers.get("x-api-key")
    principal = _state(request).keys.lookup(key)
    if principal is None:
        raise errors.unauthorized("missing API key: send 'Authorization: Bearer <key>'"
                                  if key is None else "incorrect API key provided")
    return principal


async def read_json(request: Request) -> object:
    """The request body as JSON, at most MAX_BODY_BYTES and whole within the server's read
    timeout; else 413 / 408 (and the connection closes: the rest of the body is never
    read), or 400."""
    close = {"Connection": "close"}
    too_large = APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                         code="request_too_large", headers=close)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    body, size = [], 0
    timeout_s = _state(request).read_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise too_large
                body.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive whole within {timeout_s:g} s",
                       code="request_timeout", headers=close) from None
    try:
        return json.loads(b"".join(body))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise errors.invalid(f"the request body is not valid JSON: {e}") from None

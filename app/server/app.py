"""The ASGI app: OpenAI's routes over one engine, plus /health and /metrics.

Routes stay thin: authenticate, read a bounded JSON body, parse it (`openai_schema`) and
hand it to `serving`. The engine thread starts with the app and stops with it; stopping
it finishes whatever is left, releases every block and drains the disk-cache writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.server import anthropic, metrics_export, openai_responses, serving
from app.server.errors import EXCEPTION_HANDLERS, APIError
from app.server.native_heap import Trimmer
from app.server.openai_schema import parse_request
from app.server.request_in import _state, authenticate, read_json
from app.server.state import ServerState

__all__ = ["APIError", "build_app"]

async def chat_completions(request: Request) -> Response:
    principal = authenticate(request)
    parsed = parse_request("chat", await read_json(request))
    return await serving.complete(_state(request), request, parsed, principal)


async def completions(request: Request) -> Response:
    principal = authenticate(request)
    parsed = parse_request("text", await read_json(request))
    return await serving.complete(_state(request), request, parsed, principal)


async def models(request: Request) -> Response:
    authenticate(request)
    state = _state(request)
    return JSONResponse({"object": "list", "data": [
        {"id": state.model_id, "object": "model", "created": int(state.started_at),
         "owned_by": "kvchat"}]})


async def health(request: Request) -> Response:
    """200 while serving, 503 while draining; a few live figures either way."""
    state = _state(request)
    m = state.engine.metrics()
    return JSONResponse({
        "status": "draining" if state.draining else "ok", "model": state.model_id,
        "waiting": m.waiting, "running": m.running,
        "blocks_free": m.blocks_free, "blocks_used": m.blocks_used,
        "blocks_cached": m.blocks_cached,
    }, status_code=503 if state.draining else 200)


async def metrics(request: Request) -> Response:
    """Prometheus text; aggregate figures only (no prompts, keys or tenant names)."""
    registry = request.app.state.registry
    return Response(metrics_export.render(registry), media_type=CONTENT_TYPE_LATEST)


class CountResponses:
    """ASGI middleware: counts responses by route and status for /metrics, and requests in
    flight for the native heap's trims (`native_heap.Trimmer`)."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app, self.state = app, state
        self.trimmer = Trimmer()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                path = scope["path"] if scope["path"] in ROUTES else "other"
                self.state.counters.responses[(path, message["status"])] += 1
            await send(message)

        self.trimmer.started()
        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.trimmer.ended()


def _loopback(host: str) -> bool:
    """``host`` (a Host header, or an origin's host part) names this machine by loopback."""
    host = host.lower()
    name = host[1:host.find("]")] if host.startswith("[") else host.split(":", 1)[0]
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class LocalOnly:
    """ASGI middleware for a server without API keys: refuse (403) a ``Host`` that is not a
    loopback name (DNS rebinding: a page's own domain resolved to 127.0.0.1) and an
    ``Origin`` of another site (a web page POSTing to the local server). Clients that send
    no Origin (SDKs, curl) and pages served from localhost pass."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                       if k in (b"host", b"origin")}
            origin = headers.get("origin")
            bad = None
            if not _loopback(headers.get("host", "")):
                bad = "the Host header must name this machine (localhost) without API keys"
            elif origin is not None and not (origin.startswith(("http://", "https://"))
                                             and _loopback(origin.split("://", 1)[1])):
                bad = "cross-site requests are refused without API keys (Origin)"
            if bad is not None:
                return await APIError(403, bad, type="permission_error").response()(
                    scope, receive, send)
        await self.app(scope, receive, send)


ROUTES = {
    "/v1/chat/completions": (chat_completions, ["POST"]),
    "/v1/completions": (completions, ["POST"]),
    "/v1/messages": (anthropic.messages, ["POST"]),
    "/v1/responses": (openai_responses.responses, ["POST"]),
    "/v1/models": (models, ["GET"]),
    "/health": (health, ["GET"]),
    "/metrics": (metrics, ["GET"]),
}


def build_app(state: ServerState) -> ASGIApp:
    """The server's ASGI app; its lifespan starts and stops the engine thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        state.engine.start()
        try:
            yield
        finally:
            # finishes what is left, frees every block, drains the disk writer
            await asyncio.to_thread(state.engine.shutdown)
            state.tokenizer_pool.shutdown(wait=False)

    app = Starlette(routes=[Route(path, fn, methods=methods)
                            for path, (fn, methods) in ROUTES.items()],
                    exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    app.state.kvchat = state
    app.state.registry = metrics_export.make_registry(state)
    served = app if state.keys.required else LocalOnly(app)
    return CountResponses(served, state)

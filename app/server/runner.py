"""uvicorn with kvchat's signals: SIGTERM drains and exits 0, SIGHUP reloads the API keys.

Why Starlette + uvicorn: Starlette is the small ASGI toolkit under FastAPI, with
streaming responses and lifespan hooks and nothing else to carry (request parsing is
`openai_schema`'s job, so FastAPI's pydantic layer would add weight, not checks);
uvicorn is the reference ASGI server, maintained by the same people, with a graceful
shutdown we extend rather than replace.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading

import uvicorn

from app.server.app import build_app
from app.server.connections import connection_cap, guarded_protocol
from app.server.keys import KeyStore
from app.server.log import log
from app.server.state import ServerState
from engine.errors import KVChatError


class KvchatServer(uvicorn.Server):
    """uvicorn's server, draining on SIGTERM / SIGINT and reloading keys on SIGHUP."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises a captured SIGTERM once it has shut down, which would end the
        # process by that signal; kvchat drains, returns, and exits 0
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handlers = {signal.SIGINT: self.handle_exit, signal.SIGTERM: self.handle_exit,
                    signal.SIGHUP: self.handle_reload}
        previous = {sig: signal.signal(sig, h) for sig, h in handlers.items()}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            log(f"draining: no new requests; in-flight ones have "
                f"{self.state.drain_timeout_s:g} s")
            self._call_soon(self.state.begin_drain)
        super().handle_exit(sig, frame)

    def handle_reload(self, sig, frame) -> None:
        self._call_soon(self.reload_keys)

    def reload_keys(self) -> None:
        try:
            log(self.state.keys.reload())
        except KVChatError as e:
            log(f"warning: keys file not reloaded, the old keys stay: {e}")

    def _call_soon(self, fn) -> None:
        # a signal handler runs between two bytecodes of the loop's own thread: hand over
        if self.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed already
                self.loop.call_soon_threadsafe(fn)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            host = f"[{host}]" if ":" in host else host
            keys = self.state.keys
            who = (f"{len(keys.tenants)} tenants by API key" if keys.required
                   else "local tenant, no API keys")
            log(f"listening on http://{host}:{port} (model {self.state.model_id}, {who})")


def model_id(loaded) -> str:
    """The id /v1/models lists: the model directory's name for the embedded default."""
    return loaded.path.name if loaded.name == "default" else loaded.name


def serve(args, engine, keys: KeyStore, sock: socket.socket) -> None:
    """Run the server on ``sock`` until SIGTERM / SIGINT has drained it."""
    state = ServerState(engine, keys, model_id(engine.loaded), max_waiting=args.max_waiting,
                        default_max_tokens=args.default_max_tokens,
                        max_n=getattr(args, "max_n", 8),
                        drain_timeout_s=args.drain_timeout, read_timeout_s=args.read_timeout,
                        context_policy=getattr(args, "context_policy", "error"),
                        context_budget=getattr(args, "context_budget", None))
    cap, note = connection_cap(args.max_connections)  # after the load: the limit is final
    if note:
        log(f"note: {note}")
    config = uvicorn.Config(build_app(state), log_level=args.log_level, lifespan="on",
                            http=guarded_protocol(args.read_timeout, cap),
                            access_log=args.log_level != "warning",
                            # a backstop: the drain deadline cancels requests first
                            timeout_graceful_shutdown=args.drain_timeout + 10)
    KvchatServer(config, state).run(sockets=[sock])

"""Connections: a cap below the open-file limit, and a deadline for every request's headers.

uvicorn keeps a connection that never sends a request open for good (its keep-alive timer
starts only after a first response, and any byte cancels it), so ~2,050 idle sockets, no
key needed, used up the process's 2,048 file descriptors and every client was locked out
(issue 33 item 8). `guarded_protocol` is uvicorn's h11 protocol with two bounds:

- **a read deadline**: a connection has ``read_timeout_s`` to send a request's headers
  whole, from when it opens and again after each response; sending slowly does not move it
  (a byte a second keeps nothing open). Past it: a 408 in OpenAI's shape, then close. The
  body's own deadline is `request_in.read_json`'s.
- **a connection cap** below the soft RLIMIT_NOFILE (`max_connections`): past it, the
  connection that has waited longest without a request in progress is closed to make room,
  so idle sockets cannot keep a client out; when every one is busy, the new one gets a 503.
"""

from __future__ import annotations

import json
import resource
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from app.server.errors import INVALID, error_body

MIN_CONNECTIONS = 16


def max_connections(soft_limit: int | None = None) -> int:
    """Connections allowed under the soft open-file limit: an eighth of it (at least 64)
    stays for the engine (disk-cache files, weights, logs, pipes)."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit == resource.RLIM_INFINITY or soft_limit > 1 << 20:
        soft_limit = 1 << 20
    return max(MIN_CONNECTIONS, soft_limit - max(64, soft_limit // 8))


def connection_cap(requested: int | None) -> tuple[int, str | None]:
    """``--max-connections`` within what the open-file limit allows, and a note when it
    had to be lowered."""
    limit = max_connections()
    if requested is None or requested <= limit:
        return requested or limit, None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return limit, (f"--max-connections {requested} lowered to {limit}: the open-file limit "
                   f"is {soft}")


def raw_error(status: int, reason: str, message: str, code: str,
              type: str = INVALID) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection (written outside h11,
    which answers only a request it has parsed)."""
    body = json.dumps(error_body(message, type=type, code=code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap (set by
    `guarded_protocol`)."""

    read_timeout_s: float = 30.0
    connection_cap: int = 1024

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline = None
        self._wait_for_request()
        if len(self.connections) > self.connection_cap and not self._make_room():
            self._refuse(raw_error(503, "Service Unavailable", "the server has too many "
                                   "connections open; retry later", "too_many_connections",
                                   type="server_error"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a request's headers came whole
            self._cancel_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():  # the next request (or the rest of this one's
            self._wait_for_request()         # body, answered without it) is due in time

    # -- the deadline and the cap ------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No request in progress: none yet, or its response is complete."""
        return self.cycle is None or self.cycle.response_complete

    def _wait_for_request(self) -> None:
        self._cancel_deadline()
        self.idle_since = time.monotonic()
        self._deadline = self.loop.call_later(self.read_timeout_s, self._timed_out)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.idle and not self.transport.is_closing():
            self._refuse(raw_error(408, "Request Timeout", f"no whole request within "
                                   f"{self.read_timeout_s:g} s", "request_timeout"))

    def _make_room(self) -> bool:
        """Close the connection idle longest (not this one); False if none is idle."""
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                and c.idle and not c.transport.is_closing()]
        if not idle:
            return False
        min(idle, key=lambda c: c.idle_since)._refuse(b"")
        return True

    def _refuse(self, response: bytes) -> None:
        self._cancel_deadline()
        if response and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(response)
        self.transport.close()


def guarded_protocol(read_timeout_s: float, connection_cap: int) -> type[GuardedH11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these bounds."""
    return type("KvchatH11Protocol", (GuardedH11Protocol,),
                {"read_timeout_s": read_timeout_s, "connection_cap": connection_cap})

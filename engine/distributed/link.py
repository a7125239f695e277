"""Messages between neighbouring ranks over `mx.distributed` send/recv, every wait guarded.

The ranks form a ring: rank r hears from r - 1 and speaks to r + 1, and the last rank
answers rank 0. Only neighbours talk, which every MLX backend supports (the ring backend
connects neighbours only). Each part of a message is evaluated on its own, in order: the
header must arrive before the receiver can size the body, and independent sends in one
graph have no guaranteed order.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.distributed.group import Watchdog, fatal
from engine.distributed.plan_wire import HEADER_LEN, Message, parse_header


class Link:
    """One rank's two neighbours in the ring, and the guarded exchange of messages."""

    def __init__(self, group: mx.distributed.Group, watchdog: Watchdog):
        self.group = group
        self.watchdog = watchdog
        self.rank, self.size = group.rank(), group.size()
        self.prev = (self.rank - 1) % self.size
        self.next = (self.rank + 1) % self.size
        self.bytes_sent = 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def _eval(self, x: mx.array, peer: int, what: str) -> None:
        try:
            mx.eval(x)
        except RuntimeError as e:  # the ring backend raises when a peer's socket closed
            fatal(f"lost rank {peer} while {what}: {e}", rank=self.rank)

    def eval(self, *xs, what: str) -> None:
        """Evaluate a graph holding collectives (tensor parallel's all-sums)."""
        try:
            mx.eval(*xs)
        except RuntimeError as e:
            # the ranks cannot continue out of step, whatever failed
            fatal(f"{what} failed: {e} (a rank died, or the ranks are out of step)",
                  rank=self.rank)

    def send(self, dst: int, msg: Message) -> None:
        """Send ``msg`` to ``dst`` (a neighbour); fatal after the timeout."""
        g = self.group
        what = f"sending {msg.op.name} #{msg.seq} to rank {dst}"
        with self.watchdog.guard(what):
            self._eval(mx.distributed.send(mx.array(msg.header()), dst, group=g), dst, what)
            body = msg.body()
            if len(body):
                self._eval(mx.distributed.send(mx.array(body), dst, group=g), dst, what)
            if msg.tensor is not None:
                self._eval(mx.distributed.send(msg.tensor, dst, group=g), dst, what)
                self.bytes_sent += msg.tensor.nbytes
        self.bytes_sent += 4 * (HEADER_LEN + len(body))

    def recv(self, src: int, *, idle: bool = False, what: str = "",
             timeout_s: float | None = None) -> Message:
        """The next message from ``src``. With ``idle`` the header may take any time (a
        worker waiting for rank 0's next step); the rest of the message is guarded."""
        g = self.group
        what = what or f"waiting for rank {src}"
        if idle:
            h = mx.distributed.recv((HEADER_LEN,), mx.int32, src, group=g)
            self._eval(h, src, what)
        with self.watchdog.guard(what, timeout_s):
            if not idle:
                h = mx.distributed.recv((HEADER_LEN,), mx.int32, src, group=g)
                self._eval(h, src, what)
            try:
                head = parse_header(np.asarray(h))
            except ValueError as e:
                fatal(str(e), rank=self.rank)
            n = head.ledger_len + head.payload_len
            body = np.zeros(0, np.int32)
            if n:
                b = mx.distributed.recv((n,), mx.int32, src, group=g)
                self._eval(b, src, what)
                body = np.asarray(b)
            tensor = None
            if head.tensor_shape is not None:
                tensor = mx.distributed.recv(head.tensor_shape, head.tensor_dtype, src, group=g)
                self._eval(tensor, src, what)
        return Message(head.op, head.seq, body[head.ledger_len:], body[:head.ledger_len],
                       tensor)

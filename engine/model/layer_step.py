"""What an mlx-lm attention module gets as its ``cache`` on the runner's ``modules`` path.

mlx-lm's attention modules end the same way: RoPE at ``cache.offset``, then
``cache.update_and_fetch(keys, values)``, then their module's
``scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)``.
A `LayerStep` answers the first two (the offsets of this step's rows; K/V kept for the
pool) and `route_attention` points the module's attention function at `LayerStep.attend`
whenever the cache is a step — so the module's own code computes everything up to
attention and kvchat's paged attention computes the rest. Any other cache (mlx-lm's own
generation in the same process) reaches mlx-lm's function unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

# (queries, keys, values, scale, sinks) -> (B, Hq, L, D), keys/values as RoPE'd by the module
Attend = Callable[[mx.array, mx.array, mx.array, float, "mx.array | None"], mx.array]


class LayerStep:
    """One layer's part of one forward, in the shape of an mlx-lm cache."""

    __slots__ = ("offset", "_attend", "_kv")

    def __init__(self, offset: int | mx.array, attend: Attend):
        self.offset = offset  # int for one sequence; (rows,) positions of a batch
        self._attend = attend
        self._kv: tuple[mx.array, mx.array] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Keep this step's K/V (written into the pool by `attend`); return them as is."""
        self._kv = (keys, values)
        return keys, values

    def make_mask(self, *args, **kwargs):
        """No mask array: `attend` applies causality and the layer's window itself."""
        return None

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array:
        if self._kv is None:
            raise RuntimeError("attention reached before update_and_fetch")
        keys, values = self._kv
        self._kv = None
        return self._attend(queries, keys, values, float(scale), sinks)


def _paged(original: Callable) -> Callable:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, LayerStep):
            return cache.attend(queries, scale, sinks)
        return original(queries, keys, values, cache, scale, mask, sinks=sinks)

    scaled_dot_product_attention.kvchat_paged = True
    scaled_dot_product_attention.__wrapped__ = original
    return scaled_dot_product_attention


def route_attention(model: nn.Module) -> None:
    """Route the attention function of every module ``model``'s layers come from (once;
    idempotent, and a no-op for caches other than `LayerStep`)."""
    names = {type(m).__module__ for _, m in model.named_modules()}
    for name in sorted(n for n in names if n.startswith("mlx_lm.models.")):
        module = sys.modules.get(name)
        fn = getattr(module, "scaled_dot_product_attention", None)
        if fn is not None and not getattr(fn, "kvchat_paged", False):
            module.scaled_dot_product_attention = _paged(fn)

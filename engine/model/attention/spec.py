"""What one attention call is: the layer's spec and one batch's view of the pool."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from engine.kvcache.quantized_blocks import QuantizedBlocks
from engine.kvcache.residual_blocks import ResidualBlocks


class PoolFormat(Protocol):
    """A stored KV format (`QuantizedBlocks` is one): what the reference needs to read it.
    A new format implements this and works at once on the reference; each kernel's
    `supports` declines it until that kernel learns the format."""

    @property
    def shape(self) -> tuple[int, int, int, int]: ...  # (kv_heads, blocks, block_size, D)

    def gather(self, block_table: mx.array) -> mx.array:
        """The rows of blocks ``block_table`` (any index shape), as floats."""

    def run(self, start: int, stop: int) -> mx.array:
        """Token rows ``start:stop`` of a contiguous run, (kv_heads, n, head_dim)."""


Pool = mx.array | QuantizedBlocks | ResidualBlocks | PoolFormat
"""One side (K or V) of a layer's pool viewed (kv_heads, num_blocks, block_size, head_dim):
float rows, or a stored format."""


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """One layer's attention beyond q/k/v, fixed when the model loads.

    ``window``: the layer sees only its last ``window`` positions (sliding-window
    layers: a query at position p sees keys p - window + 1 .. p, as mlx-lm's
    rotating cache does). ``sinks``: (Hq,) learned logits, one per query head, that
    join every softmax without a value (gpt-oss), as `mx.fast.scaled_dot_product_attention`
    takes them.
    """

    scale: float
    window: int | None = None
    sinks: mx.array | None = None

    def __post_init__(self):
        if self.window is not None and self.window < 1:
            raise ValueError(f"attention window must be >= 1, got {self.window}")

    @property
    def plain(self) -> bool:
        """Full causal attention with no sinks: what every kernel computes."""
        return self.window is None and self.sinks is None

    @classmethod
    def of(cls, scale: float | AttentionSpec) -> AttentionSpec:
        """A spec as given, or the plain spec of a bare softmax scale."""
        return scale if isinstance(scale, AttentionSpec) else cls(float(scale))


@dataclass(slots=True)  # not frozen: built per layer per step, and frozen init costs more
class PagedCall:
    """One attention call: B sequences with L new queries each, over their blocks.

    ``context_lens[b]`` counts sequence b's tokens including its L new ones (already
    written to the pool); query i of sequence b sits at position
    ``context_lens[b] - L + i``. ``block_run``: B == 1 and the blocks are the
    contiguous run s, s+1, ... (the reference then reads a view, no gather).
    """

    queries: mx.array  # (B, Hq, L, D)
    k_pool: Pool
    v_pool: Pool
    block_tables: mx.array  # (B, max_blocks) int32
    context_lens: tuple[int, ...]
    spec: AttentionSpec
    block_run: int | None = None

    @property
    def batch(self) -> int:
        return self.queries.shape[0]

    @property
    def kind(self) -> str:
        """"decode" (one query each), "prefill" (one sequence, L > 1) or "verify"
        (several sequences with L > 1 each: a speculative draft checked at once)."""
        if self.queries.shape[2] == 1:
            return "decode"
        return "prefill" if self.batch == 1 else "verify"

    @property
    def max_context(self) -> int:
        return max(self.context_lens)

    @property
    def residual(self) -> bool:
        """A residual format (`ResidualBlocks`): its own reference reads it."""
        return isinstance(self.k_pool, ResidualBlocks)

    @property
    def plain_pools(self) -> bool:
        return isinstance(self.k_pool, mx.array) and isinstance(self.v_pool, mx.array)

    @property
    def pools_in_query_dtype(self) -> bool:
        """Plain pools stored in the queries' dtype: no cast, no dequantization."""
        return self.plain_pools and self.k_pool.dtype == self.v_pool.dtype == self.queries.dtype

    @property
    def gqa_ratio(self) -> int:
        return self.queries.shape[1] // self.k_pool.shape[0]

    def args(self) -> tuple:
        """The positional arguments every kernel entry point takes (the spec last: a
        kernel reads its scale, window and sinks)."""
        return (self.queries, self.k_pool, self.v_pool, self.block_tables, self.context_lens,
                self.spec)


def contiguous_run(block_table: Sequence[int]) -> int | None:
    """The first block id if ``block_table`` is s, s+1, s+2, ...; else None."""
    if not block_table:
        return None
    s = block_table[0]
    return s if all(b == s + i for i, b in enumerate(block_table)) else None

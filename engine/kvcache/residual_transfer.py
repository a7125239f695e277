"""Moving a residual pool's blocks out and back (`ResidualKVCache`'s transfer protocol).

The disk prefix cache stores and restores full blocks only, whose bytes are all in the
quantized store (`take` / `put`, whole full blocks; per-channel keys as the blocks' slices of
`channel_quant`'s store; the side store is never on disk). Swap moves a sequence's full
blocks the same way and its newest, filling block's exact rows apart (`take_rows` /
`put_rows`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.kvcache.kv_cache import Store


class ResidualTransfer:
    """Mixed into `ResidualKVCache` (before `PagedKVCache`, whose whole-row transfers it
    narrows to whole full blocks)."""

    def _full_blocks(self, slots: mx.array | slice) -> list[int]:
        """The blocks ``slots`` cover, each whole and in the quantized store; raises otherwise
        (a block still filling lives in the side store, which is never taken or put)."""
        bs = self.layout.block_size
        if isinstance(slots, slice):
            s = np.arange(slots.start, slots.stop, dtype=np.int64)
        else:
            s = np.asarray(slots, dtype=np.int64).reshape(-1)
        blocks = s[::bs] // bs
        if len(s) % bs or not (s.reshape(-1, bs) == blocks[:, None] * bs + np.arange(bs)).all():
            raise RuntimeError("a residual pool takes and puts whole blocks only")
        return blocks.tolist()

    def take(self, slots: mx.array) -> tuple[list[Store], list[Store]]:
        """Every layer's stored K and V of the whole, full blocks at ``slots`` (the disk
        store's write path): values as rows, keys as rows or, per channel, as the blocks'
        ``(kv_heads, n, head_dim, ·)`` slices. Raises RuntimeError for a block still filling."""
        blocks = self._full_blocks(slots)
        if (self._res_of[blocks] >= 0).any():
            raise RuntimeError("a residual block still filling cannot be taken (only full "
                               "blocks are cached)")
        keys, values = super().take(slots)
        if self.layout.key_channel:
            ids = mx.array(blocks, dtype=mx.int32)
            keys = [tuple(a[:, ids] for a in store) for store in self.keys]
        return keys, values

    def put(self, slots: mx.array | slice, keys: list[Store], values: list[Store]) -> None:
        """Write back whole full blocks from `take` (a disk restore) at ``slots``: they are
        quantized blocks from then on (a stale residual row of theirs goes back)."""
        blocks = self._full_blocks(slots)
        for b in blocks:
            if self._res_of[b] >= 0:
                self._free_rows.append(int(self._res_of[b]))
                self._res_of[b] = -1
        self._step_map = mx.array(self._res_of.astype(np.int32))
        if not self.layout.key_channel:
            super().put(slots, keys, values)
            return
        at = (slice(blocks[0], blocks[-1] + 1) if isinstance(slots, slice)
              else mx.array(blocks, dtype=mx.int32))
        for layer in range(self.layout.num_layers):
            for part, new in zip(self.keys[layer], keys[layer], strict=True):
                part[:, at] = new
            self._put(self.values[layer], slots, values[layer])

    def take_rows(self, block: int, count: int) -> tuple[list[mx.array], list[mx.array]]:
        """Per layer K and V, the first ``count`` exact rows of ``block``, still filling
        (swap: a sequence's newest block, which is in the side store)."""
        row = int(self._res_of[block])
        if row < 0 or not 0 < count < self.layout.block_size:
            raise RuntimeError(f"KV block {block} is not a filling block with {count} rows")
        # a gather, so the host copy is its own buffer, not a view the next write may reuse
        at = mx.arange(row * self.layout.block_size, row * self.layout.block_size + count)
        return [k[:, at] for k in self.res_keys], [v[:, at] for v in self.res_values]

    def put_rows(self, block: int, keys: list[mx.array], values: list[mx.array]) -> None:
        """Write rows from `take_rows` at the start of ``block`` (swap-in): a filling block
        again, whose next write continues after them."""
        if self._res_of[block] < 0:
            self._res_of[block] = self._take_row()
        start = int(self._res_of[block]) * self.layout.block_size
        at = slice(start, start + keys[0].shape[1])
        for layer in range(self.layout.num_layers):
            self.res_keys[layer][:, at] = keys[layer]
            self.res_values[layer][:, at] = values[layer]
        self._step_map = mx.array(self._res_of.astype(np.int32))

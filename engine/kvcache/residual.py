"""The residual pool: each block stays in the compute dtype until it fills, then is
quantized once, as a whole block (`KVLayout.residual`; keys per channel with
`KVLayout.key_channel`).

Lifecycle of a block: its first write takes a *residual* row (a block of the side store,
compute dtype, exact); rows are written there as they come; the write that fills its last
slot quantizes the whole block from those rows into the quantized store (one op per side
over every block that filled in the step) and gives the residual row back. So only full
blocks are ever quantized, and those are the only blocks the prefix cache registers and
shares. A block's quantized bytes depend on its own rows only, never on batching.

The side store grows on demand (about one block per running sequence); a residual row
left by a sequence that ended mid-block is reclaimed when its block is free again
(``free_ids``) or reused when the block is written from its start.

The disk prefix cache and swap carry them (`kvcache.residual_transfer`).

A verify step may fill (and quantize) a block with drafts that are then rejected:
`reopen` gives it its exact rows back, to be quantized again when accepted tokens fill it.
Context shift: `kvcache.residual_shift`. Sliding-window layers keep every block here (no
window store: `engine.wiring`) and read only their window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import mlx.core as mx
import numpy as np

from engine.kvcache import channel_quant, rotation
from engine.kvcache.kv_cache import KVLayout, PagedKVCache, Store, _quantize
from engine.kvcache.quant import QuantSpec
from engine.kvcache.quantized_blocks import QuantizedBlocks
from engine.kvcache.residual_blocks import ResidualBlocks
from engine.kvcache.residual_transfer import ResidualTransfer

FIRST_RESIDUAL_ROWS = 8  # residual blocks allocated up front; doubled when all are taken


class ResidualKVCache(ResidualTransfer, PagedKVCache):
    """A `PagedKVCache` whose blocks are quantized when they fill (see the module)."""

    def __init__(self, layout: KVLayout, num_blocks: int, row_writer=None, *,
                 quant_writer=None, channel_quant=None, sides_writer=None,
                 free_ids: Callable[[], Iterable[int]] | None = None):
        if not (layout.residual and layout.k_quant and layout.v_quant):
            raise ValueError("a residual pool needs a residual layout quantizing K and V")
        # the extension's one-op writes (`wiring.kv_writers`): row_writer the side store's
        # rows and every store's blocks, quant_writer per-token rows, channel_quant the
        # per-channel keys of filled blocks, sides_writer both sides' residual rows; without
        # them MLX's indexing and ops
        super().__init__(layout, num_blocks, row_writer, quant_writer=quant_writer,
                         sides_writer=sides_writer)
        self.channel_quant = channel_quant
        self.free_ids = free_ids  # the block manager's free blocks (wiring sets it)
        self._res_of = np.full(num_blocks, -1, dtype=np.int64)
        self._free_rows: list[int] = []
        self._num_rows = 0
        self.res_keys: list[mx.array] = []
        self.res_values: list[mx.array] = []
        self._grow(FIRST_RESIDUAL_ROWS)
        self._step_map = mx.array(self._res_of.astype(np.int32))
        self._plan_memo: tuple[mx.array, tuple] | None = None
        self._filled: dict[int, int] = {}  # blocks the latest step filled -> their rows

    def _empty(self, quant: QuantSpec | None, num_blocks: int, key: bool = False) -> Store:
        L = self.layout
        if key and L.key_channel:
            return channel_quant.empty_store(L.num_kv_heads, num_blocks, L.block_size,
                                             L.head_dim, quant.bits)
        return super()._empty(quant, num_blocks)

    # -- residual rows ---------------------------------------------------------------------

    @property
    def num_residual_blocks(self) -> int:
        """Residual rows held by blocks (the newest block of each running sequence, and
        any left by a sequence that ended mid-block, until reclaimed)."""
        return int((self._res_of >= 0).sum())

    def _grow(self, extra: int) -> None:
        L = self.layout
        shape = (L.num_kv_heads, extra * L.block_size, L.head_dim)
        for stores in (self.res_keys, self.res_values):
            if not stores:  # one array per layer: a write rebinds its array in place
                stores.extend(mx.zeros(shape, L.dtype) for _ in range(L.num_layers))
            for layer in range(len(stores)) if self._num_rows else ():
                stores[layer] = mx.concatenate([stores[layer], mx.zeros(shape, L.dtype)], 1)
        mx.eval(self.res_keys, self.res_values)
        self._free_rows.extend(range(self._num_rows, self._num_rows + extra))
        self._num_rows += extra

    def reclaim(self) -> int:
        """Give back the residual rows of blocks the block manager holds free; how many."""
        freed = 0
        for b in self.free_ids() if self.free_ids is not None else ():
            if self._res_of[b] >= 0:
                self._free_rows.append(int(self._res_of[b]))
                self._res_of[b] = -1
                freed += 1
        if freed:
            self._step_map = mx.array(self._res_of.astype(np.int32))
        return freed

    def _take_row(self) -> int:
        if not self._free_rows and not self.reclaim():
            self._grow(self._num_rows)  # doubled: rare, and each growth copies the store
        return self._free_rows.pop()

    def _plan(self, slots: mx.array) -> tuple:
        """(residual slots of the rows, filled blocks, their residual rows) for a step's
        ``slots``; once per slots array (every layer of a step shares it)."""
        if self._plan_memo is not None and self._plan_memo[0] is slots:
            return self._plan_memo[1]
        bs = self.layout.block_size
        s = np.asarray(slots, dtype=np.int64).reshape(-1)
        blocks, offsets = s // bs, s % bs
        for b in dict.fromkeys(blocks.tolist()):
            if self._res_of[b] < 0:
                if not (offsets[blocks == b] == 0).any():
                    raise RuntimeError(f"KV block {b} was written past its start after it "
                                       f"was quantized (a residual format cannot rewrite it)")
                self._res_of[b] = self._take_row()
        rslots = mx.array((self._res_of[blocks] * bs + offsets).astype(np.int32))
        filled = sorted(set(blocks[offsets == bs - 1].tolist()))
        rows = [int(self._res_of[b]) for b in filled]
        # this step still reads a filled block's exact rows (the query in it); later steps not
        self._step_map = mx.array(self._res_of.astype(np.int32))
        for b, r in zip(filled, rows, strict=True):
            self._free_rows.append(r)
            self._res_of[b] = -1
        self._filled = dict(zip(filled, rows, strict=True))
        plan = (rslots, filled, rows)
        self._plan_memo = (slots, plan)
        return plan

    def reopen(self, block: int) -> bool:
        """Rejected drafts gave back ``block``'s tail: if the latest step filled it, it
        takes back its residual row (its exact rows are still there); whether it did."""
        row = self._filled.pop(block, None)
        if row is None or row not in self._free_rows:  # not this step's, or taken since
            return False
        self._free_rows.remove(row)
        self._res_of[block] = row
        self._step_map = mx.array(self._res_of.astype(np.int32))
        return True

    # -- the pool's protocol ---------------------------------------------------------------

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store rows (kv_heads, N, head_dim) at ``slots`` in their blocks' residual rows,
        and quantize every block this write fills."""
        L = self.layout
        rslots, filled, rows = self._plan(slots)
        if self.sides_writer is not None:  # one node, in place: the lists hold the arrays
            self.res_keys[layer], self.res_values[layer] = self.sides_writer(
                self.res_keys[layer], self.res_values[layer], rslots, keys, values, None, None)
        else:
            for store, new in ((self.res_keys, keys), (self.res_values, values)):
                if self.row_writer is not None:
                    store[layer] = self.row_writer(store[layer], rslots, new)
                else:
                    store[layer][:, rslots] = new.astype(L.dtype)
        if filled:
            self._quantize_blocks(layer, filled, rows)

    def _quantize_blocks(self, layer: int, blocks: list[int], rows: list[int]) -> None:
        L = self.layout
        H, bs, D = L.num_kv_heads, L.block_size, L.head_dim
        at = mx.array(rows, dtype=mx.int32)
        slots = mx.array([b * bs + i for b in blocks for i in range(bs)], dtype=mx.int32)
        res_rows = mx.array([r * bs + i for r in rows for i in range(bs)], dtype=mx.int32)
        if L.key_channel and self.channel_quant is not None:  # gathered inside the op
            parts = self.channel_quant(self.res_keys[layer], at, bs, L.k_quant.bits,
                                       bool(L.k_quant.rotation))
        elif L.key_channel:  # rows rotated over the head dim, then grouped by channel
            k = self.res_keys[layer][:, res_rows]
            k = rotation.rotate(k) if L.k_quant.rotation else k
            parts = channel_quant.quantize_channels(k.reshape(H, -1, bs, D), L.k_quant.bits)
        if L.key_channel:
            ids = mx.array(blocks, dtype=mx.int32)
            self.keys[layer] = self._store(self.keys[layer], ids, parts)
        else:
            self.keys[layer] = self._quantized(self.keys[layer], slots,
                                               self.res_keys[layer][:, res_rows], L.k_quant)
        self.values[layer] = self._quantized(self.values[layer], slots,
                                             self.res_values[layer][:, res_rows], L.v_quant)

    def _quantized(self, store: tuple, slots: mx.array, rows: mx.array, quant) -> tuple:
        """``store`` with ``rows`` quantized per token at ``slots``: the one-op quantized
        write where there is one (bit for bit `_quantize`'s bytes)."""
        if self.quant_writer is not None and self.row_writer is not None:
            return self.quant_writer(store, slots, rows, quant)
        return self._store(store, slots, _quantize(rows, quant))

    def _store(self, store: tuple, at: mx.array, parts) -> tuple:
        """``store``'s parts with ``parts`` written at ``at`` (their second axis): new arrays
        through the one-op writer (in place when donated), so `snapshot` holds the old
        ones; MLX's indexing where there is no writer (it changes the arrays themselves)."""
        if self.row_writer is None:
            self._put(store, at, parts)
            return store
        return tuple(self.row_writer(a, at, new) for a, new in zip(store, parts, strict=True))

    @property
    def arrays(self) -> tuple:
        """The stores and the residual rows: a prefill chunk writes only the latter."""
        return self.keys, self.values, self.res_keys, self.res_values

    def snapshot(self) -> tuple | None:
        """The stores and the residual rows' bookkeeping as they are, for `restore`: a
        chained decode step rebuilt with other tokens plans its slots again from them. None
        without the one-op writer (MLX's indexing changes a store in place)."""
        if self.row_writer is None:
            return None
        return (list(self.keys), list(self.values), list(self.res_keys), list(self.res_values),
                self._res_of.copy(), list(self._free_rows), self._num_rows, self._step_map,
                self._plan_memo, dict(self._filled))

    def restore(self, snap: tuple) -> None:
        (self.keys[:], self.values[:], self.res_keys[:], self.res_values[:], self._res_of,
         self._free_rows, self._num_rows, self._step_map, self._plan_memo,
         self._filled) = snap

    def block_view(self, layer: int):
        """Layer ``layer``'s K and V as `ResidualBlocks`."""
        L = self.layout
        H, n, bs, D = L.num_kv_heads, self.num_blocks, L.block_size, L.head_dim
        if L.key_channel:
            k = channel_quant.ChannelBlocks(*self.keys[layer], L.k_quant.bits, bs)
        else:
            k = self._view(self.keys[layer], L.k_quant, n)
        v: QuantizedBlocks = self._view(self.values[layer], L.v_quant, n)
        return tuple(ResidualBlocks(q, res.reshape(H, -1, bs, D), self._step_map,
                                    bool(spec.rotation))
                     for q, res, spec in ((k, self.res_keys[layer], L.k_quant),
                                          (v, self.res_values[layer], L.v_quant)))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src -> dst) in every layer: a residual block's exact rows into
        a residual row of dst, a full block's quantized bytes as they are."""
        if not copies:
            return
        L = self.layout
        bs = L.block_size
        full = [(s, d) for s, d in copies if self._res_of[s] < 0]
        part = [(s, d) for s, d in copies if self._res_of[s] >= 0]
        for _, d in part:
            if self._res_of[d] < 0:
                self._res_of[d] = self._take_row()
        for _, d in full:  # dst now holds a full block: any stale residual row goes
            if self._res_of[d] >= 0:
                self._free_rows.append(int(self._res_of[d]))
                self._res_of[d] = -1

        def slots(pairs, side, res):
            ids = [int(self._res_of[p[side]]) if res else p[side] for p in pairs]
            return mx.array([i * bs + r for i in ids for r in range(bs)], dtype=mx.int32)

        for layer in range(L.num_layers):
            if part:
                src, dst = slots(part, 0, True), slots(part, 1, True)
                for store in (self.res_keys, self.res_values):
                    store[layer][:, dst] = store[layer][:, src]
            if full:
                src, dst = slots(full, 0, False), slots(full, 1, False)
                if L.key_channel:
                    s_ids = mx.array([s for s, _ in full], dtype=mx.int32)
                    d_ids = mx.array([d for _, d in full], dtype=mx.int32)
                    for a in self.keys[layer]:
                        a[:, d_ids] = a[:, s_ids]
                else:
                    self._put(self.keys[layer], dst, tuple(a[:, src] for a in self.keys[layer]))
                self._put(self.values[layer], dst,
                          tuple(a[:, src] for a in self.values[layer]))
        self._step_map = mx.array(self._res_of.astype(np.int32))
        mx.eval(*self.arrays)

"""The paged KV pool: per layer, one K and one V store of fixed-size blocks.

Layout per layer: ``(num_kv_heads, num_blocks * block_size, head_dim)``, viewed
as ``(num_kv_heads, num_blocks, block_size, head_dim)`` by attention: head-major,
so one sequence's gathered blocks are contiguous per head without a transpose. Writes go
through MLX indexing (``pool[slots] = rows``), which updates in place when the
pool has a single owner, so a step never copies the whole pool.

K and V may each be stored quantized in MLX's affine format (`mx.quantize`: packed
uint32 rows plus one float16 scale and bias per group of ``group_size`` elements),
like llama.cpp's separate K and V cache types. Writes quantize the new rows in their
slots; attention dequantizes only the blocks it reads (`QuantizedBlocks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.kvcache import quant as quant_format
from engine.kvcache import rotation
from engine.kvcache.quant import QuantSpec
from engine.kvcache.quantized_blocks import QuantizedBlocks
from engine.kvcache.window_blocks import WindowBlocks, pool_bytes

SCALE_DTYPE = getattr(mx, quant_format.SCALE_DTYPE)
# What attention reads (the kernels); `QuantSpec` admits more, as the disk store may meet more.
POOL_BITS = (4, 8)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and format of the KV pool; everything needed for byte accounting.

    ``dtype`` is the compute dtype K and V are read in; ``k_quant`` / ``v_quant``, when
    set, store that side quantized instead of in ``dtype``. ``residual``: a block stays in
    ``dtype`` until it fills, then is quantized once (`kvcache.residual`); ``key_channel``
    (needs it): K gets one scale and bias per (head, channel) over a block's tokens (KIVI).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: mx.Dtype
    k_quant: QuantSpec | None = None
    v_quant: QuantSpec | None = None
    residual: bool = False
    key_channel: bool = False

    def __post_init__(self):
        if self.key_channel and not (self.residual and self.k_quant):
            raise ValueError("per-channel keys need a quantized K and the residual block")
        for q in (self.k_quant, self.v_quant):
            if q is not None and q.bits not in POOL_BITS:
                raise ValueError(f"KV bits must be one of {POOL_BITS}, got {q.bits}")

    def _row_bytes(self, quant: QuantSpec | None, channel: bool = False) -> int:
        if quant and channel:  # a block's per-channel scales and biases, spread over its rows
            D = self.head_dim
            return D * quant.bits // 8 + -(-D * 2 * quant_format.SCALE_BYTES // self.block_size)
        return quant.bytes_per_row(self.head_dim) if quant else self.head_dim * self.dtype.size

    @property
    def bytes_per_token(self) -> int:
        """layers x kv_heads x (K row + V row) bytes; a quantized row counts its scales."""
        rows = self._row_bytes(self.k_quant, self.key_channel) + self._row_bytes(self.v_quant)
        return self.num_layers * self.num_kv_heads * rows

    quantized = property(lambda self: self.k_quant is not None or self.v_quant is not None)

    @property
    def kv_format(self) -> str:
        """The prefix-cache key's KV format: the dtype, or each side's quantized format."""
        dtype = str(self.dtype).removeprefix("mlx.core.")
        if not self.quantized:
            return dtype
        side = [q.name if q else dtype for q in (self.k_quant, self.v_quant)]
        if self.key_channel:  # one group per channel over a block: never a per-token block
            side[0] = side[0].replace(f"g{self.k_quant.group_size}", f"c{self.block_size}")
        residual = f",res={dtype}" if self.residual else ""
        return f"k={side[0]},v={side[1]}{residual}"

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        """How many whole blocks fit in ``budget_bytes``."""
        return budget_bytes // self.bytes_per_block


Store = mx.array | tuple[mx.array, mx.array, mx.array]  # plain, or (data, scales, biases)


def _quantize(rows: mx.array, q: QuantSpec) -> tuple[mx.array, mx.array, mx.array]:
    if q.rotation:  # attention rotates queries and outputs to match (`kvcache.rotation`)
        rows = rotation.rotate(rows)
    data, scales, biases = mx.quantize(rows, group_size=q.group_size, bits=q.bits)
    return data, scales.astype(SCALE_DTYPE), biases.astype(SCALE_DTYPE)


RowWriter = Callable[[mx.array, mx.array, mx.array], mx.array]
# (quantized store, slots, rows, format) -> the store with the rows written
QuantWriter = Callable[[tuple, mx.array, mx.array, QuantSpec], tuple]
# (K store, V store, slots, K rows, V rows, K format, V format) -> both stores written
SidesWriter = Callable[..., tuple]


class PagedKVCache:
    """K/V block storage for every layer of one model.

    ``row_writer(pool, slots, rows)``, when given, returns ``pool`` with ``rows`` written at
    ``slots`` for plain (unquantized) stores: the CPU extension's one-op `kv_write`, where
    MLX's indexing builds ~12 nodes per write. ``quant_writer`` does the same for a
    quantized store (the extension's `kv_write_quant`, bit for bit `_quantize`), and
    ``sides_writer`` both sides of a layer at once (`kv_write_sides`: one node, same bytes;
    a write node costs a decode step more than its work, measured in the README).
    """

    def __init__(self, layout: KVLayout, num_blocks: int, row_writer: RowWriter | None = None,
                 *, window: WindowBlocks | None = None, windowed: Sequence[bool] = (),
                 quant_writer: QuantWriter | None = None,
                 sides_writer: SidesWriter | None = None):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.layout = layout
        self.num_blocks = num_blocks
        self.row_writer = row_writer
        self.quant_writer = quant_writer
        self.sides_writer = sides_writer
        # sliding-window layers keep rows only for the blocks a window covers
        self.window = window
        self.windowed = [bool(w) and window is not None for w in windowed] or \
            [False] * layout.num_layers
        self._blocks = [window.num_window_blocks if w else num_blocks for w in self.windowed]
        self.keys: list[Store] = [self._empty(layout.k_quant, n, key=True) for n in self._blocks]
        self.values: list[Store] = [self._empty(layout.v_quant, n) for n in self._blocks]
        self._map: tuple[int, mx.array] | None = None
        self._memo: dict[tuple[int, int], tuple[object, int, mx.array]] = {}
        mx.eval(self.keys, self.values)

    def _empty(self, quant: QuantSpec | None, num_blocks: int, key: bool = False) -> Store:
        L = self.layout
        rows = (L.num_kv_heads, num_blocks * L.block_size)
        if quant is None:
            return mx.zeros((*rows, L.head_dim), L.dtype)
        groups = quant.num_groups(L.head_dim)
        return (mx.zeros((*rows, quant.packed_dim(L.head_dim)), mx.uint32),
                mx.zeros((*rows, groups), SCALE_DTYPE), mx.zeros((*rows, groups), SCALE_DTYPE))

    def _window_map(self) -> mx.array:
        version = self.window.version
        if self._map is None or self._map[0] != version:
            wmap = np.maximum(np.array(self.window.wmap, dtype=np.int32), 0)  # -1: scratch
            self._map = (version, mx.array(wmap))
        return self._map[1]

    def _translated(self, kind: int, index: mx.array) -> mx.array:
        """Window-store slots (kind 0) or block tables (kind 1) for ``index``, once per
        array and map version (every windowed layer of a step shares them)."""
        key = (kind, id(index))
        memo = self._memo.get(key)
        if memo is not None and memo[0] is index and memo[1] == self.window.version:
            return memo[2]
        if len(self._memo) > 64:  # one step's arrays; older ones are dead
            self._memo.clear()
        wmap = self._window_map()
        if kind == 1:
            out = mx.take(wmap, index)
        else:
            bs = self.layout.block_size
            out = mx.take(wmap, index // bs) * bs + index % bs
        self._memo[key] = (index, self.window.version, out)
        return out

    def slots_for(self, layer: int, slots: mx.array) -> mx.array:
        """Where ``slots`` (pool slots) live in layer ``layer``'s store."""
        return self._translated(0, slots) if self.windowed[layer] else slots

    def tables_for(self, layer: int, block_tables: mx.array) -> mx.array:
        """``block_tables`` as layer ``layer``'s store numbers its blocks (a windowed
        layer's blocks outside every window read scratch, which its mask hides)."""
        return self._translated(1, block_tables) if self.windowed[layer] else block_tables

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (all blocks, used or not)."""
        return self.bytes_for(self.num_blocks, self.window.num_window_blocks if self.window else 0)

    def bytes_for(self, blocks: int, window_blocks: int = 0) -> int:
        """Bytes of ``blocks`` pool blocks whose windowed layers hold ``window_blocks``."""
        L = self.layout
        return pool_bytes(L.bytes_per_block, L.num_layers, sum(self.windowed), blocks,
                          window_blocks)

    def _view(self, store: Store, quant: QuantSpec | None, num_blocks: int):
        L = self.layout
        if quant is None:
            return store.reshape(L.num_kv_heads, num_blocks, L.block_size, L.head_dim)
        parts = [a.reshape(L.num_kv_heads, num_blocks, L.block_size, a.shape[-1])
                 for a in store]
        return QuantizedBlocks(*parts, quant, L.head_dim)

    @property
    def arrays(self) -> tuple:
        """Every store a step writes: evaluating these finishes the step's K/V (a write left
        lazy would hold the pool and make the next step's writes copy it)."""
        return self.keys, self.values

    def snapshot(self) -> tuple[list[Store], list[Store]] | None:
        """The stores as they are, for `restore`: a built step's graph dropped undoes its
        writes. None where a write changes a store in place (MLX's indexing)."""
        L = self.layout
        if self.row_writer is None or (L.k_quant or L.v_quant) and self.quant_writer is None:
            return None
        return list(self.keys), list(self.values)

    def restore(self, snap: tuple[list[Store], list[Store]]) -> None:
        self.keys[:], self.values[:] = snap

    def block_view(self, layer: int):
        """Layer ``layer``'s K and V as ``(kv_heads, num_blocks, block_size, head_dim)``:
        arrays, or `QuantizedBlocks` for a quantized side."""
        L = self.layout
        n = self._blocks[layer]
        return (self._view(self.keys[layer], L.k_quant, n),
                self._view(self.values[layer], L.v_quant, n))

    @staticmethod
    def _put(store: Store, slots, rows) -> None:
        if isinstance(store, tuple):
            for part, new in zip(store, rows, strict=True):
                part[:, slots] = new
        else:
            store[:, slots] = rows

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store ``keys``/``values`` of shape (kv_heads, N, head_dim) at ``slots``."""
        L = self.layout
        slots = self.slots_for(layer, slots)
        if self.sides_writer is not None and not L.key_channel:
            self.keys[layer], self.values[layer] = self.sides_writer(
                self.keys[layer], self.values[layer], slots, keys, values, L.k_quant, L.v_quant)
            return
        for stores, rows, quant in ((self.keys, keys, L.k_quant),
                                    (self.values, values, L.v_quant)):
            if quant and self.quant_writer is not None:
                stores[layer] = self.quant_writer(stores[layer], slots, rows, quant)
            elif quant:
                self._put(stores[layer], slots, _quantize(rows, quant))
            elif self.row_writer is not None:
                stores[layer] = self.row_writer(stores[layer], slots, rows)
            else:
                self._put(stores[layer], slots, rows.astype(L.dtype))

    def take(self, slots: mx.array) -> tuple[list[Store], list[Store]]:
        """Every layer's stored K and V rows at ``slots``, in their stored format."""
        def rows(store: Store, layer: int) -> Store:
            at = self.slots_for(layer, slots)
            return tuple(a[:, at] for a in store) if isinstance(store, tuple) else store[:, at]

        return ([rows(k, i) for i, k in enumerate(self.keys)],
                [rows(v, i) for i, v in enumerate(self.values)])

    def put(self, slots: mx.array | slice, keys: list[Store], values: list[Store]) -> None:
        """Write back rows from `take` (the exact stored bytes) at ``slots``: an array, or a
        slice of consecutive slots (a slice update: on CPU a sixth of a scatter's cost)."""
        run = slots if isinstance(slots, slice) else None
        if run is not None and any(self.windowed):
            slots = mx.arange(run.start, run.stop, dtype=mx.int32)
        for layer in range(self.layout.num_layers):
            at = run if run is not None and not self.windowed[layer] else \
                self.slots_for(layer, slots)
            self._put(self.keys[layer], at, keys[layer])
            self._put(self.values[layer], at, values[layer])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src -> dst) in every layer: the copy-on-write step."""
        if not copies:
            return
        bs = self.layout.block_size
        src = mx.array([s * bs + i for s, _ in copies for i in range(bs)])
        dst = mx.array([d * bs + i for _, d in copies for i in range(bs)])
        keys, values = self.take(src)
        self.put(dst, keys, values)
        mx.eval(*self.arrays)

"""The prefix cache: reuse full KV blocks of earlier prompts, from RAM and from disk.

Each full block of a request's tokens gets a chained hash whose salt names the
model, tokenizer, prompt version, position parameters, KV format, block size,
tenant and permission version (`prefix_key.CacheSalt`). At admission a request
takes the longest run of cached blocks by reference (RAM), then restores the
next ones from the disk store; computed blocks are registered as they fill,
and prompt blocks are persisted by the store's background writer.

A disk entry holds a block's stored bytes exactly (`PagedKVCache.take` / `put`: a quantized
side's packed data, scales and biases, never re-quantized), and the salt names the pool's
full format (`EntrySpec.kv_format`), so no block is served to a pool of another format.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.disk.spec import EntrySpec
from engine.kvcache.disk.store import DiskPrefixStore
from engine.kvcache.kv_cache import KVLayout, PagedKVCache, Store
from engine.kvcache.prefix_key import CacheSalt, chain_hash

SWEEP_EVERY_S = 60.0  # expired entries leave the disk while the app runs, not only at start
RESTORE_BATCH_BYTES = 8 << 20  # host copies a disk restore holds at once, before the pool
# (smaller batches reuse freed heap: 32 MiB ones took fresh pages each time, +60 % CPU)
READ_AHEAD = 4  # blocks read and checksummed ahead of the one being judged (~1.4 MB here)
MAX_SLICE_RUNS = 8  # a batch in more runs of consecutive blocks is one scatter per tensor


@dataclass(slots=True)
class SeqPrefix:
    """One sequence's prefix-cache state: its salt, chained block hashes, registered blocks."""

    salt: CacheSalt
    hashes: list[bytes] = field(default_factory=list)  # chained, per full block
    registered: int = 0  # leading blocks already named in the cache
    ttl_s: float | None = None  # disk lifetime of its prompt blocks (None: the tenant's)
    frozen: bool = False  # context-shifted: its blocks are no longer its prefix's K/V


class PrefixCache:
    """Looks up, restores and registers prefix blocks of sequences in the pool.

    ``salt_base`` holds the salt's parts shared by every sequence of one engine
    (`prefix_key.salt_base`); a sequence adds its tenant and permission version. Its
    ``kv_format`` must name the pool's (``layout.kv_format``); the salt gets the complete
    name (`EntrySpec.kv_format`, which adds the compute dtype of a quantized pool).

    Raises:
        ValueError: ``salt_base["kv_format"]`` names another format than the pool's.
    """

    def __init__(self, kv: PagedKVCache, blocks: BlockManager, salt_base: dict, *,
                 enabled: bool = True, store: DiskPrefixStore | None = None):
        self.kv, self.blocks = kv, blocks
        self.enabled = enabled
        # what a disk entry of this pool must hold: anything else is a miss, never served
        self.entry_spec = EntrySpec.of(kv.layout)
        full = self.entry_spec.kv_format
        if salt_base["kv_format"] not in (kv.layout.kv_format, full):
            raise ValueError(f"salt kv_format {salt_base['kv_format']!r} is not the pool's "
                             f"{full!r}")
        self.base = {**salt_base, "kv_format": full}
        self.store = store if enabled else None
        self.disk_hits = 0
        self._next_sweep = time.monotonic() + SWEEP_EVERY_S

    def new_sequence(self, tenant: str, permission_version: int, *,
                     ttl_s: float | None = None) -> SeqPrefix:
        """The prefix state of a new sequence scoped to a tenant and permission version;
        ``ttl_s`` is the disk lifetime of the prompt blocks it writes (a pinned document)."""
        return SeqPrefix(CacheSalt(**self.base, tenant=tenant,
                                   permission_version=permission_version), ttl_s=ttl_s)

    def hashes(self, seq: SeqPrefix, token_ids: Sequence[int]) -> list[bytes]:
        """Chained hashes of the full blocks of ``token_ids`` (names in RAM and on disk)."""
        return list(self._hashes(seq, token_ids))

    def _hashes(self, seq: SeqPrefix, token_ids: Sequence[int]) -> list[bytes]:
        """Chained hashes of the sequence's full blocks (extended as it grows)."""
        bs = self.blocks.block_size
        full = len(token_ids) // bs
        hashes = seq.hashes
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if hashes else seq.salt.digest()
            hashes.append(chain_hash(parent, self._block_tokens(token_ids, i)))
        return hashes

    def _block_tokens(self, token_ids: Sequence[int], i: int) -> list[int]:
        bs = self.blocks.block_size
        return list(token_ids[i * bs:(i + 1) * bs])

    def ram_hits(self, seq: SeqPrefix, token_ids: Sequence[int]) -> list[int]:
        """Cached block ids for the prefix; the last token is always computed."""
        if not self.enabled or seq.frozen:
            return []
        usable = (len(token_ids) - 1) // self.blocks.block_size
        hashes = self._hashes(seq, token_ids)[:usable]
        return self.blocks.lookup(hashes, [self._block_tokens(token_ids, i)
                                           for i in range(len(hashes))])

    def admit(self, seq_id: int, seq: SeqPrefix, token_ids: Sequence[int]) -> tuple[int, str]:
        """Allocate the sequence on its cached prefix: (cached tokens, "none"|"memory"|"disk")."""
        hits = self.ram_hits(seq, token_ids)
        self.blocks.allocate_cached(seq_id, hits)
        seq.registered = len(hits)
        source = "memory" if hits else "none"
        if (self.store is not None and not seq.frozen
                and self._restore_from_disk(seq_id, seq, token_ids)):
            source = "disk"
        return seq.registered * self.blocks.block_size, source

    def _restore_from_disk(self, seq_id: int, seq: SeqPrefix, token_ids: Sequence[int]) -> int:
        """Copy the next blocks of the prefix from the disk store into the pool.

        Blocks go into the pool in batches of up to `RESTORE_BATCH_BYTES`, a run of
        consecutive blocks as one slice update per tensor (`_put_blocks`): one scatter per
        block and tensor, 60 per block of the default model at ~35 µs each on CPU, was
        two thirds of a 2.4k-token restore.
        """
        bs = self.blocks.block_size
        usable = (len(token_ids) - 1) // bs
        hashes, restored = self._hashes(seq, token_ids), 0
        per_batch = max(1, RESTORE_BATCH_BYTES // self.kv.layout.bytes_per_block)
        batch: list[list[np.ndarray]] = []
        run = list(itertools.takewhile(lambda i: self.store.contains(hashes[i]),
                                       range(seq.registered, usable)))
        ahead = {i: self.store.prefetch(hashes[i]) for i in run[:READ_AHEAD]}
        for k, i in enumerate(run):
            if k + READ_AHEAD < len(run):  # the reader thread reads and hashes ahead
                ahead[run[k + READ_AHEAD]] = self.store.prefetch(hashes[run[k + READ_AHEAD]])
            if not self.blocks.can_append(seq_id, bs):
                break
            arrays = self.store.get(seq.salt, hashes[i], self._block_tokens(token_ids, i),
                                    expect=self.entry_spec, prefetched=ahead.pop(i))
            if arrays is None:  # corrupt, foreign or expired: a miss, removed by the store
                break
            self.blocks.append(seq_id, bs)
            batch.append(arrays)
            if len(batch) == per_batch:
                restored += self._put_blocks(seq_id, seq, token_ids, batch)
                batch = []
        for unused in ahead.values():  # reads only: nothing was judged or counted for them
            unused.cancel()
        if batch:
            restored += self._put_blocks(seq_id, seq, token_ids, batch)
        self.disk_hits += restored
        return restored

    def _put_blocks(self, seq_id: int, seq: SeqPrefix, token_ids: Sequence[int],
                    batch: list[list[np.ndarray]]) -> int:
        """Write blocks read from disk, the next ones of ``seq`` (already in its table),
        into the pool as stored, and register them."""
        bs, first = self.blocks.block_size, seq.registered
        ids = self.blocks.block_tables[seq_id][first:first + len(batch)]
        cuts = [j for j in range(1, len(ids)) if ids[j] != ids[j - 1] + 1]
        runs = list(zip([0, *cuts], [*cuts, len(ids)], strict=True))
        for a, b in runs if len(runs) <= MAX_SLICE_RUNS else [(0, len(ids))]:
            whole = [np.concatenate(parts, axis=1) for parts in zip(*batch[a:b], strict=True)]
            where = (slice(ids[a] * bs, (ids[a] + b - a) * bs) if len(runs) <= MAX_SLICE_RUNS
                     else mx.array([k * bs + r for k in ids for r in range(bs)], dtype=mx.int32))
            self.kv.put(where, *block_stores(whole, self.kv.layout))
        for i, block in enumerate(ids, start=first):
            self.blocks.register(block, seq.hashes[i], self._block_tokens(token_ids, i))
        seq.registered += len(ids)
        mx.eval(*self.kv.arrays)  # the batch's host copies can go now
        return len(ids)

    def due(self, seq: SeqPrefix, num_computed: int) -> bool:
        """Whether `on_computed` has a block to register (one newly full and computed), so
        that a caller builds its token list only then."""
        return (self.enabled and not seq.frozen
                and num_computed // self.blocks.block_size > seq.registered)

    def on_computed(self, seq_id: int, seq: SeqPrefix, token_ids: Sequence[int],
                    num_computed: int, prompt_len: int) -> None:
        """Register blocks that just became full and computed; persist prompt blocks."""
        if not self.due(seq, num_computed):
            return
        bs = self.blocks.block_size
        full = num_computed // bs
        hashes = self._hashes(seq, token_ids)
        table = self.blocks.block_tables[seq_id]
        persist = []
        for i in range(seq.registered, full):
            tokens = self._block_tokens(token_ids, i)
            if not self.blocks.register(table[i], hashes[i], tokens):
                continue
            if self.store is not None and (i + 1) * bs <= prompt_len:
                persist.append((i, tokens))
        # one gather and one read-back for all of them (a block at a time was 60 syncs each)
        copies = blocks_arrays(self.kv, [table[i] for i, _ in persist], bs)
        for (i, tokens), arrays in zip(persist, copies, strict=True):
            parent = hashes[i - 1] if i else seq.salt.digest()
            self.store.put_async(seq.salt, hashes[i], parent, tokens, arrays,
                                 ttl_s=seq.ttl_s, spec=self.entry_spec)
        seq.registered = full

    def maybe_sweep(self) -> int:
        """Delete expired disk entries (and enforce the budget) once a minute."""
        if self.store is None or time.monotonic() < self._next_sweep:
            return 0
        self._next_sweep = time.monotonic() + SWEEP_EVERY_S
        return self.store.sweep()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def _to_np(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:  # numpy has none: its bits travel as uint16
        return np.array(mx.view(a, mx.uint16))
    return np.array(a)


def _to_mx(a: np.ndarray) -> mx.array:
    if a.dtype == np.uint16:  # bfloat16 bits
        return mx.view(mx.array(a), mx.bfloat16)
    return mx.array(a)


def block_arrays(kv: PagedKVCache, slots: mx.array) -> list[np.ndarray]:
    """The stored bytes of the rows at ``slots`` as a disk entry's tensors (numpy copies, in
    `EntrySpec.tensors` order: each layer's K, then each layer's V; a quantized side as
    data, scales, biases)."""
    keys, values = kv.take(slots)
    flat = [a for store in keys + values for a in (store if isinstance(store, tuple) else (store,))]
    mx.eval(flat)  # one evaluation, not one per tensor
    return [_to_np(a) for a in flat]


def blocks_arrays(kv: PagedKVCache, blocks: Sequence[int],
                  block_size: int) -> list[list[np.ndarray]]:
    """`block_arrays` of several blocks at once: one gather per tensor, one read-back."""
    if not blocks:
        return []
    slots = mx.array([b * block_size + r for b in blocks for r in range(block_size)])
    whole = block_arrays(kv, slots)
    # axis 1 holds a tensor's rows (block_size a block) or, per-channel keys, its blocks (one)
    units = [a.shape[1] // len(blocks) for a in whole]
    return [[np.ascontiguousarray(a[:, j * n:(j + 1) * n])
             for a, n in zip(whole, units, strict=True)] for j in range(len(blocks))]


def block_stores(arrays: Sequence[np.ndarray],
                 layout: KVLayout) -> tuple[list[Store], list[Store]]:
    """The inverse of `block_arrays`: per-layer K and V `Store`s for `PagedKVCache.put`."""
    parts = iter(arrays)

    def side(quant) -> Store:
        if quant is None:
            return _to_mx(next(parts))
        return tuple(_to_mx(next(parts)) for _ in range(3))

    keys = [side(layout.k_quant) for _ in range(layout.num_layers)]
    values = [side(layout.v_quant) for _ in range(layout.num_layers)]
    return keys, values

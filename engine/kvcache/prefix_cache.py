"""The prefix cache: reuse full KV blocks of earlier prompts, from RAM and from disk.

Each full block of a request's tokens gets a chained hash whose salt names the
model, tokenizer, prompt version, position parameters, KV format, block size,
tenant and permission version (`prefix_key.CacheSalt`). At admission a request
takes the longest run of cached blocks by reference (RAM), then restores the
next ones from the disk store; computed blocks are registered as they fill,
and prompt blocks are persisted by the store's background writer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.disk_entry import EntrySpec
from engine.kvcache.disk_store import DiskPrefixStore
from engine.kvcache.kv_cache import PagedKVCache
from engine.kvcache.prefix_key import CacheSalt, chain_hash

SWEEP_EVERY_S = 60.0  # expired entries leave the disk while the app runs, not only at start


@dataclass(slots=True)
class SeqPrefix:
    """One sequence's prefix-cache state: its salt, chained block hashes, registered blocks."""

    salt: CacheSalt
    hashes: list[bytes] = field(default_factory=list)  # chained, per full block
    registered: int = 0  # leading blocks already named in the cache


class PrefixCache:
    """Looks up, restores and registers prefix blocks of sequences in the pool.

    ``salt_base`` holds the salt's parts shared by every sequence of one engine
    (`prefix_key.salt_base`); a sequence adds its tenant and permission version.
    """

    def __init__(self, kv: PagedKVCache, blocks: BlockManager, salt_base: dict, *,
                 enabled: bool = True, store: DiskPrefixStore | None = None):
        self.kv, self.blocks = kv, blocks
        self.enabled = enabled
        self.base = salt_base
        self.store = store if enabled else None
        L = kv.layout
        # what a disk entry of this pool must hold: anything else is a miss, never served
        self.entry_spec = None if self.store is None else EntrySpec(
            2 * L.num_layers, (L.num_kv_heads, L.block_size, L.head_dim), salt_base["kv_format"])
        self.disk_hits = 0
        self._next_sweep = time.monotonic() + SWEEP_EVERY_S

    def new_sequence(self, tenant: str, permission_version: int) -> SeqPrefix:
        """The prefix state of a new sequence scoped to a tenant and permission version."""
        return SeqPrefix(CacheSalt(**self.base, tenant=tenant,
                                   permission_version=permission_version))

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
        if not self.enabled:
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
        if self.store is not None and self._restore_from_disk(seq_id, seq, token_ids):
            source = "disk"
        return seq.registered * self.blocks.block_size, source

    def _restore_from_disk(self, seq_id: int, seq: SeqPrefix, token_ids: Sequence[int]) -> int:
        """Copy the next blocks of the prefix from the disk store into the pool."""
        bs = self.blocks.block_size
        usable = (len(token_ids) - 1) // bs
        hashes, restored = self._hashes(seq, token_ids), 0
        for i in range(seq.registered, usable):
            if not self.store.contains(hashes[i]) or not self.blocks.can_append(seq_id, bs):
                break
            tokens = self._block_tokens(token_ids, i)
            arrays = self.store.get(seq.salt, hashes[i], tokens, expect=self.entry_spec)
            if arrays is None:  # corrupt, foreign or expired: a miss, removed by the store
                break
            slots = mx.array(self.blocks.append(seq_id, bs).slots, dtype=mx.int32)
            n_layers = len(self.kv.keys)
            for layer in range(n_layers):
                k, v = arrays[layer], arrays[n_layers + layer]
                self.kv.write(layer, slots, self._to_mx(k), self._to_mx(v))
            self.blocks.register(self.blocks.block_tables[seq_id][i], hashes[i], tokens)
            seq.registered += 1
            restored += 1
        if restored:
            mx.eval(self.kv.keys, self.kv.values)
            self.disk_hits += restored
        return restored

    def _to_mx(self, a: np.ndarray) -> mx.array:
        if a.dtype == np.uint16:  # bfloat16 bits
            return mx.view(mx.array(a), mx.bfloat16)
        return mx.array(a)

    def _to_np(self, a: mx.array) -> np.ndarray:
        if a.dtype == mx.bfloat16:
            return np.array(mx.view(a, mx.uint16))
        return np.array(a)

    def on_computed(self, seq_id: int, seq: SeqPrefix, token_ids: Sequence[int],
                    num_computed: int, prompt_len: int) -> None:
        """Register blocks that just became full and computed; persist prompt blocks."""
        if not self.enabled:
            return
        bs = self.blocks.block_size
        full = num_computed // bs
        if full <= seq.registered:
            return
        hashes = self._hashes(seq, token_ids)
        table = self.blocks.block_tables[seq_id]
        for i in range(seq.registered, full):
            tokens = self._block_tokens(token_ids, i)
            if not self.blocks.register(table[i], hashes[i], tokens):
                continue
            if self.store is not None and (i + 1) * bs <= prompt_len:
                rows = slice(table[i] * bs, (table[i] + 1) * bs)
                arrays = [self._to_np(k[:, rows]) for k in self.kv.keys]
                arrays += [self._to_np(v[:, rows]) for v in self.kv.values]
                parent = hashes[i - 1] if i else seq.salt.digest()
                self.store.put_async(seq.salt, hashes[i], parent, tokens, arrays)
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

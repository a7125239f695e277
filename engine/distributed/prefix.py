"""The disk prefix store across ranks: one store per rank, holding that rank's part of a block.

Rank 0 keeps the prefix index (in RAM, in its block manager) and its own disk store; every
other rank has a store of its own, in its own directory, whose entries hold only its layers'
(or heads') K/V. Each rank names an entry with its own salt, which includes its part of the
model (`stage.prepare_rank` folds rank, world size, mode and layer range into the
fingerprint), so after a restart with another split no rank finds an entry computed for
other layers: a miss, never a wrong block.

- persist: when rank 0 writes a prompt block to its store, it tells the ranks (tenant, the
  prefix's token ids, block index and id); each computes its own chained hash and writes its
  rows of the block (`PERSIST`, no reply: it travels ahead of the next step).
- restore: a disk hit needs every rank to hold its part. Rank 0 asks how many of the next
  blocks every rank can read (`RESTORE_CHECK`: each reads and keeps them, the answer is the
  minimum), restores that many itself, and says which blocks they went to (`RESTORE_COMMIT`):
  the ranks write what they read into the same blocks, before the step that uses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.distributed import plan_wire as wire
from engine.distributed.plan_wire import Op
from engine.kvcache.disk.spec import EntrySpec
from engine.kvcache.disk.store import DiskPrefixStore
from engine.kvcache.kv_cache import PagedKVCache
from engine.kvcache.prefix_cache import PrefixCache, SeqPrefix, block_stores, blocks_arrays
from engine.kvcache.prefix_key import CacheSalt, block_hashes
from engine.paths import cache_root


def rank_store_dir(root: str | None, rank: int) -> Path:
    """Rank ``rank``'s store directory: rank 0 uses the usual one, rank r a sibling
    ``<dir>-rank<r>`` (ranks on one machine never share, or evict from, one directory)."""
    base = Path(root).expanduser() if root else cache_root() / "prefix"
    return base if rank == 0 else base.with_name(f"{base.name}-rank{rank}")


def _scope(salt: CacheSalt, ttl_s: float | None, tokens: Sequence[int]) -> np.ndarray:
    """A sequence's tenant, permission version, disk TTL and prefix tokens as int32s."""
    v = salt.permission_version
    ttl_ms = -1 if ttl_s is None else int(ttl_s * 1000)
    head = [v >> 32, v & 0xFFFFFFFF, ttl_ms >> 32, ttl_ms & 0xFFFFFFFF, len(tokens)]
    return np.concatenate([wire.encode_text(salt.tenant),
                           np.asarray(head, np.int64).astype(np.uint32).view(np.int32),
                           np.asarray(tokens, np.int32)])


def _read_scope(p: np.ndarray) -> tuple[str, int, float | None, np.ndarray, int]:
    """(tenant, permission version, ttl_s, tokens, index after them)."""
    tenant, i = wire.decode_text(p, 0)
    hi, lo, thi, tlo, n = (int(x) for x in p[i:i + 5].view(np.uint32))
    ttl_ms = (thi << 32 | tlo) - (1 << 64 if thi >> 31 else 0)
    i += 5
    return (tenant, hi << 32 | lo, None if ttl_ms < 0 else ttl_ms / 1000, p[i:i + n],
            i + n)


def fold_count(payload: np.ndarray, have: int) -> np.ndarray:
    """A RESTORE_CHECK payload whose last element, the blocks every rank so far can serve,
    is lowered to ``have``."""
    out = payload.copy()
    out[-1] = min(int(out[-1]), have)
    return out


class _Recording:
    """Rank 0's store, noting which blocks `PrefixCache.on_computed` writes."""

    def __init__(self, store: DiskPrefixStore):
        self.inner, self.written = store, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_async(self, salt, block_hash, *args, **kwargs):
        self.written.append(block_hash)
        return self.inner.put_async(salt, block_hash, *args, **kwargs)


class LeaderPrefixCache(PrefixCache):
    """Rank 0's prefix cache: its disk writes and restores are repeated on every rank."""

    def __init__(self, cache: PrefixCache, leader):
        super().__init__(cache.kv, cache.blocks, cache.base, enabled=cache.enabled,
                         store=_Recording(cache.store) if cache.store is not None else None)
        self.leader = leader

    def on_computed(self, seq_id: int, seq: SeqPrefix, token_ids: Sequence[int],
                    num_computed: int, prompt_len: int) -> None:
        if self.store is None:
            return super().on_computed(seq_id, seq, token_ids, num_computed, prompt_len)
        self.store.written = []
        super().on_computed(seq_id, seq, token_ids, num_computed, prompt_len)
        if not self.store.written:
            return
        index = {h: i for i, h in enumerate(seq.hashes)}
        done = [index[h] for h in self.store.written]
        table, bs = self.blocks.block_tables[seq_id], self.blocks.block_size
        pairs = np.asarray([(i, table[i]) for i in done], np.int32).reshape(-1)
        self.leader.post(Op.PERSIST, np.concatenate([
            _scope(seq.salt, seq.ttl_s, token_ids[:(max(done) + 1) * bs]),
            np.asarray([len(done)], np.int32), pairs]))

    def _restore_from_disk(self, seq_id: int, seq: SeqPrefix, token_ids: Sequence[int]) -> int:
        bs = self.blocks.block_size
        usable = (len(token_ids) - 1) // bs
        hashes, start, n = self._hashes(seq, token_ids), seq.registered, 0
        while (start + n < usable and self.store.contains(hashes[start + n])
               and self.blocks.can_append(seq_id, (n + 1) * bs)):
            n += 1
        if not n:
            return 0
        # every rank reads its part first; a block restores only where all of them can
        reply = self.leader.exchange(Op.RESTORE_CHECK, np.concatenate([
            _scope(seq.salt, seq.ttl_s, token_ids[:(start + n) * bs]),
            np.asarray([start, n, n], np.int32)]), what="asking the ranks for disk blocks")
        agreed = min(n, int(reply.payload[-1]))
        restored = []
        for i in range(start, start + agreed):
            tokens = self._block_tokens(token_ids, i)
            arrays = self.store.get(seq.salt, hashes[i], tokens, expect=self.entry_spec)
            if arrays is None:  # corrupt, foreign or expired: a miss, removed by the store
                break
            slots = mx.array(self.blocks.append(seq_id, bs).slots, dtype=mx.int32)
            self.kv.put(slots, *block_stores(arrays, self.kv.layout))
            block = self.blocks.block_tables[seq_id][i]
            self.blocks.register(block, hashes[i], tokens)
            seq.registered += 1
            restored.append(block)
        self.leader.post(Op.RESTORE_COMMIT, np.asarray(restored, np.int32))
        if restored:
            mx.eval(*self.kv.arrays)
            self.disk_hits += len(restored)
        return len(restored)


class RankStore:
    """A non-zero rank's disk store: writes and reads its part of the blocks rank 0 names."""

    def __init__(self, store: DiskPrefixStore, salt_base: dict, kv: PagedKVCache):
        self.store, self.kv = store, kv
        self.spec = EntrySpec.of(kv.layout)
        self.base = {**salt_base, "kv_format": self.spec.kv_format}
        self._stash: list[list[np.ndarray]] = []  # read by the last check, for the commit

    def _chain(self, p: np.ndarray) -> tuple[CacheSalt, float | None, list[int], list[bytes],
                                              int]:
        tenant, version, ttl_s, tokens, end = _read_scope(p)
        salt = CacheSalt(**self.base, tenant=tenant, permission_version=version)
        tokens = [int(t) for t in tokens]
        return salt, ttl_s, tokens, block_hashes(salt, tokens), end

    def _slots(self, block: int) -> mx.array:
        bs = self.kv.layout.block_size
        return mx.arange(block * bs, (block + 1) * bs, dtype=mx.int32)

    def persist(self, p: np.ndarray) -> None:
        salt, ttl_s, tokens, hashes, end = self._chain(p)
        bs = self.kv.layout.block_size
        n = int(p[end])
        pairs = [(int(i), int(block)) for i, block in p[end + 1:end + 1 + 2 * n].reshape(-1, 2)]
        # one gather and read-back for all of them, as the single-process cache does
        copies = blocks_arrays(self.kv, [block for _, block in pairs], bs)
        for (i, _), arrays in zip(pairs, copies, strict=True):
            parent = hashes[i - 1] if i else salt.digest()
            self.store.put_async(salt, hashes[i], parent, tokens[i * bs:(i + 1) * bs],
                                 arrays, ttl_s=ttl_s, spec=self.spec)

    def check(self, p: np.ndarray) -> np.ndarray:
        """Read the asked blocks (kept for the commit); the payload with the count this
        rank can serve folded in (`fold_count`)."""
        salt, _, tokens, hashes, end = self._chain(p)
        bs = self.kv.layout.block_size
        start, n = int(p[end]), int(p[end + 1])
        self._stash = []
        for i in range(start, start + n):
            arrays = self.store.get(salt, hashes[i], tokens[i * bs:(i + 1) * bs],
                                    expect=self.spec)
            if arrays is None:
                break
            self._stash.append(arrays)
        return fold_count(p, len(self._stash))

    def commit(self, blocks: np.ndarray) -> None:
        """Write the first blocks read by `check` into the blocks rank 0 put them in."""
        for arrays, block in zip(self._stash, blocks, strict=False):
            self.kv.put(self._slots(int(block)), *block_stores(arrays, self.kv.layout))
        self._stash = []
        if len(blocks):
            mx.eval(*self.kv.arrays)

    def close(self) -> None:
        self.store.close()

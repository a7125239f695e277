"""The prefix cache: reuse full KV blocks of earlier prompts, from RAM and from disk.

Each full block of a request's tokens gets a chained hash whose salt names the
model, tokenizer, prompt version, position parameters, KV format, block size,
tenant and permission version (`prefix_key.CacheSalt`). At admission a request
takes the longest run of cached blocks by reference (RAM), then restores the
next ones from the disk store; computed blocks are registered as they fill,
and prompt blocks are persisted by the store's background writer.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.config import EngineConfig
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.disk_store import DiskPrefixStore
from engine.kvcache.kv_cache import PagedKVCache
from engine.kvcache.prefix_key import CacheSalt, chain_hash
from engine.model.loader import LoadedModel
from engine.request import Request

SWEEP_EVERY_S = 60.0  # expired entries leave the disk while the app runs, not only at start


def salt_base(loaded: LoadedModel, kv: PagedKVCache) -> dict:
    """The salt's parts shared by every request of this engine (all but the tenant scope)."""
    cfg = loaded.config
    template = getattr(loaded.tokenizer, "chat_template", None) or ""
    scaling = cfg.get("rope_scaling")
    position = (f"rope_theta={cfg.get('rope_theta')},traditional={cfg.get('rope_traditional')},"
                f"scaling={sorted(scaling.items()) if isinstance(scaling, dict) else scaling}")
    return dict(
        model_fingerprint=loaded.fingerprint,
        tokenizer_fingerprint=loaded.tokenizer_fingerprint,
        prompt_version="tmpl-" + hashlib.sha256(template.encode()).hexdigest()[:16],
        position=position,
        kv_format=str(kv.layout.dtype).removeprefix("mlx.core."),
        block_size=kv.layout.block_size,
    )


class PrefixCache:
    """Looks up, restores and registers prefix blocks for the engine's requests."""

    def __init__(self, loaded: LoadedModel, kv: PagedKVCache, blocks: BlockManager,
                 config: EngineConfig):
        self.kv, self.blocks = kv, blocks
        self.enabled = config.prefix_cache
        self.base = salt_base(loaded, kv)
        self.store: DiskPrefixStore | None = None
        if config.prefix_cache and config.disk_cache:
            root = Path(config.disk_cache_dir).expanduser() if config.disk_cache_dir else None
            self.store = DiskPrefixStore(root, budget_bytes=config.disk_budget_bytes,
                                         default_ttl_s=config.disk_ttl_s, max_pending=256)
        self.disk_hits = 0
        self._next_sweep = time.monotonic() + SWEEP_EVERY_S

    def salt(self, req: Request) -> CacheSalt:
        return CacheSalt(**self.base, tenant=req.tenant,
                         permission_version=req.permission_version)

    def _hashes(self, req: Request) -> list[bytes]:
        """Chained hashes of the request's full blocks (extended as it grows)."""
        bs = self.blocks.block_size
        full = req.total_len // bs
        if req.salt is None:
            req.salt = self.salt(req)
        hashes, ids = req.block_hashes, req.all_ids
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if hashes else req.salt.digest()
            hashes.append(chain_hash(parent, ids[i * bs:(i + 1) * bs]))
        return hashes

    def _token_blocks(self, req: Request, n: int) -> list[list[int]]:
        bs, ids = self.blocks.block_size, req.all_ids
        return [ids[i * bs:(i + 1) * bs] for i in range(n)]

    def ram_hits(self, req: Request) -> list[int]:
        """Cached block ids for the request's prefix; the last token is always computed."""
        if not self.enabled:
            return []
        usable = (req.total_len - 1) // self.blocks.block_size
        hashes = self._hashes(req)[:usable]
        return self.blocks.lookup(hashes, self._token_blocks(req, len(hashes)))

    def admit(self, req: Request) -> tuple[int, str]:
        """Allocate the request's sequence on its cached prefix; (cached tokens, source)."""
        hits = self.ram_hits(req)
        self.blocks.allocate_cached(req.request_id, hits)
        req.num_computed = len(hits) * self.blocks.block_size
        req.registered = len(hits)
        source = "memory" if hits else "none"
        if self.store is not None and self._restore_from_disk(req):
            source = "disk"
        return req.num_computed, source

    def _restore_from_disk(self, req: Request) -> int:
        """Copy the next blocks of the prefix from the disk store into the pool."""
        bs = self.blocks.block_size
        usable = (req.total_len - 1) // bs
        hashes, restored = self._hashes(req), 0
        for i in range(req.registered, usable):
            if not self.store.contains(hashes[i]) or not self.blocks.can_append(
                    req.request_id, bs):
                break
            tokens = req.all_ids[i * bs:(i + 1) * bs]
            arrays = self.store.get(req.salt, hashes[i], tokens)
            if arrays is None:  # corrupt, foreign or expired: a miss, removed by the store
                break
            slots = mx.array(self.blocks.append(req.request_id, bs).slots, dtype=mx.int32)
            n_layers = len(self.kv.keys)
            for layer in range(n_layers):
                k, v = arrays[layer], arrays[n_layers + layer]
                self.kv.write(layer, slots, self._to_mx(k), self._to_mx(v))
            self.blocks.register(self.blocks.block_tables[req.request_id][i], hashes[i], tokens)
            req.num_computed += bs
            req.registered += 1
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

    def on_computed(self, req: Request) -> None:
        """Register blocks that just became full and computed; persist prompt blocks."""
        if not self.enabled:
            return
        bs = self.blocks.block_size
        full = req.num_computed // bs
        if full <= req.registered:
            return
        hashes = self._hashes(req)
        table = self.blocks.block_tables[req.request_id]
        for i in range(req.registered, full):
            tokens = req.all_ids[i * bs:(i + 1) * bs]
            if not self.blocks.register(table[i], hashes[i], tokens):
                continue
            if self.store is not None and (i + 1) * bs <= len(req.prompt_ids):
                rows = slice(table[i] * bs, (table[i] + 1) * bs)
                arrays = [self._to_np(k[:, rows]) for k in self.kv.keys]
                arrays += [self._to_np(v[:, rows]) for v in self.kv.values]
                parent = hashes[i - 1] if i else req.salt.digest()
                self.store.put_async(req.salt, hashes[i], parent, tokens, arrays)
        req.registered = full

    def maybe_sweep(self) -> int:
        """Delete expired disk entries (and enforce the budget) once a minute."""
        if self.store is None or time.monotonic() < self._next_sweep:
            return 0
        self._next_sweep = time.monotonic() + SWEEP_EVERY_S
        return self.store.sweep()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

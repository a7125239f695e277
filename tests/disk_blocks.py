"""The disk store tests' blocks and helpers: a salt, an injectable clock, blocks to put and get."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from engine.kvcache.disk.store import DiskPrefixStore
from engine.kvcache.prefix_key import CacheSalt, chain_hash

BS = 4
SALT = CacheSalt(
    model_fingerprint="sha256:model-a",
    tokenizer_fingerprint="sha256:tok-a",
    prompt_version="raw",
    position="rope_theta=10000,traditional=False,scaling=None",
    kv_format="float32",
    block_size=BS,
)
T0 = 1_700_000_000.0


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Block(NamedTuple):
    salt: CacheSalt
    hash: bytes
    parent: bytes
    tokens: list[int]
    arrays: list[np.ndarray]


def make_block(i: int = 0, salt: CacheSalt = SALT, dtype=np.float32, dim: int = 8) -> Block:
    tokens = [1000 * i + k for k in range(salt.block_size)]
    rng = np.random.default_rng(i)
    arrays = [
        rng.standard_normal((2, salt.block_size, dim)).astype(dtype) for _ in range(4)
    ]  # keys and values of 2 layers
    return Block(salt, chain_hash(salt.digest(), tokens), salt.digest(), tokens, arrays)


def put(store: DiskPrefixStore, b: Block, **kw) -> bool:
    return store.put(b.salt, b.hash, b.parent, b.tokens, b.arrays, **kw)


def get(store: DiskPrefixStore, b: Block, salt: CacheSalt | None = None, tokens=None):
    return store.get(salt or b.salt, b.hash, b.tokens if tokens is None else tokens)


def same(got, arrays) -> bool:
    return got is not None and all(
        g.dtype == a.dtype and np.array_equal(g, a) for g, a in zip(got, arrays, strict=True)
    )


def entry_path(store: DiskPrefixStore, b: Block) -> Path:
    h = b.hash.hex()
    return store.root / h[:2] / f"{h}.kvb"


def all_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def assert_miss_removed(store: DiskPrefixStore, b: Block, reason: str, **kw):
    path = entry_path(store, b)
    hits = store.stats().hits
    assert get(store, b, **kw) is None
    assert not path.exists()
    assert not store.contains(b.hash)
    stats = store.stats()
    assert stats.misses_by_reason.get(reason) == 1, stats
    assert stats.removed_by_reason.get(reason) == 1, stats
    assert stats.hits == hits

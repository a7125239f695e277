"""Prefix-cache keys: the salt covers everything, hashes chain, partial blocks get none."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kvcache.prefix_key import CacheSalt, block_hashes, chain_hash

SALT = CacheSalt(
    model_fingerprint="sha256:model",
    tokenizer_fingerprint="sha256:tok",
    prompt_version="raw",
    position="rope_theta=10000,traditional=False,scaling=None",
    kv_format="float32",
    block_size=4,
)
CHANGED = {
    "model_fingerprint": "sha256:other-model",
    "tokenizer_fingerprint": "sha256:other-tok",
    "prompt_version": "tmpl:abc",
    "position": "rope_theta=500000,traditional=False,scaling=None",
    "kv_format": "float16",
    "block_size": 8,
    "tenant": "alice",
    "permission_version": 1,
}


def test_digest_is_stable_and_32_bytes():
    assert len(SALT.digest()) == 32
    assert SALT.digest() == CacheSalt(**SALT.to_dict()).digest()


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_every_salt_field_changes_digest_and_hashes(name):
    other = dataclasses.replace(SALT, **{name: CHANGED[name]})
    assert other.digest() != SALT.digest()
    tokens = list(range(64))
    assert set(block_hashes(other, tokens)).isdisjoint(block_hashes(SALT, tokens))


def test_round_trip_and_scope():
    salt = dataclasses.replace(SALT, tenant="bob", permission_version=3)
    assert CacheSalt.from_dict(salt.to_dict()) == salt
    assert salt.scope() == ("bob", 3)
    assert SALT.scope() == ("local", 0)


@pytest.mark.parametrize(
    "bad, exc",
    [
        ({"extra": 1}, ValueError),
        ({"block_size": "4"}, TypeError),
        ({"block_size": True}, TypeError),
        ({"block_size": 0}, ValueError),
        ({"permission_version": -1}, ValueError),
        ({"tenant": None}, TypeError),
    ],
)
def test_from_dict_is_strict(bad, exc):
    with pytest.raises(exc):
        CacheSalt.from_dict({**SALT.to_dict(), **bad})
    d = SALT.to_dict()
    del d["tenant"]
    with pytest.raises(ValueError):
        CacheSalt.from_dict(d)


def test_chain_hash_definition():
    tokens = [1, 2, 3, 70000]
    raw = np.array(tokens, dtype="<i4").tobytes()
    parent = SALT.digest()
    assert chain_hash(parent, tokens) == hashlib.sha256(parent + raw).digest()
    with pytest.raises(ValueError):
        chain_hash(b"short", tokens)
    with pytest.raises(OverflowError):
        chain_hash(parent, [1 << 40])


def test_block_hashes_full_blocks_only():
    assert block_hashes(SALT, [1, 2, 3]) == []
    hashes = block_hashes(SALT, list(range(11)), 4)
    assert len(hashes) == 2
    assert hashes[0] == chain_hash(SALT.digest(), [0, 1, 2, 3])
    assert hashes[1] == chain_hash(hashes[0], [4, 5, 6, 7])
    assert block_hashes(SALT, np.arange(11, dtype=np.int64)) == hashes
    with pytest.raises(ValueError):
        block_hashes(SALT, list(range(16)), 8)


def test_identical_text_in_two_tenants_never_shares_a_key():
    tokens = list(range(100))
    alice = block_hashes(dataclasses.replace(SALT, tenant="alice"), tokens)
    bob = block_hashes(dataclasses.replace(SALT, tenant="bob"), tokens)
    bumped = block_hashes(dataclasses.replace(SALT, tenant="alice", permission_version=1), tokens)
    assert set(alice).isdisjoint(bob)
    assert set(alice).isdisjoint(bumped)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 50_000), max_size=40),
    st.lists(st.integers(0, 50_000), max_size=40),
    st.integers(0, 39),
)
def test_hashes_name_the_whole_prefix(a, b, pos):
    bs = SALT.block_size
    full = block_hashes(SALT, a + b)
    # a prefix's full blocks hash the same whatever follows
    assert full[: len(a) // bs] == block_hashes(SALT, a)
    # changing one token changes its block's hash and every later one, never an earlier one
    tokens = a + b
    if pos < len(tokens):
        changed = tokens.copy()
        changed[pos] += 1
        other = block_hashes(SALT, changed)
        k = pos // bs
        assert other[:k] == full[:k]
        assert all(x != y for x, y in zip(other[k:], full[k:], strict=True))

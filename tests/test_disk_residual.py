"""The residual KV formats on disk: a full block's quantized bytes (per-channel keys as their
block's slice of the channel store), recorded with the pool's exact format, restored bit for
bit, served only to a pool of exactly that format; a damaged entry is a miss; through the
engine, a warm-from-disk run is the cold run token for token and leaks nothing.

Pool-level tests reuse `test_disk_quant`'s small pools and `prefill` (seeded random K/V).
"""

from __future__ import annotations

import dataclasses
import itertools

import mlx.core as mx
import numpy as np
import pytest
from test_disk_entry import resign
from test_disk_quant import (
    BS,
    DIM,
    HEADS,
    LAYERS,
    T0,
    check_not_served,
    entries,
    first_entry,
    prefill,
    stored,
)
from test_disk_quant import prefix_cache as plain_prefix_cache

from engine import Engine, EngineConfig, SamplingParams
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.disk import entry as disk_entry
from engine.kvcache.disk.spec import EntrySpec
from engine.kvcache.disk.store import DiskPrefixStore
from engine.kvcache.kv_cache import KVLayout
from engine.kvcache.prefix_cache import PrefixCache
from engine.kvcache.prefix_key import salt_base
from engine.kvcache.quant import QuantSpec
from engine.kvcache.residual import ResidualKVCache

Q4R, Q8R = QuantSpec(4, 64, 1), QuantSpec(8, 64, 1)
# name -> (K format, V format, keys per channel): the residual layouts
RESIDUAL = {"q4-kivi": (Q4R, Q4R, True), "k8v4-kivi": (Q8R, Q4R, True),
            "q4-res": (Q4R, Q4R, False)}


def residual_layout(fmt: str) -> KVLayout:
    k, v, channel = RESIDUAL[fmt]
    return KVLayout(LAYERS, HEADS, DIM, BS, mx.float16, k, v, residual=True, key_channel=channel)


def prefix_cache(fmt: str, root, **store_kw) -> PrefixCache:
    """A prefix cache over a fresh residual pool of ``fmt`` (else `test_disk_quant`'s)."""
    if fmt not in RESIDUAL:
        return plain_prefix_cache(fmt, root, **store_kw)
    lay = residual_layout(fmt)
    base = salt_base(model_fingerprint="sha256:m", tokenizer_fingerprint="sha256:t",
                     chat_template=None, model_config={}, kv_format=lay.kv_format,
                     block_size=BS)
    store_kw.setdefault("clock", lambda: T0)
    blocks = BlockManager(16, BS)
    kv = ResidualKVCache(lay, 16, free_ids=lambda: blocks.free_block_ids)
    return PrefixCache(kv, blocks, base, store=DiskPrefixStore(root, **store_kw))


@pytest.mark.parametrize("fmt", list(RESIDUAL))
def test_a_residual_block_comes_back_bit_exactly(tmp_path, fmt):
    writer = prefix_cache(fmt, tmp_path)
    assert prefill(writer) == (0, "none") and len(entries(tmp_path)) == 3
    reader = prefix_cache(fmt, tmp_path)
    assert prefill(reader, seed=1) == (12, "disk") and reader.disk_hits == 3
    assert stored(reader) == stored(writer)  # codes, scales, biases: the very bytes
    # restored blocks are quantized ones (no residual row), and read as the writer's
    table = mx.array(reader.blocks.block_tables[0][:3])
    wtable = mx.array(writer.blocks.block_tables[0][:3])
    for layer in range(LAYERS):
        for a, b in zip(writer.kv.block_view(layer), reader.kv.block_view(layer), strict=True):
            assert mx.array_equal(a.quantized.gather(wtable), b.quantized.gather(table)).item()
    assert reader.kv.num_residual_blocks == 1  # the sequence's own newest block only


def test_the_entry_records_the_exact_format(tmp_path):
    prefill(prefix_cache("q4-kivi", tmp_path))
    header, arrays = disk_entry.decode_entry(bytearray(entries(tmp_path)[0].read_bytes()))
    assert header.salt.kv_format == header.spec.kv_format == "k=q4c4r1,v=q4g64r1,res=float16"
    assert header.spec == EntrySpec.of(residual_layout("q4-kivi"))
    assert header.spec.to_dict()["key_channel"] == BS and header.spec.residual
    k = [("uint8", (HEADS, 1, DIM, BS // 2)), ("float16", (HEADS, 1, DIM)),
         ("float16", (HEADS, 1, DIM))]
    v = [("uint32", (HEADS, BS, 8)), ("float16", (HEADS, BS, 1)), ("float16", (HEADS, BS, 1))]
    assert header.tensors == k * LAYERS + v * LAYERS


def test_specs_round_trip_and_old_headers_read_as_before():
    for fmt in RESIDUAL:
        spec = EntrySpec.of(residual_layout(fmt))
        assert EntrySpec.from_dict(spec.to_dict()) == spec
    old = EntrySpec(LAYERS, HEADS, DIM, "float32", QuantSpec(8, 64), QuantSpec(8, 64))
    assert sorted(old.to_dict()) == ["dtype", "head_dim", "k_quant", "num_kv_heads",
                                     "num_layers", "v_quant"]  # byte for byte as before
    assert EntrySpec.from_dict(old.to_dict()) == old
    doc = EntrySpec.of(residual_layout("q4-kivi")).to_dict()
    for forged in ({**doc, "residual": False}, {**doc, "key_channel": 0},
                   {k: v for k, v in doc.items() if k != "residual"},
                   {**doc, "key_channel": True}, {**doc, "key_channel": 3},
                   {**doc, "k_quant": {"bits": 2, "group_size": 64}},
                   {**doc, "residual": True, "extra": 1}):
        with pytest.raises((ValueError, TypeError)):
            EntrySpec.from_dict(forged)


ALL = [*RESIDUAL, "q4", "q8", "f16"]


@pytest.mark.parametrize("writer,reader", [p for p in itertools.permutations(ALL, 2)
                                           if set(p) & set(RESIDUAL)])
def test_a_pool_of_another_format_is_not_served_from_disk(tmp_path, writer, reader):
    check_not_served(tmp_path, writer, reader, prefix_cache)


@pytest.fixture
def kivi_entry(tmp_path):
    return first_entry(tmp_path, "q4-kivi", prefix_cache)


def _tamper(path, case: str) -> None:
    a = [np.array(x) for x in disk_entry.decode_entry(bytearray(path.read_bytes()))[1]]
    spec = EntrySpec.of(residual_layout("q4-kivi"))
    if case == "codes of 8 bits":
        a[0] = np.concatenate([a[0], a[0]], axis=-1)
    elif case == "keys as rows":  # per-token-shaped key scales
        a[1] = np.zeros((HEADS, BS, 1), np.float16)
    elif case == "spec claims per-token keys":
        resign(path, a, spec=dataclasses.replace(spec, key_channel=0))
        return
    elif case == "spec claims k8":
        resign(path, a, spec=dataclasses.replace(spec, k_quant=Q8R))
        return
    elif case == "flipped byte":  # in the payload's last tensor: the checksum catches it
        raw = bytearray(path.read_bytes())
        raw[-disk_entry.DIGEST_SIZE - 3] ^= 0x10
        path.write_bytes(raw)
        return
    resign(path, a)


@pytest.mark.parametrize("case", ["codes of 8 bits", "keys as rows",
                                  "spec claims per-token keys", "spec claims k8",
                                  "flipped byte"])
def test_a_damaged_kivi_entry_is_a_miss(kivi_entry, case):
    root, path = kivi_entry
    reader = prefix_cache("q4-kivi", root)  # indexed while still good
    _tamper(path, case)
    damaged = path.read_bytes()
    assert prefill(reader, seed=1) == (0, "none")  # block 0 is the damaged one
    stats = reader.store.stats()
    reason = "corrupt" if case == "flipped byte" else "malformed"
    assert stats.misses_by_reason == {reason: 1} and stats.hits == 0 and reader.disk_hits == 0
    assert path.read_bytes() != damaged  # deleted, then written anew from the recomputed block
    assert reader.kv.num_residual_blocks == 1


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_a_truncated_kivi_entry_is_a_miss(kivi_entry, keep):
    root, path = kivi_entry
    raw = path.read_bytes()
    reader = prefix_cache("q4-kivi", root)
    path.write_bytes(raw[:int(len(raw) * keep)])
    assert prefill(reader, seed=1) == (0, "none")
    assert reader.store.stats().misses_by_reason == {"corrupt": 1}
    assert path.stat().st_size == len(raw)  # written anew, whole


def test_only_whole_full_blocks_are_taken_or_put():
    kv = ResidualKVCache(residual_layout("q4-kivi"), 4)
    k = mx.array(np.random.default_rng(0).standard_normal((HEADS, BS + 2, DIM)), mx.float16)
    for layer in range(LAYERS):
        kv.write(layer, mx.arange(BS + 2, dtype=mx.int32), k, k)  # block 0 full, 1 filling
    keys, values = kv.take(mx.arange(BS, dtype=mx.int32))
    assert keys[0][0].shape == (HEADS, 1, DIM, BS // 2) and values[0][0].shape[1] == BS
    with pytest.raises(RuntimeError, match="still filling"):
        kv.take(mx.arange(BS, 2 * BS, dtype=mx.int32))
    with pytest.raises(RuntimeError, match="whole blocks"):
        kv.take(mx.arange(2, dtype=mx.int32))
    with pytest.raises(RuntimeError, match="whole blocks"):
        kv.put(slice(1, BS + 1), keys, values)
    kv.put(slice(BS, 2 * BS), keys, values)  # over the filling block: now a full one
    assert kv.num_residual_blocks == 0
    assert all(mx.array_equal(a[:, 1], a[:, 0]).item() for a in kv.keys[1])


# -- through the engine --------------------------------------------------------------------

KIVI = dict(kv_bits=4, kv_residual=True, kv_key_channel=True, kv_budget_bytes=32 << 20,
            max_running=4, step_target_s=None, prefill_chunk=16)


def test_a_warm_from_disk_run_is_the_cold_run(default_model_ext, tmp_path):
    ids = default_model_ext.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    p = SamplingParams(max_tokens=16, ignore_eos=True)
    cold = Engine(default_model_ext, EngineConfig(**KIVI, prefix_cache=False)).generate_text(
        ids, p)

    def disk_engine():
        return Engine(default_model_ext, EngineConfig(**KIVI, disk_cache=True,
                                                      disk_cache_dir=str(tmp_path)))

    first = disk_engine()
    assert first.prefix.store is not None and not any("disk" in n for n in first.notices)
    r1 = first.generate_text(ids, p)
    first.shutdown()
    warm = disk_engine()
    r2 = warm.generate_text(ids, p)
    full = (len(ids) - 1) // warm.layout.block_size * warm.layout.block_size
    assert r2.stats.cache_source == "disk" and r2.stats.cached_tokens == full > 0
    assert warm.prefix.disk_hits == full // warm.layout.block_size
    assert r1.tokens == r2.tokens == cold.tokens
    warm.blocks.check_invariants()
    assert warm.blocks.num_free_blocks == warm.blocks.num_blocks
    warm.kv.reclaim()
    assert warm.kv.num_residual_blocks == 0
    warm.shutdown()

"""Quantized KV blocks on disk: stored exactly (packed data, scales, biases), recorded with the
pool's full format, served only to a pool of exactly that format; a corrupt, truncated or
mis-shaped quantized entry is a miss, deleted and counted, never served.

Pools here are small and written with seeded random K/V (no model): `prefill` plays one
request through the prefix cache the way the engine does (admit, write the rest, register).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_disk_entry import resign

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.disk import entry as disk_entry
from engine.kvcache.disk.spec import EntrySpec
from engine.kvcache.disk.store import DiskPrefixStore
from engine.kvcache.kv_cache import KVLayout, PagedKVCache
from engine.kvcache.prefix_cache import PrefixCache, block_arrays
from engine.kvcache.prefix_key import block_hashes, salt_base
from engine.kvcache.quant import QuantSpec

BS, HEADS, DIM, LAYERS = 4, 2, 64, 2
Q8, Q4, Q8G32 = QuantSpec(8, 64), QuantSpec(4, 64), QuantSpec(8, 32)
# name -> (compute dtype, K format, V format): every way two pools' blocks can differ
FORMATS = {
    "f32": (mx.float32, None, None),
    "f16": (mx.float16, None, None),
    "q8": (mx.float32, Q8, Q8),
    "q4": (mx.float32, Q4, Q4),
    "k8v4": (mx.float32, Q8, Q4),
    "k8": (mx.float32, Q8, None),  # V plain float32
    "q8g32": (mx.float32, Q8G32, Q8G32),
    "q8/f16": (mx.float16, Q8, Q8),  # q8's bits, another compute dtype
}
QUANTIZED = [f for f, (_, k, v) in FORMATS.items() if k or v]
T0 = 1_700_000_000.0
IDS = list(range(100, 113))  # 3 full blocks to reuse (the last token is always computed)


def layout(fmt: str) -> KVLayout:
    dtype, k, v = FORMATS[fmt]
    return KVLayout(LAYERS, HEADS, DIM, BS, dtype, k, v)


def prefix_cache(fmt: str, root: Path | None, blocks: BlockManager | None = None,
                 **store_kw) -> PrefixCache:
    """A prefix cache over a fresh pool of ``fmt``, on the disk store at ``root`` (if any)."""
    lay = layout(fmt)
    base = salt_base(model_fingerprint="sha256:m", tokenizer_fingerprint="sha256:t",
                     chat_template=None, model_config={}, kv_format=lay.kv_format,
                     block_size=BS)
    store_kw.setdefault("clock", lambda: T0)  # fixed: entries of one format, one size
    store = None if root is None else DiskPrefixStore(root, **store_kw)
    return PrefixCache(PagedKVCache(lay, 16), blocks or BlockManager(16, BS), base,
                       store=store)


def prefill(pc: PrefixCache, ids=IDS, seq_id: int = 0, seed: int = 0) -> tuple[int, str]:
    """Admit ``ids``, write random K/V for what was not cached, register and persist."""
    seq = pc.new_sequence("local", 0)
    cached, source = pc.admit(seq_id, seq, ids)
    slots = pc.blocks.append(seq_id, len(ids) - cached).slots
    rng = np.random.default_rng(seed)
    for layer in range(LAYERS):
        k, v = (mx.array(rng.standard_normal((HEADS, len(slots), DIM)).astype(np.float32))
                for _ in range(2))
        pc.kv.write(layer, mx.array(slots), k, v)
    pc.on_computed(seq_id, seq, ids, len(ids), len(ids))
    if pc.store is not None:
        pc.store.flush(timeout=10)
    return cached, source


def stored(pc: PrefixCache, n: int = 12) -> list[tuple[str, tuple, bytes]]:
    """The pool's stored bytes of sequence 0's first ``n`` tokens (data, scales, biases)."""
    arrays = block_arrays(pc.kv, mx.array(pc.blocks.slots(0, 0, n)))
    return [(a.dtype.name, a.shape, a.tobytes()) for a in arrays]


def entries(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


# ---- exact round trips --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_a_quantized_block_comes_back_bit_exactly(tmp_path, fmt):
    writer = prefix_cache(fmt, tmp_path)
    assert prefill(writer) == (0, "none")
    assert writer.store.stats().entries == 3
    reader = prefix_cache(fmt, tmp_path)  # a new pool: only the disk can serve it
    assert prefill(reader, seed=1) == (12, "disk")
    got = stored(reader)
    # take -> write -> load -> put: the same data, scales and biases, byte for byte
    assert got == stored(writer)
    kinds = {dtype for dtype, _, _ in got}
    assert kinds == ({"uint32", "float16"} | ({"float32"} if fmt == "k8" else set()))
    assert reader.disk_hits == 3 and reader.store.stats().misses == 0


def test_the_entry_records_the_full_format(tmp_path):
    pc = prefix_cache("k8v4", tmp_path)
    prefill(pc)
    path = entries(tmp_path)[0]
    with open(path, "rb") as f:
        header = disk_entry.read_header(f, path.stat().st_size)
    assert header.spec == EntrySpec.of(pc.kv.layout) == EntrySpec(
        LAYERS, HEADS, DIM, "float32", QuantSpec(8, 64), QuantSpec(4, 64))
    assert header.salt.kv_format == "k=q8g64,v=q4g64,dtype=float32"
    k = [("uint32", (HEADS, BS, 16)), ("float16", (HEADS, BS, 1)), ("float16", (HEADS, BS, 1))]
    v = [("uint32", (HEADS, BS, 8)), ("float16", (HEADS, BS, 1)), ("float16", (HEADS, BS, 1))]
    assert header.tensors == k * LAYERS + v * LAYERS


# ---- another format is never served -------------------------------------------------------

def check_not_served(root: Path, writer: str, reader: str, make=None) -> None:
    """A pool of ``reader``'s format gets nothing from ``writer``'s entries at ``root``,
    which stay untouched and still serve ``writer``'s format (pools made by ``make``)."""
    make = make or prefix_cache
    prefill(make(writer, root))
    written = {p: p.read_bytes() for p in entries(root)}
    other = make(reader, root)
    assert prefill(other) == (0, "none")
    assert other.disk_hits == 0 and other.store.stats().hits == 0
    # the other format's entries are not its to judge: all still there, untouched
    assert {p: p.read_bytes() for p in written} == written
    assert prefill(make(writer, root), seed=2) == (12, "disk")


@pytest.mark.parametrize("writer,reader", list(itertools.permutations(FORMATS, 2)))
def test_a_pool_of_another_format_is_not_served_from_disk(tmp_path, writer, reader):
    check_not_served(tmp_path, writer, reader)


def test_the_salt_must_name_the_pools_format():
    lay = layout("q8")
    base = salt_base(model_fingerprint="m", tokenizer_fingerprint="t", chat_template=None,
                     model_config={}, kv_format="k=q4g64,v=q4g64", block_size=BS)
    with pytest.raises(ValueError, match="not the pool's"):
        PrefixCache(PagedKVCache(lay, 4), BlockManager(4, BS), base)


# ---- tampered, corrupt and mis-shaped quantized entries -----------------------------------


def first_entry(tmp_path: Path, fmt: str, make=None) -> tuple[Path, Path]:
    """A ``fmt`` prefix on disk (pools made by ``make``); returns the root and the first
    block's entry path."""
    root = tmp_path / "prefix"
    pc = (make or prefix_cache)(fmt, root)
    prefill(pc)
    first = block_hashes(pc.new_sequence("local", 0).salt, IDS)[0].hex()
    return root, root / first[:2] / f"{first}.kvb"


@pytest.fixture
def q8_entry(tmp_path):
    return first_entry(tmp_path, "q8")


def q8_arrays(path: Path) -> list[np.ndarray]:
    return [np.array(a) for a in disk_entry.decode_entry(bytearray(path.read_bytes()))[1]]


def _tamper(path: Path, case: str) -> None:
    a = q8_arrays(path)  # per layer: data (2, 4, 16) u32, scales, biases (2, 4, 1) f16
    q8 = EntrySpec.of(layout("q8"))
    if case == "wrong scale shape":
        a[1] = np.zeros((HEADS, BS, 2), np.float16)
    elif case == "float32 scales":
        a[1] = a[1].astype(np.float32)
    elif case == "data as float32":
        a[0] = a[0].view(np.float32)
    elif case == "4-bit packing":
        a[0] = a[0][..., :8].copy()
    elif case == "no biases":
        del a[2]
    elif case == "scales and data swapped":
        a[0], a[1] = a[1], a[0]
    elif case == "spec claims q4":  # the payload is still q8's
        resign(path, a, spec=dataclasses.replace(q8, k_quant=QuantSpec(4, 64),
                                                 v_quant=QuantSpec(4, 64)))
        return
    elif case == "spec claims q8g32":
        resign(path, a, spec=dataclasses.replace(q8, k_quant=QuantSpec(8, 32)))
        return
    elif case == "spec claims float16":  # and the payload to match
        resign(path, [np.zeros((HEADS, BS, DIM), np.float16)] * 4,
               spec=EntrySpec(LAYERS, HEADS, DIM, "float16"))
        return
    resign(path, a)


TAMPERED = ["wrong scale shape", "float32 scales", "data as float32", "4-bit packing",
            "no biases", "scales and data swapped", "spec claims q4", "spec claims q8g32",
            "spec claims float16"]


@pytest.mark.parametrize("case", TAMPERED)
def test_a_mis_shaped_or_mislabelled_quantized_entry_is_a_miss(q8_entry, case):
    root, path = q8_entry
    _tamper(path, case)
    pc = prefix_cache("q8", root)
    assert pc.store.stats().removed_by_reason == {"malformed": 1}  # the start-up scan
    assert not path.exists()
    assert prefill(pc) == (0, "none")


@pytest.mark.parametrize("case", TAMPERED)
def test_a_tampered_entry_found_after_start_up_is_a_miss_too(q8_entry, case):
    root, path = q8_entry
    pc = prefix_cache("q8", root)  # indexed while still good
    _tamper(path, case)
    tampered = path.read_bytes()
    assert prefill(pc) == (0, "none")
    stats = pc.store.stats()
    assert stats.misses_by_reason == {"malformed": 1} and stats.hits == 0
    assert stats.removed_by_reason == {"malformed": 1}
    assert path.read_bytes() != tampered  # deleted, then written anew from the recomputed block


def test_a_consistent_forgery_of_another_format_is_foreign(q8_entry):
    root, path = q8_entry
    header, _ = disk_entry.decode_entry(bytearray(path.read_bytes()))
    q4 = EntrySpec.of(layout("q4"))
    forged = [np.zeros(s, disk_entry.DTYPES[d]) for d, s in q4.tensors(BS)]
    salt = dataclasses.replace(header.salt, kv_format=q4.kv_format)
    resign(path, forged, spec=q4, salt=salt)  # a well-formed q4 entry under q8's name
    pc = prefix_cache("q8", root)
    assert prefill(pc) == (0, "none")
    assert pc.store.stats().misses_by_reason == {"foreign": 1}
    with open(path, "rb") as f:  # deleted, and written anew from the recomputed block
        assert disk_entry.read_header(f, path.stat().st_size).spec == EntrySpec.of(layout("q8"))


@pytest.mark.parametrize("keep", ["header", "payload", "minus1"])
def test_a_truncated_quantized_entry_is_a_miss(q8_entry, keep):
    root, path = q8_entry
    data = path.read_bytes()
    header_len = int.from_bytes(data[6:10], "little")
    cut = {"header": disk_entry.PREFIX.size + header_len // 2, "payload": len(data) - 300,
           "minus1": len(data) - 1}[keep]
    pc = prefix_cache("q8", root)
    path.write_bytes(data[:cut])
    assert prefill(pc) == (0, "none")
    assert pc.store.stats().misses_by_reason == {"corrupt": 1}
    assert pc.store.stats().removed_by_reason == {"corrupt": 1}
    assert path.stat().st_size == len(data)  # written anew, whole


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_damage_to_a_quantized_entry_is_never_served(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("qfuzz")
    prefill(prefix_cache("k8v4", root))
    path = entries(root)[data.draw(st.integers(0, 2))]
    pristine = path.read_bytes()
    if data.draw(st.booleans()):
        damaged = bytearray(pristine)
        damaged[data.draw(st.integers(0, len(pristine) - 1))] ^= data.draw(st.integers(1, 255))
    else:
        damaged = pristine[: data.draw(st.integers(0, len(pristine) - 1))]
    path.write_bytes(bytes(damaged))
    pc = prefix_cache("k8v4", root)
    cached, _ = prefill(pc)
    assert cached < 12  # the chain stops at the damaged block
    assert sum(pc.store.stats().removed_by_reason.values()) == 1
    assert path.read_bytes() != bytes(damaged)


# ---- byte budget --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_entries_cost_their_real_bytes(tmp_path, fmt):
    pc = prefix_cache(fmt, tmp_path)
    prefill(pc)
    assert pc.entry_spec.block_bytes(BS) == pc.kv.layout.bytes_per_block
    files = entries(tmp_path)
    for p in files:
        with open(p, "rb") as f:
            header = disk_entry.read_header(f, p.stat().st_size)
        assert header.payload_bytes == pc.kv.layout.bytes_per_block
    assert pc.store.stats().bytes == sum(p.stat().st_size for p in files)


def test_the_budget_counts_quantized_bytes(tmp_path):
    probe = prefix_cache("q4", tmp_path / "probe")
    prefill(probe)
    q4_size = probe.store.stats().bytes // 3
    # a budget for two and a half q4 blocks keeps two of them, and no float32 one
    budget = 2 * q4_size + q4_size // 2
    q4 = prefix_cache("q4", tmp_path / "q4", budget_bytes=budget)
    prefill(q4)
    stats = q4.store.stats()
    assert (stats.entries, stats.evictions, stats.bytes) == (2, 1, 2 * q4_size)
    tight = prefix_cache("f32", tmp_path / "q4", budget_bytes=budget)
    prefill(tight)
    assert tight.store.stats().writes == 0  # one float32 block alone exceeds the budget

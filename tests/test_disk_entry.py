"""Structural checks of disk entries: checksum-VALID files (re-signed after tampering) whose
content does not fit the salt or the reader's `EntrySpec` are misses, deleted and counted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from disk_blocks import BS, SALT, Clock, entry_path, get, make_block, put, same
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kvcache.disk import entry as disk_entry
from engine.kvcache.disk.entry import EntryHeader
from engine.kvcache.disk.spec import DTYPES, EntrySpec
from engine.kvcache.disk.store import DiskPrefixStore
from engine.kvcache.quant import QuantSpec

HEADS, DIM = 2, 8
SPEC = EntrySpec(num_layers=2, num_kv_heads=HEADS, head_dim=DIM, dtype="float32")


def resign(path: Path, arrays: list[np.ndarray] | None = None, **changes) -> None:
    """Rewrite an entry with header ``changes`` and/or new ``arrays``, checksum recomputed."""
    header, old = disk_entry.decode_entry(bytearray(path.read_bytes()))
    arrays = [np.array(a) for a in old] if arrays is None else arrays
    if "tensors" not in changes:
        changes["tensors"] = [(disk_entry.dtype_name(a), tuple(a.shape)) for a in arrays]
    with open(path, "wb") as f:
        disk_entry.write_entry(f, dataclasses.replace(header, **changes), arrays)
    disk_entry.decode_entry(bytearray(path.read_bytes()))  # the checksum is valid


def block_arrays(shape=(HEADS, BS, DIM), dtype=np.float32, n=4) -> list[np.ndarray]:
    return [np.full(shape, k, dtype) for k in range(n)]


TOKENS = make_block(0).tokens
# name -> (resign kwargs, caught by the start-up scan without an EntrySpec: the header's own
# spec and the salt already say what the payload must be)
CASES = {
    "59 tensors": (dict(arrays=block_arrays(n=59)), True),
    "3 tensors": (dict(arrays=block_arrays(n=3)), True),
    "no tensors": (dict(arrays=[]), True),
    "token id 2**40": (dict(token_ids=[2**40, *TOKENS[1:]]), True),
    "token id 2**31": (dict(token_ids=[*TOKENS[:-1], 2**31]), True),
    "negative token id": (dict(token_ids=[-1, *TOKENS[1:]]), True),
    "short block": (dict(token_ids=TOKENS[:-1]), True),
    "transposed (dim, block)": (dict(arrays=block_arrays((HEADS, DIM, BS))), True),
    "transposed (dim, heads)": (dict(arrays=block_arrays((DIM, BS, HEADS))), True),
    "more heads": (dict(arrays=block_arrays((HEADS + 1, BS, DIM))), True),
    "2-D tensors": (dict(arrays=block_arrays((HEADS, BS))), True),
    "4-D tensors": (dict(arrays=block_arrays((1, HEADS, BS, DIM))), True),
    "empty heads": (dict(arrays=block_arrays((0, BS, DIM))), True),
    "float16 under a float32 salt": (dict(arrays=block_arrays(dtype=np.float16)), True),
    "bfloat16 under a float32 salt": (dict(arrays=block_arrays(dtype=np.uint16)), True),
    "mixed dtypes": (dict(arrays=[*block_arrays(n=3), *block_arrays(n=1, dtype=np.float16)]),
                     True),
    "uint32 under a float32 salt": (dict(arrays=block_arrays(dtype=np.uint32)), True),
    # the header claims another format than the salt names, payload to match
    "spec claims float16": (dict(arrays=block_arrays(dtype=np.float16),
                                 spec=dataclasses.replace(SPEC, dtype="float16")), True),
    "spec claims q8": (dict(spec=dataclasses.replace(SPEC, head_dim=32,
                                                      k_quant=QuantSpec(8, 32)),
                            arrays=[np.zeros((HEADS, BS, 8), np.uint32),
                                    *block_arrays((HEADS, BS, 1), np.float16, 2)] * 2
                            + block_arrays((HEADS, BS, 32), n=2)), True),
    # self-consistent, of the salt's format, but not the reader's pool: only `expect` knows
    "spec of 3 layers": (dict(arrays=block_arrays(n=6), spec=dataclasses.replace(
        SPEC, num_layers=3)), False),
    "spec of 1 layer": (dict(arrays=block_arrays(n=2), spec=dataclasses.replace(
        SPEC, num_layers=1)), False),
    "spec of 3 heads": (dict(arrays=block_arrays((3, BS, DIM)), spec=dataclasses.replace(
        SPEC, num_kv_heads=3)), False),
}


@pytest.fixture
def store(tmp_path):
    s = DiskPrefixStore(tmp_path / "prefix", clock=Clock())
    yield s
    s.close()


def test_a_good_entry_meets_its_spec(store):
    b = make_block(1)
    assert put(store, b)
    assert same(store.get(b.salt, b.hash, b.tokens, expect=SPEC), b.arrays)


@pytest.mark.parametrize("case", CASES)
def test_malformed_entry_is_a_miss_removed_and_counted(store, case):
    b = make_block(2)
    put(store, b)
    path = entry_path(store, b)
    resign(path, **CASES[case][0])
    assert store.get(b.salt, b.hash, b.tokens, expect=SPEC) is None
    assert not path.exists() and not store.contains(b.hash)
    st_ = store.stats()
    assert st_.misses_by_reason == {"malformed": 1}
    assert st_.removed_by_reason == {"malformed": 1} and st_.hits == 0
    assert store.get(b.salt, b.hash, b.tokens, expect=SPEC) is None  # gone for good


@pytest.mark.parametrize("case", [c for c, (_, scan) in CASES.items() if scan])
def test_malformed_entry_is_removed_at_start_up(tmp_path, case):
    root = tmp_path / "prefix"
    b = make_block(3)
    with DiskPrefixStore(root, clock=Clock()) as s:
        put(s, b)
    resign(entry_path(s, b), **CASES[case][0])
    s2 = DiskPrefixStore(root, clock=Clock())
    assert s2.stats().removed_by_reason == {"malformed": 1}
    assert not entry_path(s2, b).exists()


@pytest.mark.parametrize("case", ["float16 under a float32 salt", "transposed (dim, block)",
                                  "token id 2**40", "short block"])
def test_checked_against_the_salt_even_without_a_spec(store, case):
    b = make_block(4)
    put(store, b)
    resign(entry_path(store, b), **CASES[case][0])
    assert get(store, b) is None
    assert store.stats().misses_by_reason == {"malformed": 1}


def test_expect_must_match_exactly(store):
    b = make_block(5)
    put(store, b)
    wrong = dataclasses.replace(SPEC, dtype="float16")
    assert store.get(b.salt, b.hash, b.tokens, expect=wrong) is None
    assert store.stats().misses_by_reason == {"malformed": 1}


def test_get_never_raises(store, monkeypatch):
    b = make_block(6)
    put(store, b)

    def boom(*args, **kw):
        raise RuntimeError("a bug in a check")

    monkeypatch.setattr(disk_entry, "check_entry", boom)
    assert get(store, b) is None  # a surprise is a miss ...
    assert not entry_path(store, b).exists()  # ... and the file that caused it is gone
    assert store.stats().misses_by_reason == {"error": 1}
    monkeypatch.undo()
    assert store.get(SALT, None, b.tokens) is None  # nonsense from the caller: a miss too
    assert store.get(SALT, b.hash, None) is None
    assert store.stats().misses == 3


@pytest.mark.parametrize("bad", [dict(num_layers=0), dict(num_layers=True),
                                 dict(num_layers=10**9), dict(num_kv_heads=0),
                                 dict(head_dim=8.0), dict(dtype="float64"),
                                 dict(dtype="uint32"), dict(dtype="q8g64"),
                                 dict(k_quant=QuantSpec(8, 32)),  # 32 does not divide 8
                                 dict(v_quant=(8, 64))])
def test_entry_spec_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        EntrySpec(**{**dataclasses.asdict(SPEC), **bad})


@pytest.mark.parametrize("doc", [
    None, [], {}, {**SPEC.to_dict(), "extra": 1},
    {k: v for k, v in SPEC.to_dict().items() if k != "k_quant"},
    {**SPEC.to_dict(), "k_quant": {"bits": 8}},
    {**SPEC.to_dict(), "head_dim": 32, "k_quant": {"bits": 8, "group_size": 64}},
    {**SPEC.to_dict(), "k_quant": {"bits": 8, "group_size": 64, "signed": True}},
    {**SPEC.to_dict(), "k_quant": [8, 64]},
    {**SPEC.to_dict(), "num_layers": "2"},
])
def test_spec_from_a_header_is_strict(doc):
    with pytest.raises((ValueError, TypeError)):
        EntrySpec.from_dict(doc)


@pytest.mark.parametrize("bad", [dict(num_layers=-1), dict(k_quant={"bits": 3, "group_size": 8}),
                                 dict(dtype="float64"), dict(head_dim=None)])
def test_a_bad_spec_in_a_signed_header_is_a_corrupt_miss(store, monkeypatch, bad):
    b = make_block(9)
    put(store, b)
    path = entry_path(store, b)
    header, arrays = disk_entry.decode_entry(bytearray(path.read_bytes()))
    arrays = [np.array(a) for a in arrays]
    forged = {**SPEC.to_dict(), **bad}
    with monkeypatch.context() as m:  # a spec the writer would never produce, checksum valid
        m.setattr(EntrySpec, "to_dict", lambda self: forged)
        with open(path, "wb") as f:
            disk_entry.write_entry(f, header, arrays)
    assert store.get(b.salt, b.hash, b.tokens, expect=SPEC) is None
    assert store.stats().misses_by_reason == {"corrupt": 1} and not path.exists()


@pytest.mark.parametrize("change", [
    {"tokens": [2**31, 1, 2, 3]},
    {"tokens": [-1, 1, 2, 3]},
    {"arrays": block_arrays(dtype=np.float16)},  # not the salt's kv_format
    {"arrays": block_arrays((0, BS, DIM))},
])
def test_put_writes_only_what_get_accepts(store, change):
    b = make_block(7)._replace(**change)
    with pytest.raises(ValueError):
        store.put(b.salt, b.hash, b.parent, b.tokens, b.arrays)
    assert store.stats().entries == 0


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 6),
    dtype=st.sampled_from(sorted(DTYPES)),
    shape=st.sampled_from([(HEADS, BS, DIM), (DIM, BS, HEADS), (HEADS, DIM, BS), (HEADS, BS),
                           (1, HEADS, BS, DIM), (HEADS, BS, 0), (HEADS, BS, DIM + 1)]),
    tokens=st.one_of(st.just(TOKENS), st.lists(st.integers(-(2**40), 2**40), max_size=6)),
    spec=st.sampled_from([SPEC, dataclasses.replace(SPEC, num_layers=1),
                          dataclasses.replace(SPEC, dtype="float16"),
                          dataclasses.replace(SPEC, head_dim=32, v_quant=QuantSpec(4, 32))]),
)
def test_checksum_valid_content_is_served_only_as_expected(tmp_path_factory, n, dtype, shape,
                                                           tokens, spec):
    store = DiskPrefixStore(tmp_path_factory.mktemp("fuzz"), clock=Clock())
    b = make_block(0)
    put(store, b)
    arrays = [np.zeros(shape, DTYPES[dtype]) for _ in range(n)]
    resign(entry_path(store, b), arrays=arrays, token_ids=tokens,
           tensors=[(dtype, shape)] * n, spec=spec)
    got = store.get(b.salt, b.hash, b.tokens, expect=SPEC)
    fits = (n, dtype, shape, tokens, spec) == (4, "float32", (HEADS, BS, DIM), TOKENS, SPEC)
    assert (got is not None) == fits
    assert entry_path(store, b).exists() == fits


def test_header_round_trip_is_unchanged():
    b = make_block(8)
    header = disk_entry.make_header(b.salt, b.hash, b.parent, b.tokens, b.arrays, 1.0, 2.0)
    assert isinstance(header, EntryHeader) and header.expires == 3.0
    assert header.spec == SPEC  # inferred from plain float arrays
    assert disk_entry.parse_header(header.to_json()) == header

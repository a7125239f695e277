"""Decode dispatch by shape (the table in engine.model.paged_attention) and the
benchmark that times every path (`kvchat bench kernel`), without a GPU.

`kernels.kernel_available` is made to answer "metal" and the kernel entry
points are replaced by spies that answer like the reference, so the routing
itself is what is checked.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from kernel_harness.cases import Case, make_inputs

from app.bench import kernel as bench
from engine.model import kernels
from engine.model import paged_attention as pa

SHORT = Case("float16", 64, 16, 4, 2, (9, 17))
ONE = Case("float16", 64, 16, 4, 2, (40,))
LONG = Case("float16", 32, 64, 2, 1, (pa.TWO_PASS_MIN_TOKENS + 3,))


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.delenv(kernels.ENV_SWITCH, raising=False)
    kernels.reset_fallback()
    yield
    kernels.reset_fallback()


@pytest.fixture
def spies(monkeypatch):
    """path -> launches; both kernels answer like the reference."""
    calls = {"kernel": [], "two_pass": []}
    monkeypatch.setattr(kernels, "kernel_available", lambda: "metal")
    for path, attr in pa.KERNEL_PATHS.items():
        def spy(*args, _path=path):
            calls[_path].append(args)
            return pa.paged_attention_ref(*args)

        monkeypatch.setattr(kernels, attr, spy)
    return calls


def test_table_rows_name_a_path_and_a_reason():
    assert [r.path for r in pa.DECODE_ROUTES] == ["view_sdpa", "two_pass", "kernel"]
    assert all(r.when and len(r.reason) > 40 for r in pa.DECODE_ROUTES)
    assert set(pa.KERNEL_PATHS) == {"kernel", "two_pass"}


@pytest.mark.parametrize(
    ("batch", "block_run", "context", "path"),
    [
        (1, 0, 100, "view_sdpa"),
        (1, 3, 40000, "view_sdpa"),  # MLX's own path, which goes two-pass itself
        (1, None, 100, "kernel"),  # scattered blocks (prefix-cache hits)
        (1, None, pa.TWO_PASS_MIN_TOKENS, "two_pass"),
        (8, None, 2048, "kernel"),
        (4, None, 16384, "two_pass"),
    ],
)
def test_decode_route(batch, block_run, context, path):
    assert pa.decode_route(batch, block_run, context).path == path


def test_one_contiguous_sequence_takes_the_view(spies):
    inputs = make_inputs(ONE)
    out = pa.paged_attention(**inputs, block_run=0)
    assert spies == {"kernel": [], "two_pass": []}
    assert mx.array_equal(out, pa.paged_attention_ref(**inputs, block_run=0))


@pytest.mark.parametrize(("case", "path"), [(SHORT, "kernel"), (ONE, "kernel"),
                                            (LONG, "two_pass")], ids=["batch", "one", "long"])
def test_kernel_paths(case, path, spies):
    inputs = make_inputs(case)
    out = pa.paged_attention(**inputs)
    assert len(spies[path]) == 1 and sum(map(len, spies.values())) == 1
    assert mx.array_equal(out, pa.paged_attention_ref(**inputs))
    assert kernels.kernel_fallback() is None


def test_two_pass_launch_failure_falls_back(monkeypatch):
    """The real two-pass kernels: MLX raises at launch without Metal."""
    if mx.metal.is_available():
        pytest.skip("Metal present: the kernel launches for real")
    monkeypatch.setattr(kernels, "kernel_available", lambda: "metal")
    inputs = make_inputs(LONG)
    with pytest.warns(RuntimeWarning, match="paged_decode_two_pass on metal failed"):
        out = pa.paged_attention(**inputs)
    assert mx.array_equal(out, pa.paged_attention_ref(**inputs))


def test_two_pass_variant_differs_from_one_pass():
    inputs = make_inputs(SHORT)
    args = (inputs["queries"], inputs["k_pool"], inputs["v_pool"], inputs["block_tables"])
    assert kernels.variant_key(*args, "kernel") != kernels.variant_key(*args, "two_pass")


def test_bench_measures_the_paths_that_run_here():
    """On the CPU only the SDPA paths run; the kernels' failures are rows, not crashes."""
    rows = bench.measure([(1, 40), (2, 30)], "float16", 16, 1, num_q_heads=4, num_kv_heads=2,
                         head_dim=64)
    one, two = rows
    assert one["ms"]["view_sdpa"] > 0 and one["ms"]["gather_sdpa"] > 0
    assert two["ms"]["view_sdpa"] is None  # several sequences: no view path
    assert one["route"] == "view_sdpa" and two["route"] == "kernel"
    if kernels.kernel_available() is None:
        assert one["ms"]["kernel"] is None and one["ms"]["two_pass"] is None
        assert one["fastest"] in ("view_sdpa", "gather_sdpa") and one["gbps"] > 0
    lines = bench.format_rows(rows)
    assert len(lines) == 3 and "two_pass ms" in lines[0] and "fastest" in lines[0]


def test_bench_inputs_make_the_view_path_apply():
    inputs = bench.make_inputs(1, 70, "float16", 16, 0, num_q_heads=4, num_kv_heads=2,
                               head_dim=64)
    table = [int(b) for b in inputs["block_tables"][0].tolist()]
    assert pa.contiguous_run(table) == 0

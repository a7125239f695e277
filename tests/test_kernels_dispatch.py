"""The route table (engine.model.attention.routes) and the dispatch through it, and the
benchmark that times every path (`kvchat bench kernel`), without a GPU.

`backend.kernel_backend` is made to answer "metal" and the kernel entry points are
replaced by spies that answer like the reference, so the routing itself is what is
checked.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from kernel_harness.cases import Case, make_inputs

from app.bench import kernel as bench
from engine.model import backend
from engine.model.attention import (
    AttentionSpec,
    PagedCall,
    contiguous_run,
    dispatch,
    guard,
    paged_attention,
    reference,
    routes,
)
from engine.model.attention.gpu import abi, one_pass, two_pass

SHORT = Case("float16", 64, 16, 4, 2, (9, 17))
ONE = Case("float16", 64, 16, 4, 2, (40,))
LONG = Case("float16", 32, 64, 2, 1, (routes.TWO_PASS_MIN_TOKENS + 3,))
SPIED = {"one_pass": (one_pass, "paged_decode_attention"),
         "two_pass": (two_pass, "paged_decode_two_pass")}


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.delenv(backend.KERNELS_SWITCH, raising=False)
    guard.GUARD.reset()
    yield
    guard.GUARD.reset()


@pytest.fixture
def spies(monkeypatch):
    """path -> launches; both GPU kernels answer like the reference."""
    calls = {"one_pass": [], "two_pass": []}
    monkeypatch.setattr(backend, "kernel_backend", lambda: "metal")
    for path, (module, attr) in SPIED.items():
        def spy(*args, _path=path):
            calls[_path].append(args)
            return reference.paged_attention_ref(*args)

        monkeypatch.setattr(module, attr, spy)
    return calls


def call_of(batch: int, block_run: int | None, context: int, *, L: int = 1,
            dtype=mx.float16, pool_dtype=mx.float16, spec: AttentionSpec | None = None,
            ) -> PagedCall:
    q = mx.zeros((batch, 4, L, 64), dtype)
    pool = mx.zeros((2, 1, 16, 64), pool_dtype)
    return PagedCall(q, pool, pool, mx.zeros((batch, 1), mx.int32), (context,) * batch,
                     spec or AttentionSpec(0.125), block_run)


def test_every_row_names_a_known_path_and_a_reason():
    known = set(dispatch.KERNEL_PATHS) | {"reference", "view_sdpa"}
    assert {r.path for r in routes.ROUTES} == known
    assert all(r.when and len(r.reason) > 40 for r in routes.ROUTES)
    # every backend has a row for every kind of call
    for where in ("cpu", "metal", "cuda"):
        for kind_call in (call_of(2, None, 9), call_of(1, None, 9, L=4),
                          call_of(2, None, 9, L=4)):
            routes.route(kind_call, where)


@pytest.mark.parametrize(
    ("batch", "block_run", "context", "path"),
    [
        (1, 0, 100, "view_sdpa"),
        (1, 3, 40000, "view_sdpa"),  # MLX's own path, which goes two-pass itself
        (1, None, 100, "one_pass"),  # scattered blocks (prefix-cache hits)
        (1, None, routes.TWO_PASS_MIN_TOKENS, "two_pass"),
        (8, None, 2048, "one_pass"),
        (4, None, 16384, "two_pass"),
    ],
)
def test_gpu_decode_route(batch, block_run, context, path):
    assert routes.route(call_of(batch, block_run, context), "metal").path == path
    assert routes.route(call_of(batch, block_run, context), "cuda").path == path


@pytest.mark.parametrize(
    ("call", "path"),
    [
        (call_of(1, 0, 100, dtype=mx.float32, pool_dtype=mx.float32), "reference"),  # parity
        (call_of(1, None, 100, L=8, dtype=mx.float32, pool_dtype=mx.float32), "reference"),
        (call_of(1, 0, 100, dtype=mx.float32), "cpu"),  # a float16 pool: no cast
        (call_of(4, None, 100, dtype=mx.float32, pool_dtype=mx.float32), "cpu"),
        (call_of(1, None, 100, L=8, dtype=mx.float32), "cpu"),
        (call_of(3, None, 100, L=4, dtype=mx.float32), "cpu"),  # a multi-token verify
    ],
)
def test_cpu_route(call, path):
    assert routes.route(call, "cpu").path == path


WINDOW_AND_SINKS = [AttentionSpec(0.125, window=64), AttentionSpec(0.125, sinks=mx.zeros((4,))),
                    AttentionSpec(0.125, window=7, sinks=mx.zeros((4,)))]


@pytest.mark.parametrize("spec", WINDOW_AND_SINKS)
def test_windows_and_sinks_take_the_cpu_rows_of_plain_layers(spec):
    """The extension computes them (tests/test_cpu_ext_window_sinks.py)."""
    assert routes.route(call_of(4, None, 100, spec=spec), "cpu").path == "cpu"
    mixed = call_of(1, None, 100, L=8, dtype=mx.float32, spec=spec)  # a float16 pool
    assert routes.route(mixed, "cpu").path == "cpu"
    same = call_of(1, 0, 100, dtype=mx.float32, pool_dtype=mx.float32, spec=spec)
    assert routes.route(same, "cpu").path == "reference"  # mlx-lm's own computation


@pytest.mark.parametrize("spec", WINDOW_AND_SINKS)
@pytest.mark.parametrize("where", ["metal", "cuda"])
def test_windows_and_sinks_take_the_gpu_decode_kernels(spec, where):
    """The kernels' one body computes them (tests/test_kernels_window_sinks.py)."""
    assert routes.route(call_of(4, None, 100, spec=spec), where).path == "one_pass"
    assert routes.route(call_of(2, None, 5000, spec=spec), where).path == "two_pass"
    assert routes.route(call_of(1, 0, 100, spec=spec), where).path == "view_sdpa"
    assert routes.route(call_of(1, None, 100, L=8, spec=spec), where).path == "reference"


def test_gpu_multi_query_calls_take_the_reference():
    assert routes.route(call_of(1, None, 100, L=8), "metal").path == "reference"
    assert routes.route(call_of(3, None, 100, L=4), "cuda").path == "reference"


def test_one_contiguous_sequence_takes_the_view(spies):
    inputs = make_inputs(ONE)
    out = paged_attention(**inputs, block_run=0)
    assert spies == {"one_pass": [], "two_pass": []}
    assert mx.array_equal(out, reference.paged_attention_ref(**inputs, block_run=0))


@pytest.mark.parametrize(("case", "path"), [(SHORT, "one_pass"), (ONE, "one_pass"),
                                            (LONG, "two_pass")], ids=["batch", "one", "long"])
def test_kernel_paths(case, path, spies):
    inputs = make_inputs(case)
    out = paged_attention(**inputs)
    assert len(spies[path]) == 1 and sum(map(len, spies.values())) == 1
    assert mx.array_equal(out, reference.paged_attention_ref(**inputs))
    assert guard.kernel_fallback() is None


def test_a_windowed_sink_layer_reaches_the_kernel_with_its_spec(spies):
    inputs = make_inputs(SHORT)
    spec = AttentionSpec(inputs.pop("scale"), window=5, sinks=mx.ones((4,), mx.float16))
    out = paged_attention(**inputs, scale=spec)
    assert len(spies["one_pass"]) == 1 and spies["one_pass"][0][-1] is spec
    assert mx.array_equal(out, reference.paged_attention_ref(**inputs, scale=spec))


def test_two_pass_launch_failure_falls_back(monkeypatch):
    """The real two-pass kernels: MLX raises at launch without Metal."""
    if mx.metal.is_available():
        pytest.skip("Metal present: the kernel launches for real")
    monkeypatch.setattr(backend, "kernel_backend", lambda: "metal")
    inputs = make_inputs(LONG)
    with pytest.warns(RuntimeWarning, match="two_pass attention on metal failed"):
        out = paged_attention(**inputs)
    assert mx.array_equal(out, reference.paged_attention_ref(**inputs))


def test_two_pass_variant_differs_from_one_pass():
    inputs = make_inputs(SHORT)
    args = (inputs["queries"], inputs["k_pool"], inputs["v_pool"], inputs["block_tables"])
    assert abi.variant_key(*args, "one_pass") != abi.variant_key(*args, "two_pass")


def test_bench_measures_the_paths_that_run_here():
    """On the CPU only the SDPA paths run; the kernels' failures are rows, not crashes."""
    rows = bench.measure([(1, 40), (2, 30)], "float16", 16, 1, num_q_heads=4, num_kv_heads=2,
                         head_dim=64)
    one, two = rows
    assert one["ms"]["view_sdpa"] > 0 and one["ms"]["gather_sdpa"] > 0
    assert two["ms"]["view_sdpa"] is None  # several sequences: no view path
    assert one["route"] == "view_sdpa" and two["route"] == "one_pass"
    if backend.kernel_backend() is None:
        assert one["ms"]["one_pass"] is None and one["ms"]["two_pass"] is None
        assert one["fastest"] in ("view_sdpa", "gather_sdpa") and one["gbps"] > 0
    lines = bench.format_rows(rows)
    assert len(lines) == 3 and "two_pass ms" in lines[0] and "fastest" in lines[0]


def test_bench_inputs_make_the_view_path_apply():
    inputs = bench.make_inputs(1, 70, "float16", 16, 0, num_q_heads=4, num_kv_heads=2,
                               head_dim=64)
    table = [int(b) for b in inputs["block_tables"][0].tolist()]
    assert contiguous_run(table) == 0

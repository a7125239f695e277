"""The extension's attention with sliding windows and sinks (decode and prefill) against
`paged_attention_ref` with the same `AttentionSpec`, and the CPU route that takes them."""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_cpu_ext_attention import check as check_kernel
from test_cpu_ext_attention import (
    ext,  # noqa: F401 - the module's autouse fixture
    make_case,
)
from test_cpu_ext_prefill import prefill_case

from engine.model.attention import AttentionSpec, cpu, routes
from engine.model.attention.reference import paged_attention_ref


def spec_of(q, window, sinks):
    logits = 2.0 * mx.random.normal((q.shape[1],), key=mx.random.key(9)) if sinks else None
    return AttentionSpec(q.shape[-1] ** -0.5, window,
                         None if logits is None else logits.astype(q.dtype))


# lens, L (1: decode), Hq, Hkv, D, bs, window: windows of 1, inside a block, across
# blocks and wider than every sequence; ragged batches; a long split-K decode
CASES = [
    ([37, 5, 16], 1, 4, 2, 64, 16, 8),
    ([6000], 1, 9, 3, 64, 16, 700),
    ([3, 200, 9, 150], 1, 4, 2, 16, 4, 1),
    ([600, 900], 1, 32, 2, 64, 32, 64),
    ([90], 20, 4, 2, 64, 16, 17),
    ([300], 64, 8, 2, 64, 16, 33),
    ([700], 128, 4, 4, 128, 16, 256),
    ([50], 50, 4, 1, 64, 8, 4096),
]


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("lens,L,Hq,Hkv,D,bs,window", CASES)
def test_matches_reference(lens, L, Hq, Hkv, D, bs, window, sinks):
    if L == 1:
        q, k, v, tables = make_case(lens, Hq, Hkv, D, bs, seed=len(lens) + D)
        op = cpu.paged_decode
    else:
        q, k, v, tables = prefill_case(lens, L, Hq, Hkv, D, bs, seed=L)
        op = cpu.paged_prefill
    spec = spec_of(q, window, sinks)
    out = check_kernel(q, k, v, tables, lens, spec, op=op)
    if window < max(lens):  # the window changes the answer: the check can fail
        full = paged_attention_ref(q, k, v, tables, lens, AttentionSpec(spec.scale, None,
                                                                          spec.sinks))
        assert mx.abs(out.astype(mx.float32) - full.astype(mx.float32)).max().item() > 1e-3


def test_half_pools_with_window_and_sinks():
    q, k, v, tables = make_case([37, 300, 5], 8, 2, 64, 16, seed=3, pool_dtype=mx.float16,
                                q_dtype=mx.float16)
    check_kernel(q, k, v, tables, [37, 300, 5], spec_of(q, 40, True))


def test_cpu_routes_windowed_batches_to_the_extension():
    q, k, v, tables = make_case([37, 5], 4, 2, 64, 16, seed=1)
    spec = spec_of(q, 8, True)
    from engine.model.attention import PagedCall

    batch = PagedCall(q, k, v, tables, (37, 5), spec)
    assert routes.route(batch, "cpu").path == "cpu"
    one = PagedCall(q[:1], k, v, tables[:1], (37,), spec)  # mlx-lm's own computation
    assert routes.route(one, "cpu").path == "reference"

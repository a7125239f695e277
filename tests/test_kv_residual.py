"""The residual KV formats: blocks stay float16 until full, then are quantized once (keys
per channel within the block); what a query reads; the block lifecycle through the engine.

Quantization error itself is judged on held-out text (`kvchat eval kv`, README); here the
checks are the storage (exact residual, the per-channel error bound, bytes independent of
how rows arrive), the attention rule (a query's own block exact, earlier blocks quantized,
whatever the chunking), and that the engine's runs are stable and give every block back.
"""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest
from test_kv_quant import PROMPT_TEXTS

from engine import Engine, EngineConfig, SamplingParams
from engine.kvcache import channel_quant
from engine.kvcache.kv_cache import KVLayout
from engine.kvcache.quant import QuantSpec
from engine.kvcache.residual import ResidualKVCache
from engine.model.attention import paged_attention, routes
from engine.model.attention.spec import AttentionSpec, PagedCall

H, D, BS = 2, 64, 16


def layout(bits=4, rotation=1, channel=True, layers=1) -> KVLayout:
    q = QuantSpec(bits, 64, rotation)
    return KVLayout(layers, H, D, BS, mx.float16, q, q, residual=True, key_channel=channel)


def rows(n: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    """(H, n, D) float16 keys with outlier channels (as this model family's) and values."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((H, n, D)) * np.where(np.arange(D) % 13 == 0, 30.0, 1.0)
    v = rng.standard_normal((H, n, D))
    return mx.array(k.astype(np.float16)), mx.array(v.astype(np.float16))


def test_layout_names_and_counts_the_new_formats():
    L = KVLayout(30, 3, 64, 16, mx.float16, QuantSpec(4, 64, 1), QuantSpec(4, 64, 1),
                 residual=True, key_channel=True)
    assert L.kv_format == "k=q4c16r1,v=q4g64r1,res=float16"
    # K: 32 bytes of codes + 64 channels x (scale, bias) x 2 bytes over 16 rows; V: 32 + 4
    assert L.bytes_per_token == 30 * 3 * ((32 + 16) + (32 + 4)) == 7_560
    per_token = KVLayout(30, 3, 64, 16, mx.float16, QuantSpec(4, 64, 1), QuantSpec(4, 64, 1))
    assert len({L.kv_format, per_token.kv_format,
                layout(channel=False).kv_format.replace("res", "x")}) == 3
    kv = ResidualKVCache(layout(), 5)
    stored = sum(a.nbytes for side in kv.keys + kv.values for a in side)
    assert stored == kv.nbytes == 5 * kv.layout.bytes_per_block
    with pytest.raises(ValueError, match="per-channel"):
        KVLayout(1, H, D, BS, mx.float16, QuantSpec(4), QuantSpec(4), key_channel=True)


@pytest.mark.parametrize("bits", [4, 8])
def test_per_channel_quantization_round_trips_within_half_a_step(bits):
    k, _ = rows(3 * BS, seed=bits)
    blocks = k.reshape(H, 3, BS, D)
    data, scales, biases = channel_quant.quantize_channels(blocks, bits)
    assert data.shape == (H, 3, D, BS * bits // 8) and scales.shape == (H, 3, D)
    back = channel_quant.dequantize_channels(data, scales, biases, bits)
    err = mx.abs(back.astype(mx.float32) - blocks.astype(mx.float32))
    step = scales.astype(mx.float32)[:, :, None, :]  # one step per (head, block, channel)
    assert mx.all(err <= step * 0.5 + mx.abs(blocks.astype(mx.float32)) * 2e-3 + 1e-3).item()
    # per channel, the outlier channels cost the others nothing: a small channel's error
    # stays a small fraction of its own range, far below an outlier channel's scale
    small = np.array(err)[..., np.arange(D) % 13 != 0].max()
    assert small < float(np.array(scales)[..., ::13].min())


def test_residual_block_is_exact_until_it_fills_then_quantized_once():
    kv = ResidualKVCache(layout(), 6)
    k, v = rows(BS)
    kv.write(0, mx.arange(2 * BS, 2 * BS + 10, dtype=mx.int32), k[:, :10], v[:, :10])
    kp, vp = kv.block_view(0)
    table = mx.array([2], dtype=mx.int32)
    assert mx.array_equal(kp.exact_rows(table)[:, 0, :10], k[:, :10]).item()
    assert mx.array_equal(vp.exact_rows(table)[:, 0, :10], v[:, :10]).item()
    assert kv.num_residual_blocks == 1 and not mx.any(kv.keys[0][0]).item()
    kv.write(0, mx.arange(2 * BS + 10, 3 * BS, dtype=mx.int32), k[:, 10:], v[:, 10:])
    assert kv.num_residual_blocks == 0  # its row is back
    want = channel_quant.quantize_channels(_rotated(k)[:, None], 4)  # the whole block at once
    for got, w in zip(kv.keys[0], want, strict=True):
        assert mx.array_equal(got[:, 2:3], w).item()


def _rotated(k: mx.array) -> mx.array:
    from engine.kvcache import rotation

    return rotation.rotate(k)


@pytest.mark.parametrize("channel", [True, False])
def test_stored_bytes_do_not_depend_on_how_rows_arrive(channel):
    k, v = rows(2 * BS + 5, seed=7)
    n = k.shape[1]
    stores = []
    for cuts in ([0, n], list(range(n + 1)), [0, 5, 21, 32, n]):
        kv = ResidualKVCache(layout(channel=channel), 4)
        for a, b in zip(cuts, cuts[1:], strict=False):
            kv.write(0, mx.arange(BS + a, BS + b, dtype=mx.int32), k[:, a:b], v[:, a:b])
        mx.eval(kv.keys, kv.values)
        stores.append([np.array(a) for a in (*kv.keys[0], *kv.values[0])])
        assert kv.num_residual_blocks == 1  # the third block, 5 rows in
    for other in stores[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(stores[0], other, strict=True))


def test_a_query_reads_its_own_block_exact_and_earlier_blocks_quantized():
    k, v = rows(40, seed=3)
    q = mx.array(np.random.default_rng(4).standard_normal((1, 4, 40, D)).astype(np.float16))
    table = mx.array([[3, 0, 5]], dtype=mx.int32)
    slots = mx.array([b * BS + i for b in (3, 0, 5) for i in range(BS)][:40], dtype=mx.int32)
    # one 40-token chunk
    kv = ResidualKVCache(layout(), 6)
    kv.write(0, slots, k, v)
    # the rule on the reference (`attention/residual.py`); the CPU ops' float32 keys differ
    # from its float16 ones by more than these checks' 2e-3 with x30 outliers, and
    # tests/test_cpu_ext_residual.py holds them to a float64 oracle and to the reference
    chunk = paged_attention(q, *kv.block_view(0), table, [40], D ** -0.5, use_kernels=False)
    # the same tokens one at a time: each decode query reads its own block exact
    kv1 = ResidualKVCache(layout(), 6)
    steps = []
    for i in range(40):
        kv1.write(0, slots[i:i + 1], k[:, i:i + 1], v[:, i:i + 1])
        steps.append(paged_attention(q[:, :, i:i + 1], *kv1.block_view(0), table, [i + 1],
                                     D ** -0.5, use_kernels=False))
    assert mx.allclose(chunk, mx.concatenate(steps, axis=2), atol=2e-3).item()
    # and by hand for the last query: blocks 3 and 0 as stored, its own block exact
    kp, vp = kv.block_view(0)
    keys = mx.concatenate([kp.quantized_rows(table[0, :2]).reshape(H, -1, D),
                           k[:, 32:]], axis=1)
    values = mx.concatenate([vp.quantized_rows(table[0, :2]).reshape(H, -1, D),
                             v[:, 32:]], axis=1)
    want = mx.fast.scaled_dot_product_attention(q[:, :, -1:], keys[None], values[None],
                                                scale=D ** -0.5)
    assert mx.allclose(chunk[:, :, -1:], want, atol=2e-3).item()
    # the quantized blocks are not the exact ones: the rule is what makes the output differ
    exact = mx.fast.scaled_dot_product_attention(q, k[None], v[None], scale=D ** -0.5,
                                                 mask="causal")
    assert not mx.allclose(chunk[:, :, 16:], exact[:, :, 16:], atol=1e-4).item()
    # the first block's queries read only their own block: exact attention
    assert mx.allclose(chunk[:, :, :16], exact[:, :, :16], atol=2e-3).item()


def test_residual_pools_route_to_the_cpu_ops_or_their_reference():
    kv = ResidualKVCache(layout(), 2)
    call = PagedCall(mx.zeros((1, 4, 1, D), mx.float16), *kv.block_view(0),
                     mx.zeros((1, 1), mx.int32), (1,), AttentionSpec(1.0))
    chunk = PagedCall(mx.zeros((1, 4, 3, D), mx.float16), *kv.block_view(0),
                      mx.zeros((1, 1), mx.int32), (3,), AttentionSpec(1.0))
    for backend in ("cpu", "metal", "cuda"):
        # the CPU extension reads the layout (tests/test_cpu_ext_residual.py), a GPU's decode
        # kernel its decodes (tests/test_kernels_residual.py); a GPU's chunks the reference
        for c, gpu_path in ((call, "gpu_residual"), (chunk, "reference")):
            want = "cpu_residual" if backend == "cpu" else gpu_path
            row = routes.route(c, backend)
            assert row.path == want and "residual" in row.when


def test_copy_on_write_carries_exact_rows_and_stored_bytes():
    kv = ResidualKVCache(layout(), 6)
    k, v = rows(BS + 6, seed=9)
    kv.write(0, mx.arange(BS, 2 * BS + 6, dtype=mx.int32), k, v)  # block 1 full, 2 partial
    kv.copy_blocks([(1, 4), (2, 5)])
    kp, _ = kv.block_view(0)
    assert mx.array_equal(kp.exact_rows(mx.array([5]))[:, 0, :6], k[:, BS:]).item()
    assert all(mx.array_equal(a[:, 4], a[:, 1]).item() for a in kv.keys[0])
    assert kv.num_residual_blocks == 2
    with pytest.raises(RuntimeError, match="still filling"):  # the partial copy's block
        kv.take(mx.arange(5 * BS, 6 * BS, dtype=mx.int32))


# -- through the engine --------------------------------------------------------------------

KIVI = dict(kv_bits=4, kv_residual=True, kv_key_channel=True, kv_budget_bytes=32 << 20,
            max_running=4, step_target_s=None)
P16 = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(default_model_ext):
    return [default_model_ext.tokenizer.encode(t) for t in PROMPT_TEXTS]


def test_engine_runs_are_stable_and_give_every_block_back(default_model_ext, prompts):
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = Engine(default_model_ext, EngineConfig(**KIVI))
    assert alone.layout.kv_format == "k=q4c16r1,v=q4g64r1,res=float16"
    ref = [alone.generate_text(ids, p).tokens for ids in prompts]
    batched = Engine(default_model_ext, EngineConfig(**KIVI))
    handles = [batched.submit(ids, p) for ids in prompts]
    assert [[e.token for e in h if e.token is not None] for h in handles] == ref
    warm = batched.generate_text(prompts[0], p)
    assert warm.stats.cached_tokens > 0 and warm.tokens == ref[0]  # cached prefix == cold
    # a cancel mid-decode, beside a request that runs to its end
    h1 = batched.submit(prompts[1], SamplingParams(max_tokens=40, ignore_eos=True))
    h2 = batched.submit(prompts[2], p)
    for i, _ in enumerate(h1):
        if i == 3:
            h1.cancel()
    assert [e.token for e in h2 if e.token is not None] == ref[2]
    blocks = batched.blocks
    blocks.check_invariants()
    assert not blocks.block_tables and blocks.num_free_blocks == blocks.num_blocks
    batched.kv.reclaim()
    assert batched.kv.num_residual_blocks == 0


def evaluated(a: mx.array) -> bool:
    """Whether ``a`` is computed (its graph is one node), not a lazy expression."""
    out = io.StringIO()
    mx.export_to_dot(out, a)
    return "->" not in out.getvalue()


def test_a_prefill_chunk_leaves_no_write_lazy(default_model_ext, prompts):
    # a chunk without a token writes only residual rows; left lazy, the next step computed
    # the chunk too, and its in-place writes found the pool still held by the chunk's
    # attention and copied it (a first decode after a cached prompt: 100 ms, pool-sized)
    engine = Engine(default_model_ext, EngineConfig(**{**KIVI, "prefill_chunk": 8}))
    handle = engine.submit(prompts[0], P16)  # 41 tokens in chunks of 8: no block fills first
    engine.step()
    assert engine.scheduler.running[0].num_computed == 8
    kv = engine.kv
    stores = [a for parts in kv.keys + kv.values for a in parts] + kv.res_keys + kv.res_values
    assert len(stores) == 8 * len(kv.keys)  # 3 parts a side, and the residual rows
    assert all(evaluated(a) for a in stores)
    assert len([e for e in handle if e.token is not None]) == 16


def test_engine_refuses_what_the_residual_formats_do_not_carry(default_model_ext):
    shifting = Engine(default_model_ext, EngineConfig(**KIVI, context_shift=True))
    assert shifting.scheduler.shifter.refusal is None  # carried (`kvcache.residual_shift`)
    with pytest.raises(ValueError, match="kv_residual"):
        EngineConfig(kv_bits=4, kv_key_channel=True)


TIGHT = dict(KIVI, block_size=4, max_running=3)  # blocks of 4: answers outgrow the pool


@pytest.fixture(scope="module")
def alone16(default_model_ext, prompts) -> tuple[list[list[int]], int]:
    """The prompts' 16 tokens each run alone in blocks of 4, and a block's bytes."""
    alone = Engine(default_model_ext, EngineConfig(**TIGHT))
    return [alone.generate_text(ids, P16).tokens for ids in prompts], alone.layout.bytes_per_block


def tight_engine(model, block_bytes: int, blocks: int, **extra) -> Engine:
    """An engine whose pool holds ``blocks`` blocks of 4: the prompts fit, their answers do
    not, so sequences are preempted with their newest block half filled."""
    return Engine(model, EngineConfig(**{**TIGHT, "kv_budget_bytes": blocks * block_bytes,
                                         **extra}))


def run_all(engine: Engine, prompts) -> list[list[int]]:
    handles = [engine.submit(ids, P16) for ids in prompts]
    return [[e.token for e in h if e.token is not None] for h in handles]


def test_an_oversubscribed_pool_recomputes_and_leaks_nothing(default_model_ext, prompts,
                                                             alone16):
    ref, block_bytes = alone16
    tight = tight_engine(default_model_ext, block_bytes, 16)
    assert tight.scheduler.config.preempt_mode == "recompute"  # the default
    out = run_all(tight, prompts)
    m = tight.metrics()
    assert m.preemptions > 0, "no pressure"
    assert m.blocks_free == m.blocks_total and all(len(o) == 16 for o in out)
    # a recompute prefill reads what the decode steps read (a query's own block exact,
    # earlier ones quantized), and the extension's kernels compute a row alike in any
    # batch, so the answers are the lone runs' (measured: equal in full)
    assert out == ref
    tight.kv.reclaim()
    assert tight.kv.num_residual_blocks == 0


def test_an_oversubscribed_pool_swaps_and_leaks_nothing(default_model_ext, prompts, alone16):
    # as above, preempted by swap: full blocks go to host as stored bytes, the half-filled
    # newest block as its exact rows, and all come back bit for bit
    ref, block_bytes = alone16
    tight = tight_engine(default_model_ext, block_bytes, 17,  # swaps 7, then 20
                         preempt_mode="swap", swap_budget_bytes=64 << 20)
    swapped, swap_out = [], tight.swap.swap_out
    tight.swap.swap_out = lambda seq_id, n: swapped.append(n) or swap_out(seq_id, n)
    out = run_all(tight, prompts)
    assert swapped, "no swap"
    assert any(n % 4 for n in swapped), f"no half-filled block swapped: {swapped}"
    m = tight.metrics()
    assert m.blocks_free == m.blocks_total and tight.swap.used_bytes == 0
    assert out == ref
    tight.kv.reclaim()
    assert tight.kv.num_residual_blocks == 0


def test_only_a_filling_blocks_rows_are_taken_apart():
    kv = ResidualKVCache(layout(), 6)
    k, v = rows(BS + 5, seed=3)
    kv.write(0, mx.arange(BS, 2 * BS + 5, dtype=mx.int32), k, v)  # block 1 full, 2 filling
    with pytest.raises(RuntimeError, match="not a filling block"):
        kv.take_rows(1, 5)  # quantized: its rows are not in the side store
    with pytest.raises(RuntimeError, match="not a filling block"):
        kv.take_rows(2, BS)
    keys, values = kv.take_rows(2, 5)
    kv.put_rows(4, keys, values)
    _, vp = kv.block_view(0)
    assert mx.array_equal(vp.exact_rows(mx.array([4]))[:, 0, :5], v[:, BS:]).item()
    assert kv.num_residual_blocks == 2

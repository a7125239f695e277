"""The quantized KV pool: byte accounting, exact storage, attention over it, and the engine.

Quantization error itself is judged by `kvchat eval kv`; here the checks are that the pool
stores exactly what `mx.quantize` produces, that attention over a quantized pool equals
attention over its dequantized copy, and that batching and caching add no error on top.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.kvcache.kv_cache import SCALE_DTYPE, KVLayout, PagedKVCache
from engine.kvcache.quant import QuantSpec
from engine.kvcache.quantized_blocks import QuantizedBlocks
from engine.model.attention.reference import paged_attention_ref

Q8, Q4 = QuantSpec(8, 64), QuantSpec(4, 64)


def test_bytes_per_token_count_scales_and_biases():
    fp16 = KVLayout(30, 3, 64, 16, mx.float16).bytes_per_token
    q8 = KVLayout(30, 3, 64, 16, mx.float32, Q8, Q8)
    q4 = KVLayout(30, 3, 64, 16, mx.float32, Q4, Q4)
    mixed = KVLayout(30, 3, 64, 16, mx.float32, Q8, Q4)
    # 64 elements at 8 bits + one float16 scale and bias per group of 64, per head and layer
    assert q8.bytes_per_token == 30 * 3 * 2 * (64 + 4) == 12_240
    assert q4.bytes_per_token == 30 * 3 * 2 * (32 + 4) == 6_480
    assert q8.bytes_per_token / fp16 <= 0.55 and q4.bytes_per_token / fp16 <= 0.3
    assert mixed.bytes_per_token == (12_240 + 6_480) // 2
    assert (q8.kv_format, mixed.kv_format) == ("k=q8g64,v=q8g64", "k=q8g64,v=q4g64")
    assert KVLayout(30, 3, 64, 16, mx.float32).kv_format == "float32"


@pytest.mark.parametrize("quant", [Q8, Q4, QuantSpec(4, 32)])
def test_pool_bytes_match_the_layout(quant):
    layout = KVLayout(2, 2, 64, 4, mx.float32, quant, quant)
    kv = PagedKVCache(layout, 5)
    stored = sum(a.nbytes for layer in kv.keys + kv.values for a in layer)
    assert stored == kv.nbytes == 5 * layout.bytes_per_block


def quantized_pool(quant_k, quant_v, seed=0, blocks=6, bs=4, H=2, D=64):
    layout = KVLayout(1, H, D, bs, mx.float32, quant_k, quant_v)
    kv = PagedKVCache(layout, blocks)
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((H, blocks * bs, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((H, blocks * bs, D)).astype(np.float32))
    kv.write(0, mx.arange(blocks * bs), k, v)
    return kv, k, v


def dense(pool) -> mx.array:
    """A quantized block view dequantized in full: the reference's input."""
    if isinstance(pool, QuantizedBlocks):
        return pool.gather(mx.arange(pool.shape[1]))
    return pool


def test_writes_store_exactly_what_mx_quantize_gives():
    kv, k, _ = quantized_pool(Q8, Q4)
    data, scales, biases = mx.quantize(k, group_size=64, bits=8)
    assert mx.array_equal(kv.keys[0][0], data)
    assert mx.array_equal(kv.keys[0][1], scales.astype(SCALE_DTYPE))
    back = dense(kv.block_view(0)[0]).reshape(k.shape).astype(mx.float32)
    # the affine error bound: half a step of each group's scale (+ float16 rounding)
    step = mx.abs(mx.repeat(scales, 64, axis=-1))  # MLX scales may be negative
    assert mx.all(mx.abs(back - k) <= step * 0.51 + 1e-2).item()


@pytest.mark.parametrize("quant_k,quant_v", [(Q8, Q8), (Q4, Q4), (Q8, Q4), (None, Q4)])
def test_attention_over_a_quantized_pool_equals_its_dequantized_copy(quant_k, quant_v):
    kv, _, _ = quantized_pool(quant_k, quant_v, seed=3)
    k_pool, v_pool = kv.block_view(0)
    kd, vd = dense(k_pool), dense(v_pool)
    rng = np.random.default_rng(4)
    scale = 64 ** -0.5
    # one sequence, gathered and as a contiguous run; then a ragged batch of decodes
    q = mx.array(rng.standard_normal((1, 4, 3, 64)).astype(np.float32))
    tables = mx.array([[2, 0, 5]], dtype=mx.int32)
    ref = paged_attention_ref(q, kd, vd, tables, [11], scale)
    assert mx.allclose(paged_attention_ref(q, k_pool, v_pool, tables, [11], scale), ref,
                       atol=1e-5).item()
    run = paged_attention_ref(q, k_pool, v_pool, mx.array([[1, 2, 3]]), [10], scale, block_run=1)
    ref_run = paged_attention_ref(q, kd, vd, mx.array([[1, 2, 3]]), [10], scale, block_run=1)
    assert mx.allclose(run, ref_run, atol=1e-5).item()
    qb = mx.array(rng.standard_normal((3, 4, 1, 64)).astype(np.float32))
    tb = mx.array([[0, 1, 2], [3, 3, 3], [4, 5, 1]], dtype=mx.int32)
    out = paged_attention_ref(qb, k_pool, v_pool, tb, [12, 2, 7], scale)
    assert mx.allclose(out, paged_attention_ref(qb, kd, vd, tb, [12, 2, 7], scale),
                       atol=1e-5).item()


def test_copy_on_write_and_swap_keep_the_stored_bytes():
    kv, _, _ = quantized_pool(Q4, Q8)
    keys, values = kv.take(mx.arange(4))
    kv.copy_blocks([(0, 3)])
    moved, _ = kv.take(mx.arange(12, 16))
    assert all(mx.array_equal(a, b) for a, b in zip(keys[0], moved[0], strict=True))
    kv.put(mx.arange(20, 24), keys, values)
    back, back_v = kv.take(mx.arange(20, 24))
    assert all(mx.array_equal(a, b) for a, b in zip(values[0], back_v[0], strict=True))


def test_a_head_dim_the_group_cannot_divide_falls_back_to_float16(tiny_model):
    # the tiny qwen3 has head_dim 16: no group of 32 or 64 divides it
    e = Engine(tiny_model, EngineConfig(kv_bits=8, kv_budget_bytes=1 << 20, block_size=4))
    assert e.layout.kv_format == "float16" and not e.layout.quantized
    assert "float16" in e.notices[0] and "head dim" in e.notices[0]
    assert e.generate_text([5, 6, 7], SamplingParams(max_tokens=2)).finish_reason == "length"


# a repeated sentence (blocks fill), a story opening and a short list prompt
PROMPT_TEXTS = ("The quick brown fox jumps over the lazy dog. " * 4,
                "Once upon a time, in a small village by the sea,", "List three colors:")


@pytest.fixture(scope="module")
def q8_prompts(default_model):
    return [default_model.tokenizer.encode(t) for t in PROMPT_TEXTS]


@pytest.mark.parametrize("rotation", [True, False])
def test_quantized_batched_equals_quantized_alone(default_model_ext, q8_prompts, rotation):
    # On the extension's path every kernel computes a row alike in any batch (the int16
    # matmuls, paged attention, the K/V quantization and its rotation, row by row), so a
    # batch gives each prompt exactly its tokens alone. (On `--weights float32` the BLAS
    # GEMM of a packed prefill rounds K/V differently in the last bit, and a 4-bit V can
    # flip a greedy step on it: measured, one of these prompts diverged at token 5.)
    cfg = dict(kv_budget_bytes=32 << 20, k_bits=8, v_bits=4, max_running=4, step_target_s=None,
               kv_rotation=rotation)
    alone = Engine(default_model_ext, EngineConfig(**cfg))
    assert alone.layout.kv_format == ("k=q8g64r1,v=q4g64r1" if rotation else "k=q8g64,v=q4g64")
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [alone.generate_text(ids, p).tokens for ids in q8_prompts]
    batched = Engine(default_model_ext, EngineConfig(**cfg))
    handles = [batched.submit(ids, p) for ids in q8_prompts]
    out = [[e.token for e in h if e.token is not None] for h in handles]
    assert out == ref  # the three prompts prefilled in one packed forward
    # a warm run on the cached prefix gives the cold run's tokens too
    assert batched.generate_text(q8_prompts[0], p).tokens == ref[0]
    assert batched.metrics().cached_tokens_total > 0


def test_quantized_blocks_persist_and_never_mix_with_other_formats_on_disk(
        default_model, q8_prompts, tmp_path):
    ids, p = q8_prompts[0], SamplingParams(max_tokens=8, ignore_eos=True)
    disk = dict(kv_budget_bytes=32 << 20, disk_cache=True, disk_cache_dir=str(tmp_path))

    def files() -> dict[str, bytes]:
        return {f.name: f.read_bytes() for f in tmp_path.rglob("*.kvb")}

    def run(**cfg):
        engine = Engine(default_model, EngineConfig(**disk, **cfg))
        r = engine.generate_text(ids, p)
        engine.shutdown()  # drains the writer: its entries are on disk
        return engine, r

    cold_q = Engine(default_model, EngineConfig(kv_budget_bytes=32 << 20, kv_bits=8,
                                                prefix_cache=False))
    want = cold_q.generate_text(ids, p).tokens
    fp, cold_fp = run()
    floats = files()
    assert floats and fp.metrics().disk_entries == len(floats)
    q, r = run(kv_bits=8)
    assert not q.notices  # quantized pools use the disk store
    assert r.stats.cache_source == "none" and r.tokens == want  # float entries not served
    quantized = {k: v for k, v in files().items() if k not in floats}
    assert len(quantized) == len(floats)  # its own entries, beside the float ones
    assert {k: files()[k] for k in floats} == floats  # which it left alone
    # a new q8 engine: only the disk can serve it, bit-exactly, so warm == cold
    q2, r2 = run(kv_bits=8)
    assert r2.stats.cache_source == "disk" and r2.tokens == want
    assert r2.stats.cached_tokens == (len(ids) - 1) // 16 * 16
    # another quantized format and the float format each see only their own
    _, mixed = run(k_bits=8, v_bits=4)
    assert mixed.stats.cache_source == "none"
    _, fp2 = run()
    assert fp2.stats.cache_source == "disk" and fp2.tokens == cold_fp.tokens  # float32, too
    assert q2.prefix.store.stats().misses == 0  # nothing was judged foreign or malformed


# a fixed prefill budget: timed pacing moves chunk boundaries from run to run, and a
# 4-bit pool can round a differently chunked recompute a step apart
OVERSUBSCRIBED = dict(kv_bits=4, block_size=4, max_running=3, step_target_s=None)


@pytest.fixture(scope="module")
def q4_alone(default_model, q8_prompts):
    """Each prompt alone on a roomy 4-bit pool (both preemption modes' reference), and the
    pool's bytes per block."""
    alone = Engine(default_model, EngineConfig(kv_budget_bytes=16 << 20, **OVERSUBSCRIBED))
    p = SamplingParams(max_tokens=16, ignore_eos=True)
    return [alone.generate_text(ids, p).tokens for ids in q8_prompts], alone.layout.bytes_per_block


@pytest.mark.parametrize("mode", [None, "recompute"])
def test_oversubscribed_quantized_pool_resumes_identically(default_model, q8_prompts, q4_alone,
                                                           mode):
    p = SamplingParams(max_tokens=16, ignore_eos=True)
    ref, bytes_per_block = q4_alone
    # the prompts fit (14 blocks), their answers do not (26): preemption while decoding
    tight = Engine(default_model, EngineConfig(
        kv_budget_bytes=16 * bytes_per_block, preempt_mode=mode, **OVERSUBSCRIBED))
    handles = [tight.submit(ids, p) for ids in q8_prompts]
    out = [[e.token for e in h if e.token is not None] for h in handles]
    m = tight.metrics()
    assert m.preemptions > 0, "no pressure"
    assert m.blocks_free == m.blocks_total and all(len(o) == 16 for o in out)
    if mode is None:
        assert tight.scheduler.config.preempt_mode == "swap"  # quantized pools swap
    # A 4-bit pool amplifies float noise: a batched GEMM or a recompute prefill computes
    # K/V a rounding away from a lone decode, and the next quantization step can flip.
    # Measured here: every sequence equal to alone for its first 13 tokens, one of three
    # drifting after that. The prefix before any preemption or batching is identical.
    for o, r in zip(out, ref, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(o))
        assert same >= 8, (o, r)

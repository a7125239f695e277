"""The RoPE delta of a context shift (`engine.model.rope_shift`) is exact.

- pooled keys rotated by -delta equal the same keys rotated fresh at the new positions
  (float pools to float rounding; a quantized K side within its quantization error);
- a one-layer model (whose K/V depend on the token and its position only): after a shift,
  the next logits equal mlx-lm's fresh forward over [sinks + window + next token];
- the embedded 30-layer model: layer 0's shifted keys equal a fresh forward's, and the next
  logits equal mlx-lm's forward of that token over the shifted cache at the shifted offset
  (deeper layers' K/V were computed over the dropped tokens too, so a fresh forward over
  the kept tokens would differ there: that is what a shift keeps, and what recompute loses).
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE
from test_model_runner import forward, prefill

from engine import Engine, EngineConfig, load_model
from engine.kvcache.context_shift import shift
from engine.kvcache.kv_cache import KVLayout, PagedKVCache
from engine.kvcache.quant import QuantSpec
from engine.kvcache.rotation import unrotate
from engine.model.rope_shift import KeyShifter, refusal

H, D, BS = 3, 64, 8


def _layer(rope):
    return SimpleNamespace(self_attn=SimpleNamespace(rope=rope))


def _runner(ropes, *, modules=False, windows=None):
    return SimpleNamespace(layers=[_layer(r) for r in ropes], modules=modules,
                           windows=windows or [None] * len(ropes),
                           text=SimpleNamespace(model_type="llama"))


def _fresh_keys(rope, k: mx.array, start: int) -> mx.array:
    """(H, n, D) pre-RoPE keys at positions start.. -> roped, as the runner stores them."""
    return rope(k[None], offset=start)[0]


def test_refusal_names_what_cannot_shift():
    llama3 = Llama3RoPE(D, base=10000.0, scaling_config={"factor": 8.0})
    assert refusal(_runner([nn.RoPE(D, traditional=True, base=1e5)] * 2)) is None
    assert refusal(_runner([llama3])) is None  # scaled frequencies are still a rotation
    su = SuScaledRoPE(D, max_position_embeddings=4096, original_max_position_embeddings=1024,
                      short_factor=[1.0] * (D // 2), long_factor=[2.0] * (D // 2))
    for runner, word in ((_runner([nn.RoPE(D)], modules=True), "mlx-lm's modules"),
                         (_runner([nn.RoPE(D)] * 2, windows=[8, None]), "sliding-window"),
                         (_runner([nn.RoPE(D), su]), "SuScaledRoPE"),
                         (_runner([nn.RoPE(D), nn.Identity()]), "Identity")):
        why = refusal(runner)
        assert why is not None and word in why and "\n" not in why


def _pool(k_quant=None, layers=2, blocks=8):
    layout = KVLayout(layers, H, D, BS, mx.float32, k_quant=k_quant)
    return PagedKVCache(layout, blocks)


def _dequantized_keys(kv: PagedKVCache, layer: int, slots: mx.array) -> mx.array:
    q = kv.layout.k_quant
    rows = mx.dequantize(*(a[:, slots] for a in kv.keys[layer]), group_size=q.group_size,
                         bits=q.bits)
    return unrotate(rows) if q.rotation else rows


def test_rotated_keys_equal_keys_at_the_new_positions():
    ropes = [nn.RoPE(D, traditional=True, base=1e5), nn.RoPE(D, base=1e4)]
    kv = _pool()
    k = mx.random.normal((H, 5 * BS, D), key=mx.random.key(1))
    start, delta = 200, 3 * BS  # positions 200..239 -> 176..215
    slots = mx.arange(5 * BS, dtype=mx.int32)  # blocks 0..4
    for layer, rope in enumerate(ropes):
        kv.write(layer, slots, _fresh_keys(rope, k, start), mx.zeros((H, 5 * BS, D)))
    KeyShifter(_runner(ropes), kv).shift([0, 1, 2, 3, 4], delta)
    for layer, rope in enumerate(ropes):
        want = _fresh_keys(rope, k, start - delta)
        assert mx.abs(kv.keys[layer][:, :5 * BS] - want).max().item() < 1e-4
    assert mx.abs(kv.keys[0][:, 5 * BS:]).max().item() == 0  # other blocks untouched


def test_quantized_keys_shift_within_their_quantization_error():
    rope = nn.RoPE(D, traditional=True, base=1e5)
    for quant in (QuantSpec(8, 64, 1), QuantSpec(4, 32, 0)):
        kv, fresh = _pool(quant, layers=1), _pool(quant, layers=1)
        k = mx.random.normal((H, 2 * BS, D), key=mx.random.key(2))
        slots = mx.arange(2 * BS, dtype=mx.int32)
        kv.write(0, slots, _fresh_keys(rope, k, 100), mx.zeros((H, 2 * BS, D)))
        fresh.write(0, slots, _fresh_keys(rope, k, 60), mx.zeros((H, 2 * BS, D)))
        KeyShifter(_runner([rope]), kv).shift([0, 1], 40)
        want = _fresh_keys(rope, k, 60)
        err = mx.abs(_dequantized_keys(kv, 0, slots) - want).max().item()
        base = mx.abs(_dequantized_keys(fresh, 0, slots) - want).max().item()
        assert base > 0 and err < 3 * base  # a second rounding, not a wrong rotation


def _shifted_step(engine: Engine, ids: list[int], sink: int, drop: int, next_token: int):
    """Prefill ``ids`` as sequence 0, shift it, decode ``next_token``: (logits, kept ids)."""
    prefill(engine, 0, ids)
    moved = shift(engine.blocks, 0, sink, drop)
    engine.scheduler.shifter.keys.shift(moved.moved, moved.delta)
    bs = engine.blocks.block_size
    kept = ids[:sink * bs] + ids[(sink + drop) * bs:]
    logits = forward(engine, 0, [next_token], logits=True)
    return logits[0], kept


def test_one_layer_model_matches_a_fresh_forward_over_the_kept_tokens(tmp_path, default_model):
    from app.dev.make_model import save_random_model

    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=1,
                  intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
                  tie_word_embeddings=False, rope_traditional=False,
                  vocab_size=default_model.config["vocab_size"],
                  eos_token_id=default_model.config["eos_token_id"])
    loaded = load_model(str(save_random_model(tmp_path / "one", config, default_model.path,
                                              seed=3, scale=4)))
    engine = Engine(loaded, EngineConfig(kv_budget_bytes=8 << 20, block_size=8,
                                         prefix_cache=False))
    ids = [int(t) for t in np.random.default_rng(0).integers(100, 20000, 61)]
    logits, kept = _shifted_step(engine, ids, sink=1, drop=3, next_token=1234)
    assert len(kept) == 61 - 24
    fresh = loaded.model(mx.array([kept + [1234]]))[0, -1]
    assert mx.abs(logits - fresh).max().item() < 1e-3 * max(1.0, mx.abs(fresh).max().item())
    assert int(mx.argmax(logits)) == int(mx.argmax(fresh))
    # and the dropped tokens mattered: over every token the logits are others
    whole = loaded.model(mx.array([ids + [1234]]))[0, -1]
    assert mx.abs(logits - whole).max().item() > 1e-2


def test_embedded_model_shifted_cache_is_mlx_lms_cache_at_the_new_positions(default_model):
    engine = Engine(default_model, EngineConfig(kv_budget_bytes=32 << 20, block_size=16,
                                                prefix_cache=False))
    tok = default_model.tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 12)[:96]
    logits, kept = _shifted_step(engine, ids, sink=1, drop=2, next_token=ids[-1])
    n, table = len(kept), engine.blocks.block_tables[0]
    slots = mx.array(engine.blocks.slots(0, 0, n), dtype=mx.int32)
    # layer 0: K of a token depends on the token and its position only
    fresh = [KVCache() for _ in engine.runner.layers]
    default_model.model(mx.array([kept]), cache=fresh)
    k0 = fresh[0].keys[0, :, :n]  # (H, n, D) at positions 0..n-1
    assert mx.abs(engine.kv.keys[0][:, slots] - k0).max().item() < 1e-3
    # the next token over the shifted cache, in mlx-lm, at offset n
    caches = []
    for layer in range(len(engine.runner.layers)):
        c = KVCache()
        c.keys = engine.kv.keys[layer][:, slots][None]
        c.values, c.offset = engine.kv.values[layer][:, slots][None], n
        caches.append(c)
    want = default_model.model(mx.array([[ids[-1]]]), cache=caches)[0, -1]
    assert caches[0].offset == n + 1 and len(table) == -(-(n + 1) // 16)
    assert mx.abs(logits - want).max().item() < 1e-3 * max(1.0, mx.abs(want).max().item())
    assert int(mx.argmax(logits)) == int(mx.argmax(want))


def test_residual_pools_shift_full_blocks_requantized_and_filling_rows_exactly():
    """-kivi pools: two full blocks (per-channel 4-bit keys, rotated or not; or per-token
    8-bit) move within their quantization error, the filling block's exact rows exactly."""
    from engine.kvcache.residual import ResidualKVCache

    rope = nn.RoPE(D, traditional=True, base=1e5)
    n = 2 * BS + 5  # the third block still filling
    k = mx.random.normal((H, n, D), key=mx.random.key(3))
    slots = mx.arange(n, dtype=mx.int32)
    for quant, channel in ((QuantSpec(4, 64, 1), True), (QuantSpec(4, 64, 0), True),
                           (QuantSpec(8, 64, 1), False)):
        layout = KVLayout(1, H, D, BS, mx.float32, quant, QuantSpec(8, 64), residual=True,
                          key_channel=channel)
        kv, fresh = ResidualKVCache(layout, 8), ResidualKVCache(layout, 8)
        kv.write(0, slots, _fresh_keys(rope, k, 100), mx.zeros((H, n, D)))
        fresh.write(0, slots, _fresh_keys(rope, k, 60), mx.zeros((H, n, D)))
        KeyShifter(_runner([rope]), kv).shift([0, 1, 2], 40)
        want = _fresh_keys(rope, k, 60)
        table = mx.array([0, 1], dtype=mx.int32)
        got = kv.block_view(0)[0].quantized_rows(table).reshape(H, -1, D)
        base = fresh.block_view(0)[0].quantized_rows(table).reshape(H, -1, D)
        err = mx.abs(got - want[:, :2 * BS]).max().item()
        ref = mx.abs(base - want[:, :2 * BS]).max().item()
        assert ref > 0 and err < 3 * ref, (quant, channel)  # a second rounding, not wrong
        exact = kv.block_view(0)[0].exact_rows(mx.array([2], dtype=mx.int32))
        assert mx.allclose(exact.reshape(H, -1, D)[:, :5], want[:, 2 * BS:], atol=1e-4)

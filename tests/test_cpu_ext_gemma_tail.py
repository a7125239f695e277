"""Gemma 3's layer after attention as one op (`cpu_ext.gemma_tail`): bit for bit the
separate ops, at decode, prompt and multi-pass (over 64 rows) lengths, tiled or not."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.model.cpu_ext import build, gemma_tail, linear, norm_rope


@pytest.fixture(scope="module")
def ext():
    if not build.available():
        pytest.skip(f"CPU extension unavailable: {build.unavailable_reason()}")
    return build.require()


def quantized_gemma(tiled: bool):
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=128,
                                 num_hidden_layers=2, intermediate_size=256,
                                 num_attention_heads=2, head_dim=64, rms_norm_eps=1e-6,
                                 vocab_size=256, num_key_value_heads=1,
                                 sliding_window=64, sliding_window_pattern=2)
    mx.random.seed(3)
    model = gemma3_text.Model(args)
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=32, bits=4)
    for layer in model.model.layers:  # norms away from 0, so 1 + w matters
        for name in ("post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            norm = getattr(layer, name)
            norm.weight = mx.random.normal(norm.weight.shape).astype(mx.float16) * 0.3
    mx.eval(model.parameters())
    linear.install(model, tiled=tiled)
    norm_rope.install(model)
    return model


def logits(model, ids, enabled: bool, monkeypatch) -> mx.array:
    monkeypatch.setattr(gemma_tail, "ENABLED", enabled)
    out = model(ids)
    mx.eval(out)
    return out


@pytest.mark.parametrize("tiled", [True, False])
def test_tail_is_bit_for_bit_the_separate_ops(ext, monkeypatch, tiled):
    model = quantized_gemma(tiled)
    layer = model.model.layers[0]
    assert gemma_tail.tail_parts(layer) is not None
    assert all(spec[2] == tiled for _, spec in gemma_tail.tail_parts(layer)[0])
    ids = mx.random.randint(0, 256, (2, 300), key=mx.random.key(1))
    # 300 rows: four passes of 64 and one of 44 when tiled; decode and short prompts
    for x in (ids, ids[:1, :5], ids[:, :1]):
        fused, separate = (logits(model, x, on, monkeypatch) for on in (True, False))
        assert fused.dtype == separate.dtype and fused.shape == separate.shape
        assert mx.array_equal(fused, separate).item(), x.shape


def test_tail_node_replaces_the_layer_rest(ext, monkeypatch):
    model = quantized_gemma(True)
    layer, x = model.model.layers[0], mx.random.normal((1, 1, 128)).astype(mx.float16)
    parts = gemma_tail.tail_parts(layer)
    att = layer.self_attn.heads(layer.input_layernorm(x))
    out = gemma_tail.gemma_tail(x, att, parts)
    assert out.dtype == mx.float16 and out.shape == x.shape
    monkeypatch.setattr(gemma_tail, "ENABLED", False)
    assert mx.array_equal(out, layer(x)).item()
    monkeypatch.setattr(gemma_tail, "ENABLED", True)
    layer.mlp.up_proj = nn.Linear(128, 256, bias=False)  # a float linear: separate ops
    assert gemma_tail.tail_parts(layer) is None
    assert layer(x).shape == x.shape

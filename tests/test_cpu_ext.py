"""The C++ CPU extension: its quantized matmul against `mx.quantized_matmul`, the build
cache, and the clean fallback when it cannot be built."""

from __future__ import annotations

import copy
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.model.cpu_ext import build, ops, toolchain
from engine.paths import is_trusted_file


@pytest.fixture(scope="module")
def ext():
    if not build.available():
        pytest.skip(f"CPU extension unavailable: {build.unavailable_reason()}")
    return build.load()


def quantized(N: int, K: int, *, bits: int, group: int, seed: int, scale_dtype=mx.float16):
    mx.random.seed(seed)
    w, scales, biases = mx.quantize(mx.random.normal((N, K)), group_size=group, bits=bits)
    return w, scales.astype(scale_dtype), biases.astype(scale_dtype)


def check_qmm(x, w, scales, biases, *, group, bits, rel=2e-6):
    """qmm vs MLX's own quantized matmul: same dtype and shape, close in float32."""
    out = ops.qmm(x, w, scales, biases, group_size=group, bits=bits)
    ref = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group, bits=bits)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    bound = rel * max(1.0, mx.abs(ref.astype(mx.float32)).max().item()) * x.shape[-1] ** 0.5
    assert err <= bound, (err, bound)
    return out, ref


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 16, 100])
def test_qmm_matches_quantized_matmul(ext, bits, group, rows):
    w, s, b = quantized(200, 384, bits=bits, group=group, seed=rows)  # N not a multiple of 16
    x = mx.random.normal((rows, 384))
    check_qmm(x, w, s, b, group=group, bits=bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,N,K", [(517, 300, 1536), (17, 33, 64), (512, 960, 576)])
def test_qmm_prefill_gemm(ext, bits, rows, N, K):
    """The GEMM's edges: x rows past a block of 256 and not a multiple of 8, weight
    panels of 128 rows with a ragged last one, columns not a multiple of 32."""
    w, s, b = quantized(N, K, bits=bits, group=32, seed=rows + bits)
    check_qmm(mx.random.normal((rows, K)), w, s, b, group=32, bits=bits)


@pytest.mark.parametrize("shape", [(2, 3, 96), (96,), (1, 1, 96)])
def test_qmm_leading_shapes(ext, shape):
    w, s, b = quantized(33, 96, bits=4, group=32, seed=1)
    out, _ = check_qmm(mx.random.normal(shape), w, s, b, group=32, bits=4)
    assert out.shape == (*shape[:-1], 33)


@pytest.mark.parametrize("dtype,rel", [(mx.float16, 2e-3), (mx.bfloat16, 1.6e-2)])
def test_qmm_half_inputs(ext, dtype, rel):
    w, s, b = quantized(64, 256, bits=8, group=64, seed=2, scale_dtype=dtype)
    for rows in (2, 40):  # the GEMV and the GEMM
        check_qmm(mx.random.normal((rows, 256)).astype(dtype), w, s, b, group=64, bits=8,
                  rel=rel)


def test_qmm_float32_scales_and_strided_input(ext):
    w, s, b = quantized(48, 128, bits=4, group=32, seed=3, scale_dtype=mx.float32)
    x = mx.random.normal((128, 7)).T  # a transposed view: not row-contiguous
    check_qmm(x, w, s, b, group=32, bits=4)
    x = mx.broadcast_to(mx.random.normal((1, 128)), (20, 128))  # stride 0 rows
    check_qmm(x, w, s, b, group=32, bits=4)


def test_qmm_rows_do_not_depend_on_the_other_rows(ext):
    """Fusing q/k/v (or gate/up) concatenates weights: each output row must be unchanged."""
    parts = [quantized(n, 576, bits=4, group=32, seed=n) for n in (576, 192, 192)]
    fused = [mx.concatenate([p[i] for p in parts]) for i in range(3)]
    for rows in (1, 64):
        x = mx.random.normal((rows, 576))
        one = ops.qmm(x, *fused, group_size=32, bits=4)
        apart = mx.concatenate([ops.qmm(x, *p, group_size=32, bits=4) for p in parts], axis=-1)
        np.testing.assert_array_equal(np.array(one), np.array(apart))


def test_qmm_rejects_bad_arguments(ext):
    w, s, b = quantized(16, 64, bits=4, group=32, seed=4)
    with pytest.raises(ValueError, match="bits"):
        ops.qmm(mx.zeros((1, 64)), w, s, b, group_size=32, bits=3)
    with pytest.raises(ValueError, match="shapes"):
        ops.qmm(mx.zeros((1, 32)), w, s, b, group_size=32, bits=4)


@pytest.mark.parametrize("dtype,rel", [(mx.float32, 2e-6), (mx.float16, 1e-3),
                                       (mx.bfloat16, 8e-3)])
def test_swiglu_matches_mlx_lm(ext, dtype, rel):
    from mlx_lm.models.activations import swiglu as reference

    from engine.model.cpu_ext.norm_rope import swiglu

    # the split halves of a fused gate/up output (strided views), odd sizes, big |x|
    gate_up = (mx.random.normal((3, 37, 2 * 531), key=mx.random.key(5)) * 8).astype(dtype)
    gate, up = mx.split(gate_up, [531], axis=-1)
    gate = mx.concatenate([gate[..., :-2], mx.array([[[-200.0, 200.0]] * 37] * 3, dtype)], -1)
    out, ref = swiglu(gate, up), reference(gate, up)
    assert out.shape == ref.shape and out.dtype == ref.dtype == dtype
    err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    assert err <= rel * mx.abs(ref.astype(mx.float32)).max().item(), err


@pytest.mark.parametrize("dtype,rel", [(mx.float32, 2e-6), (mx.float16, 1e-3),
                                       (mx.bfloat16, 8e-3)])
def test_gelu_tanh_mul_matches_mlx(ext, dtype, rel):
    from engine.model.cpu_ext.norm_rope import gelu_tanh_mul

    gate_up = (mx.random.normal((3, 37, 2 * 531), key=mx.random.key(6)) * 8).astype(dtype)
    gate, up = mx.split(gate_up, [531], axis=-1)  # strided views, as a fused output gives
    gate = mx.concatenate([gate[..., :-2], mx.array([[[-200.0, 200.0]] * 37] * 3, dtype)], -1)
    out = gelu_tanh_mul(gate, up)
    ref = nn.gelu_approx(gate) * up
    assert out.shape == ref.shape and out.dtype == ref.dtype == dtype
    err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    assert err <= rel * mx.abs(ref.astype(mx.float32)).max().item(), err
    nan = gelu_tanh_mul(mx.array([float("nan"), 1.0]), mx.array([1.0, float("nan")]))
    assert mx.isnan(nan).all().item()  # NaN in, NaN out: a bad activation is not hidden
    with pytest.raises(ValueError, match="one shape"):
        gelu_tanh_mul(mx.zeros((2, 3)), mx.zeros((3, 2)))


def test_clip_add_is_gemma3_clip_residual_bit_for_bit(ext):
    from mlx_lm.models.gemma3_text import clip_residual as reference

    from engine.model.cpu_ext.norm_rope import clip_residual

    # float16 sums past its range (clipped), NaN and inf, a strided operand
    x = (mx.random.normal((3, 5, 67), key=mx.random.key(11)) * 30000).astype(mx.float16)
    y = (mx.random.normal((3, 67, 5), key=mx.random.key(12)) * 30000).astype(mx.float16)
    y = y.transpose(0, 2, 1)
    x = mx.concatenate([x[..., :-3], mx.array([[[float("nan"), float("inf"), -6e4]] * 5] * 3,
                                              mx.float16)], -1)
    out, ref = clip_residual(x, y), reference(x, y)
    assert out.dtype == ref.dtype == mx.float16 and out.shape == ref.shape
    same = (out == ref) | (mx.isnan(out) & mx.isnan(ref))
    assert same.all().item()
    finite = mx.where(mx.isnan(ref), 0, ref).astype(mx.float32)
    assert mx.abs(finite).max().item() == 65504  # the clip took part
    y32 = y.astype(mx.float32) * 1.5  # a float32 y: still a float16 sum, as mlx-lm's
    out, ref = clip_residual(x, y32), reference(x, y32)
    assert out.dtype == ref.dtype == mx.float16
    assert ((out == ref) | (mx.isnan(out) & mx.isnan(ref))).all().item()
    f32 = mx.ones((2, 3))  # other dtypes add, as mlx-lm does
    assert mx.array_equal(clip_residual(f32, f32), f32 + f32)


def gemma3_model(dtype=mx.float32):
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64,
                                 num_hidden_layers=2, intermediate_size=96,
                                 num_attention_heads=2, head_dim=32, rms_norm_eps=1e-6,
                                 vocab_size=128, num_key_value_heads=1,
                                 sliding_window=16, sliding_window_pattern=2)
    model = gemma3_text.Model(args)
    model.set_dtype(dtype)
    return model


def test_gemma3_float16_layers_match_mlx_lm(ext):
    from engine.model.cpu_ext.norm_rope import CpuGemma3Block, install

    model = gemma3_model(mx.float16)
    mx.eval(model.parameters())
    inputs = (mx.array([[1, 2, 3, 4]]), mx.array([[5], [6]]))  # L 4; L 1 (by reshapes)
    before = [model(ids) for ids in inputs]
    install(model)
    assert all(type(layer) is CpuGemma3Block for layer in model.model.layers)
    for ids, old in zip(inputs, before, strict=True):
        new = model(ids)
        assert new.dtype == old.dtype == mx.float16 and new.shape == old.shape
        err = mx.abs(new.astype(mx.float32) - old.astype(mx.float32)).max().item()
        assert err <= 1e-2 * max(1.0, mx.abs(old.astype(mx.float32)).max().item()), err


def test_gemma3_norms_and_mlp_become_extension_ops(ext):
    from engine.model.cpu_ext.norm_rope import (
        CpuGemma3Attention,
        CpuGemma3Block,
        CpuGemma3MLP,
        CpuGemma3RMSNorm,
        has_gemma3_ops,
        install,
    )

    model = gemma3_model()
    mx.eval(model.parameters())
    x = mx.random.normal((1, 5, 64), key=mx.random.key(7))
    layer = model.model.layers[0]
    layer.input_layernorm.weight = mx.random.normal((64,), key=mx.random.key(8)) * 0.5
    mlp, norm = layer.mlp, layer.input_layernorm
    before, normed, logits = mlp(x), norm(x), model(mx.array([[1, 2, 3]]))
    assert not has_gemma3_ops(model)
    # a layer: itself, its attention, MLP, six norms, RoPE; the final norm
    assert install(model) == 2 * (1 + 1 + 1 + 6 + 1) + 1
    assert has_gemma3_ops(model)  # the loader keys its cached K/V apart
    swapped = model.model.layers[0]
    assert type(swapped) is CpuGemma3Block and type(swapped.self_attn) is CpuGemma3Attention
    assert type(swapped.self_attn.q_norm) is CpuGemma3RMSNorm  # its parts swapped first
    assert type(swapped.mlp) is CpuGemma3MLP and swapped.mlp.gate_proj is mlp.gate_proj
    assert type(swapped.input_layernorm) is CpuGemma3RMSNorm
    for new, old in ((swapped.mlp(x), before), (swapped.input_layernorm(x), normed),
                     (model(mx.array([[1, 2, 3]])), logits)):
        err = mx.abs(new - old).max().item()
        assert err <= 1e-5 * max(1.0, mx.abs(old).max().item()), err

def test_cached_build_is_reused(ext):
    path = build.build()
    assert path == build.library_path() and is_trusted_file(path)
    assert ext.simd() in ("avx512", "avx2", "neon", "generic") and ext.threads() >= 1


@pytest.fixture
def no_extension(monkeypatch, tmp_path):
    """A process state in which the extension was never tried (restored afterwards)."""
    monkeypatch.setattr(build, "_module", None)
    monkeypatch.setattr(build, "_tried", False)
    monkeypatch.setattr(build, "_off", None)
    failed = copy.copy(build._failed)  # a switch of its own, not yet tripped
    failed.reset()
    monkeypatch.setattr(build, "_failed", failed)
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))  # no cached build to find
    from engine.model.attention import guard

    guard.GUARD.reset()
    yield monkeypatch
    guard.GUARD.reset()


@pytest.mark.parametrize("compiler,why", [("/nonexistent/c++", "no C++ compiler"),
                                          ("/bin/false", "exited 1")])
def test_failed_build_falls_back_with_one_warning(no_extension, compiler, why):
    no_extension.setenv(toolchain.ENV_COMPILER, compiler)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not build.available() and not build.available()
    lines = [str(w.message) for w in seen if "CPU extension unavailable" in str(w.message)]
    assert len(lines) == 1 and why in lines[0], lines
    assert why in build.unavailable_reason()
    with pytest.raises(RuntimeError, match="unavailable"):
        ops.qmm(mx.zeros((1, 32)), *quantized(8, 32, bits=4, group=32, seed=5), group_size=32,
                bits=4)


def test_switch_turns_the_extension_off_quietly(no_extension):
    no_extension.setenv(build.ENV_SWITCH, "0")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not build.available()
    assert not seen and "KVCHAT_CPU_EXT" in build.unavailable_reason()


def test_without_the_extension_everything_takes_mlx_paths(no_extension):
    """Loader and attention both keep today's path; results are the reference's."""
    from engine.model import loader
    from engine.model.attention import paged_attention
    from engine.model.attention.reference import paged_attention_ref

    no_extension.setenv(toolchain.ENV_COMPILER, "/nonexistent/c++")
    model = nn.Sequential(nn.QuantizedLinear(64, 32, group_size=32, bits=4))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert not loader.use_cpu_ext(model, "auto")
        q = mx.random.normal((2, 4, 1, 32))
        pool = mx.random.normal((2, 6, 4, 32)).astype(mx.float16)
        tables = mx.array([[0, 1, 2], [3, 4, 5]], dtype=mx.int32)
        out = paged_attention(q, pool, pool, tables, [9, 12], 0.2)
    ref = paged_attention_ref(q, pool, pool, tables, [9, 12], 0.2)
    np.testing.assert_array_equal(np.array(out), np.array(ref))

"""The quantized-pool variant of the decode kernel without a GPU: its generated
Metal signature and CUDA text, the engine-side support checks and input
unpacking, and the decode dispatch (numbers: test_kernels_emulated.py)."""

from __future__ import annotations

import mlx.core as mx
from kernel_harness import emulator, metal_source, paged
from kernel_harness.cases import Case, make_inputs, quantize_pool

from engine.kvcache.quant import QuantSpec
from engine.kvcache.quantized_blocks import QuantizedBlocks
from engine.model import backend
from engine.model.attention import guard
from engine.model.attention.gpu import abi


def test_generated_signature_for_quantized_pools():
    """K 8-bit group 32 (packed words, device scales), V plain (placeholder scales)."""
    inputs = {
        "queries": mx.zeros((2, 4, 1, 64), dtype=mx.float16),
        "k_pool": quantize_pool(mx.zeros((2, 10, 16, 64), dtype=mx.float16), 8, 32),
        "v_pool": mx.zeros((2, 10, 16, 64), dtype=mx.float16),
        "block_tables": mx.zeros((2, 5), dtype=mx.int32),
        "context_lens": [20, 20],
        "scale": 0.125,
    }
    src = emulator.parse_metal(
        metal_source.generated_metal_source(**inputs), abi.INPUT_NAMES, abi.OUTPUT_NAMES
    )
    params = {p.name: p for p in src.params}
    assert params["k_pool"].ctype == "const device uint32_t*"
    assert params["v_pool"].ctype == "const device float16_t*"
    assert params["k_scales"].ctype == params["k_biases"].ctype == "const device float16_t*"
    assert params["v_scales"].ctype == params["v_biases"].ctype == "const constant float16_t*"
    assert src.template_call == "<float16_t, 64, 16, 8, 8, 32, 0, 0>"
    assert {p.name for p in src.params if p.kind in ("shape", "strides", "ndim")} == {
        "queries_shape",
        "k_pool_shape",
        "block_tables_shape",
        "attn_sinks_shape",  # one placeholder sink or one per query head
    }


def test_cuda_source_shape_quantized():
    case = Case("float16", 96, 16, 4, 2, (5, 9), k_quant=(4, 32), v_quant=(8, 32))
    src = paged.cuda_source(case, make_inputs(case))
    assert src.name == "custom_kernel_paged_decode_float16_t_96_16_2_4_32_8_32"
    for line in (
        "    const uint32_t* k_pool,",
        "    const uint32_t* v_pool,",
        "  constexpr int KB = 4;",
        "  constexpr int VG = 32;",
    ):
        assert line in src.text


def _fake_quant(bits: int, group: int, head_dim: int = 64, scale_dtype=mx.float16):
    """QuantizedBlocks with the right shapes (supports() never reads the values)."""
    shape = (2, 4, 16)
    return QuantizedBlocks(
        mx.zeros((*shape, head_dim * bits // 32), dtype=mx.uint32),
        mx.zeros((*shape, head_dim // group), dtype=scale_dtype),
        mx.zeros((*shape, head_dim // group), dtype=scale_dtype),
        QuantSpec(bits, group),
        head_dim,
    )


def test_support_for_quantized_pools():
    q = mx.zeros((2, 8, 1, 64), dtype=mx.float16)
    plain = mx.zeros((2, 4, 16, 64), dtype=mx.float16)
    k8, v4 = _fake_quant(8, 32), _fake_quant(4, 64)
    assert abi.supports(q, k8) and abi.supports(q, k8, v4)
    assert abi.supports(q, k8, plain) and abi.supports(q, plain, v4)
    assert not abi.supports(q, _fake_quant(8, 128))  # group does not divide D
    assert not abi.supports(q, k8, mx.zeros((2, 5, 16, 64), dtype=mx.float16))  # blocks
    assert abi.template_args(q, k8, v4)[4:] == [("KB", 8), ("KG", 32), ("VB", 4), ("VG", 64)]
    assert abi.template_args(q, plain, plain)[4:] == [
        ("KB", 0),
        ("KG", 0),
        ("VB", 0),
        ("VG", 0),
    ]


def test_quantized_kernel_inputs_unpack_each_side():
    case = Case("float16", 64, 16, 4, 2, (9, 17), k_quant=(8, 32))
    inputs = make_inputs(case)
    args = dict(zip(abi.INPUT_NAMES, abi.kernel_inputs(**inputs), strict=True))
    k = inputs["k_pool"]
    assert args["k_pool"] is k.data and args["k_scales"] is k.scales
    assert args["k_biases"] is k.biases
    assert args["v_pool"] is inputs["v_pool"]
    assert args["v_scales"].size == args["v_biases"].size == 1  # placeholders


def test_quantized_decode_dispatch(monkeypatch):
    """Quantized decode goes to the kernel where a GPU back-end exists, else the reference."""
    from engine.model.attention import paged_attention, reference
    from engine.model.attention.gpu import one_pass
    from engine.model.cpu_ext import build as cpu_build

    case = Case("float16", 64, 16, 4, 2, (9, 17), k_quant=(8, 32), v_quant=(4, 32))
    inputs = make_inputs(case)
    if backend.kernel_backend() is None:
        expected = reference.paged_attention_ref(**inputs)
        if cpu_build.available():  # the CPU extension's paged decode: same sums, other order
            assert mx.allclose(paged_attention(**inputs), expected, atol=2e-3).item()
        else:
            assert mx.array_equal(paged_attention(**inputs), expected)
    calls = []
    monkeypatch.setattr(backend, "kernel_backend", lambda: "metal")
    # A stand-in kernel that answers like the reference, so its first launch validates.
    monkeypatch.setattr(one_pass, "paged_decode_attention",
                        lambda *a: calls.append(a) or reference.paged_attention_ref(*a))
    guard.GUARD.reset()
    try:
        paged_attention(**inputs)
        assert guard.kernel_fallback() is None
    finally:
        guard.GUARD.reset()
    assert len(calls) == 1 and calls[0][1] is inputs["k_pool"]

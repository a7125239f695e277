"""GGUF K-quant scales kept as codes and steps on the tiled path (`cpu_ext.kquant`).

The oracle is the same layer with float16 scales and biases (what MLX reads): every result
must be the same bits, in decode (tile_rows) and prefill (the lanes kernel) alike.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from app.dev import gguf_writer
from engine.model import gguf_quants
from engine.model.cpu_ext import build, kquant, linear, ops

pytestmark = pytest.mark.skipif(not build.available() or not ops.tiled_supported(),
                                reason="needs the extension's tiled path (AVX-512 VNNI)")


def _layer(kind: str, rows: int = 64, cols: int = 512, seed: int = 0):
    """A quantized linear converted from random ``kind`` blocks, and its K-quant steps."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    x[:, :32] += 0.3  # a sub-block with a large min: biases far from zero
    blocks = gguf_writer.encode(x, kind)
    w, s, b, bits = gguf_quants.to_affine(kind, blocks, (rows, cols))
    layer = nn.QuantizedLinear(cols, rows, bias=False, group_size=32, bits=bits)
    layer.weight, layer.scales, layer.biases = mx.array(w), mx.array(s), mx.array(b)
    d, m = gguf_quants.k_steps(kind, blocks, (rows, cols))
    return layer, (mx.array(d), mx.array(m))


@pytest.fixture(params=[16, 8], ids=["int16-x", "int8-x"])
def activation_bits(request):
    ops.set_activation_bits(request.param)
    yield request.param
    ops.set_activation_bits(16)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_codes_and_steps_give_the_float16_layers_bits(kind, activation_bits):
    layer, steps = _layer(kind)
    plain = linear.CpuTiledLinear.from_quantized(layer)
    codes = linear.CpuTiledLinear.from_quantized(layer, steps)
    assert codes["scales"].dtype == mx.uint8 and codes["biases"].dtype == mx.uint8
    param_bytes = codes["scales"].nbytes + codes["biases"].nbytes
    assert param_bytes * 1.6 == plain["scales"].nbytes + plain["biases"].nbytes  # 0.625 vs 1
    x = mx.random.normal((40, 512), key=mx.random.key(3))
    for rows in (1, 3, 40):  # decode's kernel, then the lanes kernel from 14 rows on
        a, b = plain(x[:rows]), codes(x[:rows])
        assert a.dtype == b.dtype == mx.float32
        assert mx.array_equal(a, b).item(), rows
    y = codes(x[:4].astype(mx.float16))  # the output dtype the float16 scales gave
    assert y.dtype == plain(x[:4].astype(mx.float16)).dtype == mx.float16


def test_a_scale_that_is_not_code_times_step_keeps_float16():
    layer, (d, m) = _layer("Q4_K", seed=1)
    assert kquant.compact(layer["scales"], layer["biases"], d, m) is not None
    bumped = layer["scales"].view(mx.uint16)
    bumped = bumped + (mx.arange(bumped.size).reshape(bumped.shape) == 77).astype(mx.uint16)
    assert kquant.compact(bumped.view(mx.float16), layer["biases"], d, m) is None
    assert kquant.compact(layer["scales"], layer["biases"], d, -m) is None  # wrong sign
    assert kquant.compact(layer["scales"], layer["biases"], d[:, :1], m) is None  # shape
    assert kquant.compact(layer["scales"], layer["biases"], None, m) is None
    kept = linear.CpuTiledLinear.from_quantized(layer, (d, -m))
    assert kept["scales"].dtype == mx.float16


def test_codes_stack_when_layers_fuse():
    """q and k fused (`linear.fuse`) stack their tiles: each row computes as it did alone."""
    (a, sa), (b, sb) = _layer("Q4_K", rows=32, seed=4), _layer("Q4_K", rows=48, seed=5)
    la, lb = (linear.CpuTiledLinear.from_quantized(lay, s) for lay, s in ((a, sa), (b, sb)))
    x = mx.random.normal((2, 512), key=mx.random.key(6))
    want = mx.concatenate([la(x), lb(x)], axis=-1)
    fused = linear.fuse([la, lb])
    assert fused is not None and fused["scales"].dtype == mx.uint8
    assert mx.array_equal(fused(x), want).item()


def test_codes_refused_off_the_tiled_path():
    layer, steps = _layer("Q4_K")
    codes = linear.CpuTiledLinear.from_quantized(layer, steps)
    x = mx.zeros((1, 512))
    with pytest.raises(ValueError, match="K-quant codes"):
        ops.qmm(x, layer["weight"], codes["scales"], codes["biases"], group_size=32, bits=4)
    with pytest.raises(ValueError, match="K-quant codes"):  # a shape that is not 10 per 256
        ops.qmm(x, codes["weight"], codes["scales"][:, :5], codes["biases"][:, :5],
                group_size=32, bits=4, tiled=True)

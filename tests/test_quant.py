"""The one quantized K/V format type: what it admits, the shapes it implies, the pool's subset."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.kvcache.disk.spec import EntrySpec
from engine.kvcache.kv_cache import SCALE_DTYPE, KVLayout
from engine.kvcache.quant import BITS, SCALE_BYTES, QuantSpec


@pytest.mark.parametrize("bad", [dict(bits=7), dict(bits=16), dict(bits=True),
                                 dict(bits=8.0), dict(group_size=16), dict(group_size=64.0)])
def test_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        QuantSpec(**{"bits": 8, "group_size": 64, **bad})


@pytest.mark.parametrize("bits", BITS)
def test_shapes_match_mlx_quantize(bits):
    q, dim = QuantSpec(bits, 32), 96
    assert q.fits(dim)
    data, scales, biases = mx.quantize(mx.zeros((2, dim)), group_size=q.group_size, bits=bits)
    assert data.shape[-1] == q.packed_dim(dim) and scales.shape[-1] == q.num_groups(dim)
    assert q.bytes_per_row(dim) == data.shape[-1] * 4 + 2 * q.num_groups(dim) * SCALE_BYTES


def test_scale_dtype_is_the_pools():
    assert SCALE_DTYPE.size == SCALE_BYTES


def test_fits():
    assert QuantSpec(8, 64).fits(128) and not QuantSpec(8, 64).fits(96)
    assert QuantSpec(3, 32).fits(32)  # 96 bits: three whole uint32 words
    assert not QuantSpec(4, 128).fits(64)  # not one whole group


def test_the_pool_takes_4_and_8_bits_the_disk_spec_every_width():
    with pytest.raises(ValueError, match="KV bits"):
        KVLayout(2, 2, 64, 16, mx.float16, QuantSpec(2, 64))
    layout = KVLayout(2, 2, 64, 16, mx.float16, QuantSpec(8, 64), QuantSpec(4, 32))
    spec = EntrySpec.of(layout)
    assert (spec.k_quant, spec.v_quant) == (layout.k_quant, layout.v_quant)
    assert EntrySpec(2, 2, 64, "float16", QuantSpec(2, 64)).k_quant.name == "q2g64"

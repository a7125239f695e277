"""MoE experts on the tiled `qmm` (`cpu_ext.switch`) against MLX's own `gather_qmm`."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.model.cpu_ext import build, linear

pytestmark = pytest.mark.skipif(not (build.available() and linear.tiled_enabled()),
                                reason="needs the CPU extension's tiled path")


def _layer(bias: bool, bits: int, group: int):
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    mx.random.seed(bits + group)
    layer = QuantizedSwitchLinear(256, 48, 6, bias=bias, group_size=group, bits=bits)
    if bias:
        layer.bias = mx.random.normal((6, 48))
    return layer


@pytest.mark.parametrize("bits,group,bias", [(4, 32, False), (8, 64, True), (4, 128, True)])
@pytest.mark.parametrize("sort", [False, True])
def test_tiled_experts_equal_gather_qmm(bits, group, bias, sort):
    from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort

    from engine.model.cpu_ext.switch import CpuTiledSwitchLinear, switch_supported

    layer = _layer(bias, bits, group)
    assert switch_supported(layer)
    x = mx.random.normal((2, 9, 256))[..., None, None, :]  # SwitchGLU's (B, L, 1, 1, D)
    idx = mx.random.randint(0, 6, (2, 9, 3))  # top-3 of 6 experts, repeats included
    ref_x, ref_idx = (x, idx) if not sort else _gather_sort(x, idx)[:2]
    ref = layer(ref_x, ref_idx, sorted_indices=sort)
    new = CpuTiledSwitchLinear.from_quantized(layer)
    got = new(ref_x, ref_idx, sorted_indices=sort)
    assert got.shape == ref.shape
    err = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
    assert err < 2e-3, err
    if sort:  # and the unsorting SwitchGLU does next gives the caller's order back
        order = _gather_sort(x, idx)[2]
        assert _scatter_unsort(got, order, idx.shape).shape == (2, 9, 3, 1, 48)
    # each row went through its own expert: routing all rows to expert 0 differs
    wrong = new(ref_x, mx.zeros_like(ref_idx), sorted_indices=sort)
    assert (mx.abs(wrong - ref).max() / mx.abs(ref).max()).item() > 0.1


def test_one_op_is_each_rows_own_expert_bit_for_bit():
    """`switch_qmm` (one node) gives each pair the bits of the tiled `qmm` of its row by its
    expert alone, however the rows group; a bad expert id poisons the output, never reads."""
    from engine.model.cpu_ext import ops
    from engine.model.cpu_ext.switch import CpuTiledSwitchLinear

    layer = _layer(False, 4, 32)
    new = CpuTiledSwitchLinear.from_quantized(layer)
    for e in range(6):  # the experts tiled in one call are each expert's own tiles
        one = ops.tile(layer["weight"][e], layer["scales"][e], layer["biases"][e], 32, 4)
        assert all(mx.array_equal(new[k][e], a).item()
                   for k, a in zip(("weight", "scales", "biases"), one, strict=True))
    x = mx.random.normal((5, 1, 1, 256), key=mx.random.key(3))
    idx = mx.array([[0, 5], [5, 5], [2, 0], [3, 1], [0, 0]], dtype=mx.int32)
    got = new(x, idx)
    assert got.shape == (5, 2, 1, 48)
    for r in range(5):
        for j in range(2):
            e = int(idx[r, j])
            one = ops.qmm(x[r, 0], new["weight"][e], new["scales"][e], new["biases"][e],
                          group_size=32, bits=4, tiled=True)
            assert mx.array_equal(got[r, j], one).item(), (r, j)
    bad = new(x, mx.array([[0, 6]] * 5, dtype=mx.int32))
    assert mx.isnan(bad).all().item()


def test_moe_model_on_the_tiled_path_equals_mlx_lm(tmp_path, default_model):
    """A 4-bit Qwen3-MoE loads with every expert on the extension, and its logits equal
    mlx-lm's own (gather_qmm) forward of the same files, loaded separately."""
    from arch_zoo import build as build_zoo
    from mlx_lm.utils import load_model as mlx_load

    from engine import load_model

    path = build_zoo(tmp_path / "moe", "qwen3_moe", default_model.path, eos=2, bits=4)
    loaded = load_model(str(path))
    kinds = {type(m).__name__ for _, m in loaded.model.named_modules() if hasattr(m, "bits")}
    assert loaded.cpu_ext and "CpuTiledSwitchLinear" in kinds, kinds
    ref, _ = mlx_load(path)
    ids = mx.array([list(range(3, 83))])  # 80 tokens x top-2: SwitchGLU sorts (>= 64)
    for piece in (ids, ids[:, :1]):
        a, b = ref(piece), loaded.model(piece)
        assert (mx.abs(a - b).max() / mx.abs(a).max()).item() < 2e-3
        assert (a.argmax(-1) == b.argmax(-1)).all().item()

"""GGUF Qwen3-MoE (``qwen3moe``): experts as 3-D tensors, written by `app.dev.gguf_writer`
and read back by `engine.model.gguf` onto mlx-lm's ``qwen3_moe``.

Oracles that are not kvchat's: mlx-lm's float model on the same random weights (F32), and
gguf-py's own dequantization of every tensor of the file (ggml's reference layouts), as
weights (Q4_K_M) and loaded into that float model (Q8_0).
"""

from __future__ import annotations

from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from app.dev import gguf_writer
from app.dev.make_model import make_model, random_model
from engine.errors import ModelLoadError
from engine.model import gguf_config, gguf_quants
from engine.model.gguf import convert, read

MOE = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
           vocab_size=512, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
           tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6,
           max_position_embeddings=4096)
# rows of 256: K-quant experts (64-wide rows fall back to Q8_0, as llama.cpp does)
WIDE = dict(MOE, hidden_size=256, moe_intermediate_size=256, head_dim=64)
# 40 tokens x top-2 = 80 expert rows: mlx-lm's SwitchGLU takes its sorted path (>= 64)
IDS = mx.array([[1, 5, 7, 100, 200, 300, 17, 42, 99, 3, 8, 120, 130, 140, 150, 160, 170,
                 180, 190, 11, 12, 13, 14, 15, 400, 410, 420, 430, 440, 450, 460, 470, 480,
                 490, 500, 21, 22, 23, 24, 25]])


def _rel(a, b) -> float:
    return (mx.abs(a - b).max() / mx.abs(a).max()).item()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{format: (config, gguf path, converted dir)}: one write and conversion each."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for fmt, config in (("F32", MOE), ("Q8_0", MOE), ("Q4_K_M", WIDE)):
        path = make_model(root / f"{fmt}.gguf", config, fmt, seed=1)
        out[fmt] = (config, path, convert(path, root / f"conv-{fmt}"))
    return out


def test_f32_file_equals_mlx_lm_float(files):
    from mlx_lm.utils import load_model

    config, _, conv = files["F32"]
    ref = random_model(config, seed=1)
    model, conv_config = load_model(conv)
    a, b = ref(IDS), model(IDS)
    assert _rel(a, b) < 1e-5
    assert {k: conv_config[k] for k in ("num_experts", "num_experts_per_tok",
                                        "moe_intermediate_size", "norm_topk_prob", "head_dim",
                                        "tie_word_embeddings", "mlp_only_layers")} == {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "head_dim": 16, "tie_word_embeddings": False,
        "mlp_only_layers": []}
    # mapping mutants change the logits: top-k weights not renormalized (llama.cpp always
    # renormalizes), or two experts' down projections swapped in the stack
    for layer in model.model.layers:
        layer.mlp.norm_topk_prob = False
    assert _rel(a, model(IDS)) > 1e-3
    model, _ = load_model(conv)
    down = model.model.layers[0].mlp.switch_mlp.down_proj
    down.weight = mx.concatenate([down.weight[1:2], down.weight[0:1], down.weight[2:]])
    assert _rel(a, model(IDS)) > 1e-3


def _ggml_float_model(config, path):
    """mlx-lm's float model holding gguf-py's dequantization of every tensor of ``path``."""
    from gguf import quants

    _, tensors = read(path)
    weights = []
    for t in tensors:
        arr = quants.dequantize(np.asarray(t.data), t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        weights.append((gguf_config.rename_tensor(t.name, "qwen3moe"),
                        mx.array(arr.reshape(shape).astype(np.float32))))
    model = random_model(config, seed=0)
    model.load_weights(weights)  # strict: every parameter, nothing else
    return model


def test_q8_0_file_equals_ggml_dequantized(files):
    """The converted model (MLX affine experts, mlx-lm's gather_qmm) computes what ggml's
    own dequantization of the file's blocks does: Q8_0 converts exactly."""
    from mlx_lm.utils import load_model

    config, path, conv = files["Q8_0"]
    kinds = {t.name: t.tensor_type.name for t in read(path)[1]}
    assert kinds["blk.1.ffn_up_exps.weight"] == "Q8_0"
    assert kinds["blk.0.ffn_gate_inp.weight"] == "F32"  # the router, as llama.cpp keeps it
    model, conv_config = load_model(conv)
    assert conv_config["quantization"]["model.layers.0.mlp.switch_mlp.up_proj"]["bits"] == 8
    assert "model.layers.0.mlp.gate" not in conv_config["quantization"]
    # float16 scales would run the activations in float16: float32 (exact) for the oracle
    model.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype == mx.float16 else p,
                          model.parameters()))
    ref = _ggml_float_model(config, path)
    assert _rel(ref(IDS), model(IDS)) < 1e-4


def test_q4_k_m_tensors_equal_ggml_dequantized(files):
    """Q4_K_M: Q4_K experts, ffn_down_exps at Q6_K on even layers (as ffn_down), router F32;
    every tensor, experts included, converts to what ggml's dequantization gives: Q4_K up to
    float16 scales, Q6_K within its 6-bit re-fit (`test_gguf_formats` bounds it per group).
    Logits are not compared here: the re-fit moves a random model's routing at some tokens."""
    config, path, conv = files["Q4_K_M"]
    _, tensors = read(path)
    kinds = {t.name: t.tensor_type.name for t in tensors}
    assert kinds["blk.1.ffn_gate_exps.weight"] == "Q4_K"
    assert kinds["blk.0.ffn_down_exps.weight"] == "Q6_K"
    assert kinds["blk.1.ffn_down_exps.weight"] == "Q4_K"
    assert kinds["blk.0.ffn_gate_inp.weight"] == "F32"
    stored = mx.load(str(conv / "model.safetensors"))
    ref = dict(tree_flatten(_ggml_float_model(config, path).parameters()))
    for t in tensors:
        name = gguf_config.rename_tensor(t.name, "qwen3moe")
        base, kind = name.removesuffix(".weight"), t.tensor_type.name
        got = stored[name] if kind == "F32" else mx.dequantize(
            stored[name], stored[f"{base}.scales"].astype(mx.float32),
            stored[f"{base}.biases"].astype(mx.float32), group_size=32,
            bits={"Q4_K": 4, "Q6_K": 6}[kind])
        assert got.shape == ref[name].shape, name
        err = _rel(ref[name], got)
        assert err < {"F32": 1e-7, "Q4_K": 1e-3, "Q6_K": 2.5e-2}[kind], (t.name, kind, err)


def test_experts_convert_one_by_one_as_matrices(files):
    """A 3-D quantized tensor's conversion is each expert's 2-D conversion, stacked."""
    _, path, conv = files["Q4_K_M"]
    stored = mx.load(str(conv / "model.safetensors"))
    tensors = {t.name: t for t in read(path)[1]}
    for gname in ("blk.0.ffn_down_exps.weight", "blk.1.ffn_up_exps.weight"):  # Q6_K, Q4_K
        t = tensors[gname]
        experts, rows, cols = (int(d) for d in reversed(t.shape.tolist()))
        raw = np.asarray(t.data).reshape(experts, -1)
        base = gguf_config.rename_tensor(gname, "qwen3moe").removesuffix(".weight")
        for e in (0, experts - 1):
            w, s, b, _ = gguf_quants.to_affine(t.tensor_type.name, raw[e], (rows, cols))
            assert np.array_equal(np.array(stored[f"{base}.weight"][e]), w)
            assert np.array_equal(np.array(stored[f"{base}.scales"][e]), s)
            assert np.array_equal(np.array(stored[f"{base}.biases"][e]), b)


def test_k_quant_moe_runs_on_the_tiled_experts(files):
    """kvchat's loader puts every converted expert, 4-bit and Q6_K's 6-bit alike, on the
    extension's tiled matmul, with mlx-lm's gather_qmm forward of the same files as oracle."""
    from mlx_lm.utils import load_model as mlx_load

    from engine import load_model
    from engine.model.cpu_ext import build, kquant, linear

    if not (build.available() and linear.tiled_enabled()):
        pytest.skip("needs the CPU extension's tiled path")
    _, _, conv = files["Q4_K_M"]
    loaded = load_model(str(conv))  # the directory a .gguf is loaded from, once converted
    experts = [(type(m).__name__, m.bits) for n, m in loaded.model.named_modules()
               if n.split(".")[-2:-1] == ["switch_mlp"] and hasattr(m, "bits")]
    assert loaded.cpu_ext and len(experts) == 6, experts
    assert {kind for kind, _ in experts} == {"CpuTiledSwitchLinear"}
    assert {bits for _, bits in experts} == {4, 6}
    # Q4_K experts keep codes and steps (`cpu_ext.kquant`), Q6_K ones float16 scales
    dtypes = {(m.bits, str(m["scales"].dtype)) for n, m in loaded.model.named_modules()
              if n.split(".")[-2:-1] == ["switch_mlp"] and hasattr(m, "bits")}
    assert dtypes == {(4, "mlx.core.uint8"), (6, "mlx.core.float16")}, dtypes
    with mock.patch.object(kquant, "load_steps", return_value={}):
        plain = load_model(str(conv))
    ref, _ = mlx_load(conv)
    for piece in (IDS, IDS[:, :1]):
        a, b = ref(piece), loaded.model(piece)
        assert _rel(a, b) < 2e-3
        assert (a.argmax(-1) == b.argmax(-1)).all().item()
        assert mx.array_equal(plain.model(piece), b).item()  # the float16 scales' bits


def test_moe_layouts_llama_cpp_cannot_hold_are_not_written(tmp_path):
    for bad in ({"norm_topk_prob": False}, {"mlp_only_layers": [0]},
                {"decoder_sparse_step": 2}):
        with pytest.raises(ValueError, match="qwen3moe"):
            gguf_writer.write_gguf(tmp_path / "x.gguf", dict(MOE, **bad), {}, {})


def test_expert_sizes_per_layer(files):
    meta, _ = read(files["F32"][1])
    meta["qwen3moe.expert_feed_forward_length"] = np.array([32, 32], np.uint32)
    assert gguf_config.model_config(meta, set(), {}, {})["moe_intermediate_size"] == 32
    meta["qwen3moe.expert_feed_forward_length"] = np.array([32, 64], np.uint32)
    with pytest.raises(ModelLoadError, match="per-layer expert sizes"):
        gguf_config.model_config(meta, set(), {}, {})


def test_other_moe_architecture_is_refused_in_one_line(tmp_path):
    import gguf

    path = tmp_path / "q2moe.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2moe")  # llama.cpp's other Qwen MoE: not mapped
    w.add_block_count(1)
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as info:
        convert(path, tmp_path / "conv")
    message = str(info.value)
    assert "GGUF architecture 'qwen2moe' is not supported" in message
    assert "qwen3moe" in message and "\n" not in message

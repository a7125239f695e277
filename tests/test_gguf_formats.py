"""GGUF block types, architectures and refusals; float checkpoints quantized at load.

Oracles that are not kvchat's: gguf-py's own dequantization (ggml's reference layouts) for
every block type, and mlx-lm's float model on the same random weights for every GGUF
architecture (written by `app.dev.gguf_writer`, read back by `engine.model.gguf`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from mlx.utils import tree_flatten, tree_map

from app.dev import gguf_writer
from app.dev.make_model import make_model, random_model
from engine.errors import ModelLoadError
from engine.model import gguf_quants
from engine.model.gguf import KQUANT_STEPS, convert, converted_dir

pytestmark = pytest.mark.subprocess  # conversions (converted_dir) run in a child process

_BASE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=512,
             tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0,
             max_position_embeddings=4096)
ARCHS = {
    "llama": dict(_BASE, model_type="llama"),
    "qwen2": dict(_BASE, model_type="qwen2"),
    "qwen3": dict(_BASE, model_type="qwen3", tie_word_embeddings=True),
    "gemma3_text": dict(_BASE, model_type="gemma3_text", head_dim=64, sliding_window=16,
                        sliding_window_pattern=2, query_pre_attn_scalar=64,
                        rope_local_base_freq=10000.0),
    "phi3": dict(_BASE, model_type="phi3", num_key_value_heads=4),
}
IDS = mx.array([[1, 5, 7, 100, 200, 300, 17, 42, 99, 3, 8, 120, 130, 140, 150, 160, 170,
                 180, 190, 11, 12, 13, 14, 15]])  # longer than gemma3's window of 16


def _matrix(seed=0, rows=32, cols=512):
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    x[:, 5] *= 20  # an outlier column, as real weights have
    return x


def _mlx_dequant(kind, blocks, shape):
    w, s, b, bits = gguf_quants.to_affine(kind, blocks, shape)
    out = mx.dequantize(mx.array(w), mx.array(s).astype(mx.float32),
                        mx.array(b).astype(mx.float32), group_size=32, bits=bits)
    return np.array(out), bits


@pytest.mark.parametrize("kind", list(gguf_quants.BLOCKS))
def test_block_types_convert_like_ggml(kind):
    x = _matrix()
    blocks = gguf_writer.encode(x, kind)
    ref = quants.dequantize(blocks, GGMLQuantizationType[kind]).reshape(x.shape)
    got, bits = _mlx_dequant(kind, blocks, x.shape)
    assert bits == {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8, "Q6_K": 6}.get(kind, 5)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    if kind == "Q6_K":  # re-quantized: 6 bits per 32, no worse than min/max over 63 steps
        step = (ref.reshape(-1, 32).max(-1) - ref.reshape(-1, 32).min(-1)) / 63
        sq = ((got - ref).reshape(-1, 32) ** 2).sum(-1)
        assert (sq <= 32 * (step * 0.5) ** 2 * (1 + 1e-2) + 1e-12).all()
        # and the half whose own step the fit took is exact: Q6_K's codes kept
        assert (np.abs(got - ref).reshape(-1, 16).max(-1) <= 1e-3 * np.abs(ref).max()).mean() > 0.4
    else:  # exact up to float16 scales (d * sc rounded to float16)
        assert err < 1e-3, err  # one code off would be >= 1/31 of the range
    # and the writer's blocks are a real fit of x (not, e.g., all zeros)
    assert np.abs(ref - x).max() / np.abs(x).max() < 0.06


def test_q4_k_codes_are_ggml_codes():
    """Q4_K -> 4-bit affine keeps ggml's codes: a wrong nibble or scale unpacking would move
    single weights by whole steps, which the float comparison above also sees; this pins the
    packed layout itself."""
    x = _matrix(seed=3, rows=16, cols=256)
    blocks = gguf_writer.encode(x, "Q4_K")
    w, s, b, _ = gguf_quants.to_affine("Q4_K", blocks, x.shape)
    codes = (w.view(np.uint8)[:, :, None] >> np.array([0, 4], np.uint8)) & 0xF
    codes = codes.reshape(16, 256).astype(np.float32)
    ref = quants.dequantize(blocks, GGMLQuantizationType.Q4_K).reshape(x.shape)
    s32 = np.repeat(s.astype(np.float32), 32, axis=1)
    b32 = np.repeat(b.astype(np.float32), 32, axis=1)
    assert np.allclose(codes * s32 + b32, ref, rtol=0, atol=np.abs(ref).max() * 1e-3)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_architecture_equals_mlx_lm_float(tmp_path, arch):
    from mlx_lm.utils import load_model

    config = ARCHS[arch]
    ref = random_model(config, seed=1)
    make_model(tmp_path / "m.gguf", config, "F32", seed=1)
    convert(tmp_path / "m.gguf", tmp_path / "conv")
    model, conv_config = load_model(tmp_path / "conv")
    a, b = ref(IDS), model(IDS)
    assert mx.allclose(a, b, atol=1e-4 * mx.abs(a).max().item()).item()
    assert conv_config["tie_word_embeddings"] == config["tie_word_embeddings"]
    # a mapping mutant: gemma3's final norm read without taking back the 1 llama.cpp adds,
    # or llama's Q rows left in GGUF's order, changes the logits
    if arch == "gemma3_text":
        model.model.norm.weight = model.model.norm.weight + 1.0
    elif arch == "llama":
        model.model.layers[0].self_attn.q_proj.weight = ref.model.layers[0].self_attn.q_proj.weight
    if arch in ("gemma3_text", "llama"):
        assert not mx.allclose(ref(IDS), model(IDS), atol=1e-2).item()


def test_q4_k_m_file_loads_on_the_tiled_path(tmp_path):
    """A Q4_K_M file (Q4_K layers, Q6_K attn_v/ffn_down/tied head) runs every matmul on the
    extension, and its logits track mlx-lm's forward of the same converted weights (and,
    coarsely, the float model they were quantized from)."""
    from mlx_lm.utils import load_model as mlx_load

    from engine import load_model
    from engine.model.cpu_ext import build

    config = dict(ARCHS["llama"], tie_word_embeddings=True, hidden_size=256,
                  intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
    make_model(tmp_path / "m.gguf", config, "Q4_K_M", seed=2)
    loaded = load_model(str(tmp_path / "m.gguf"))
    if build.available():
        assert loaded.cpu_ext and loaded.weight_format == "q4/q6"
        kinds = {type(m).__name__ for _, m in loaded.model.named_modules() if hasattr(m, "bits")}
        assert kinds <= {"CpuTiledLinear", "CpuTiledEmbedding", "CpuQuantizedLinear",
                         "CpuQuantizedEmbedding"}, kinds
        _two_op_layers_with_qkv_apart(loaded)
        _k_quant_codes_kept(loaded, tmp_path / "m.gguf")
    same, _ = mlx_load(loaded.path)
    a, b = same(IDS), loaded.model(IDS)
    assert (mx.abs(a - b).max() / mx.abs(a).max()).item() < 1e-2
    floats = random_model(dict(config, vocab_size=512), seed=2)(IDS)
    assert (mx.abs(a - floats).mean() / mx.abs(floats).mean()).item() < 0.5


def _k_quant_codes_kept(loaded, path):
    """Its Q4_K linears keep codes and steps (`cpu_ext.kquant`), Q6_K ones float16, and the
    logits are the bits of the same file loaded with float16 scales throughout."""
    from unittest import mock

    from engine import load_model
    from engine.model.cpu_ext import kquant

    dtypes = [str(m["scales"].dtype) for _, m in loaded.model.named_modules()
              if type(m).__name__ == "CpuTiledLinear"]
    assert "mlx.core.uint8" in dtypes and "mlx.core.float16" in dtypes, dtypes
    with mock.patch.object(kquant, "load_steps", return_value={}):
        plain = load_model(str(path))
    assert plain.weight_bytes > loaded.weight_bytes
    assert mx.array_equal(plain.model(IDS), loaded.model(IDS)).item()
    steps = loaded.path / KQUANT_STEPS  # damaged: the load keeps float16 scales, same bits
    steps.write_bytes(steps.read_bytes()[: steps.stat().st_size // 2])
    damaged = load_model(str(path))
    assert damaged.weight_bytes == plain.weight_bytes
    assert mx.array_equal(damaged.model(IDS), loaded.model(IDS)).item()


def _two_op_layers_with_qkv_apart(loaded):
    """Every layer of a Q4_K_M file takes the extension's two ops, also those whose v is
    8-bit beside 4-bit q and k (three products in one head op), with logits bit-identical
    to the separate ops."""
    from engine import Engine, EngineConfig
    from engine.executor import build_batch

    cfg = EngineConfig(kv_budget_bytes=8 << 20, prefix_cache=False)
    two, separate = Engine(loaded, cfg), Engine(loaded, cfg)
    try:
        assert all(x is not None for x in two.runner.ext)
        assert any(len(x.qkv) == 3 for x in two.runner.ext)  # Q6_K attn_v: q, k, v apart
        separate.runner.ext = [None] * len(separate.runner.ext)
        ids = IDS[0].tolist()
        out = []
        for eng in (two, separate):
            eng.blocks.allocate(1)
            logits = []
            for tokens in (ids, [7]):  # a prefill chunk, then a decode
                plan = eng.blocks.append(1, len(tokens))
                batch = build_batch(eng.blocks, [1], mx.array([tokens], dtype=mx.int32),
                                    [plan.slots])
                logits.append(eng.runner(batch, eng.kv).astype(mx.float32))
            eng.blocks.free(1)
            out.append(logits)
        for a, b in zip(*out, strict=True):
            assert mx.array_equal(a, b).item()
    finally:
        two.shutdown()
        separate.shutdown()


def _write_raw(path, tensors, arch="llama", vocab_from=None):
    """A GGUF whose tensors are given as (name, ggml type, numpy data) raw."""
    import gguf

    from app.dev.make_model import tokenizer_meta

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", 256),
                       ("feed_forward_length", 256), ("attention.head_count", 4)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    gguf_writer._add_tokenizer(w, tokenizer_meta(512))
    for name, kind, data in tensors:
        w.add_tensor(name, data, raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_block_type_is_refused_in_one_line(tmp_path):
    q2k = np.zeros((512, 256 // 256 * 84), np.uint8)  # Q2_K: 84 bytes per 256 weights
    bad = _write_raw(tmp_path / "q2k.gguf", [("token_embd.weight", "Q2_K", q2k)])
    with pytest.raises(ModelLoadError) as info:
        converted_dir(bad, root=tmp_path / "models")
    message = str(info.value)
    assert "token_embd.weight is Q2_K" in message and "Q4_K" in message
    assert "\n" not in message


def test_unsupported_architecture_is_refused_in_one_line(tmp_path, kvchat_cli):
    f32 = np.zeros((512, 256), np.float32)
    bad = _write_raw(tmp_path / "mamba.gguf", [("token_embd.weight", "F32", f32)], arch="mamba")
    status, out, err = kvchat_cli("generate", "--model", str(bad), "--prompt", "hi")
    assert status == 2 and out == ""
    assert err.strip().count("\n") == 0 and "GGUF architecture 'mamba' is not supported" in err


def test_float16_checkpoint_quantized_at_load(tmp_path):
    """``--weights q8`` on a float16 model: every linear quantized, norms float32, said in
    the weight format; the logits stay close to the float model's."""
    from engine import load_model
    from engine.model.cpu_ext import build

    config = dict(ARCHS["qwen3"], hidden_size=256, intermediate_size=512)
    path = make_model(tmp_path / "f16", config, "float16", seed=4)
    loaded = load_model(str(path), weights="q8")
    assert loaded.weight_format == "q8 from float16"
    assert loaded.cpu_ext == build.available()
    norms = [v.dtype for k, v in _flat(loaded.model) if k.endswith("norm.weight")]
    assert norms and all(d == mx.float32 for d in norms)
    floats = load_model(str(path), weights="float32")
    assert loaded.fingerprint != floats.fingerprint  # other weights: cached K/V must not mix
    a, b = floats.model(IDS), loaded.model(IDS)
    assert (a.argmax(-1) == b.argmax(-1)).mean().item() >= 0.9


def _flat(model):
    return tree_flatten(model.parameters())


def test_make_model_cli_writes_a_gguf_that_loads(tmp_path, kvchat_cli):
    out = tmp_path / "tiny.gguf"
    status, stdout, err = kvchat_cli(
        "dev", "make-model", str(out), "--set", "model_type=qwen2", "--set", "hidden_size=64",
        "--set", "num_hidden_layers=1", "--set", "intermediate_size=128",
        "--set", "num_attention_heads=2", "--set", "num_key_value_heads=1",
        "--set", "vocab_size=512", "--format", "Q4_0")
    assert status == 0, err
    assert stdout.strip() == str(out) and out.read_bytes()[:4] == b"GGUF"
    status, _, err = kvchat_cli("dev", "make-model", str(out), "--preset", "llama-1b")
    assert status == 2 and "exists" in err


def test_mlx_community_layout_runs_with_float32_norms(tmp_path):
    """A 4-bit checkpoint as mlx-community writes it (bfloat16 scales and norms): on the
    extension its norms become float32 (bfloat16 activations are MLX's slow CPU path) and
    the logits follow mlx-lm's own forward of the same files."""
    from mlx_lm.utils import load_model as mlx_load

    from engine import load_model
    from engine.model.cpu_ext import build

    config = dict(ARCHS["qwen3"], hidden_size=256, intermediate_size=512)
    path = make_model(tmp_path / "q4", config, "q4", seed=5)
    ref, _ = mlx_load(path)
    assert ref.model.norm.weight.dtype == mx.bfloat16
    loaded = load_model(str(path))
    if not build.available():
        pytest.skip("needs the CPU extension")
    assert loaded.cpu_ext
    norms = [v.dtype for k, v in _flat(loaded.model) if k.endswith("norm.weight")]
    assert norms and all(d == mx.float32 for d in norms)
    bf16 = ref(IDS).astype(mx.float32)
    # the oracle: mlx-lm's forward of the same files with every float in float32 (bfloat16
    # scales and norms are exact in float32; only the activations' precision changes)
    ref.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating)
                        else p, ref.parameters()))
    a, b = ref(IDS), loaded.model(IDS)
    err = (mx.abs(a - b).max() / mx.abs(a).max()).item()
    err_bf16 = (mx.abs(a - bf16).max() / mx.abs(a).max()).item()
    assert err < 3e-2 and err < err_bf16, (err, err_bf16)  # closer than mlx-lm's bfloat16
    assert (a.argmax(-1) == b.argmax(-1)).mean().item() >= 0.9

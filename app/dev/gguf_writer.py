"""Write an mlx-lm model's float weights as a GGUF file, as llama.cpp's converter would.

For test and benchmark models (no downloads): the inverse of `engine.model.gguf`'s reading
(llama's Q/K permutation for interleaved RoPE, gemma3's 1 + w norms, qwen3moe's experts as
one 3-D tensor each and its router in F32), metadata under llama.cpp's keys, and blocks of
the common types. Q4_0/Q8_0 blocks come from gguf-py;
gguf-py has no K-quant encoder, so `encode_q4_k`/`encode_q5_k`/`encode_q6_k` here write
llama.cpp's block layouts with a plain min/max fit (llama.cpp's quantizer searches scales
more carefully; the layout is what matters for a reader).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.model import gguf_config

QK_K = 256
# file type -> (per-tensor type of 2-D weights, type of the tied/untied output head)
FILE_TYPES = {
    "F32": ("F32", "F32"), "F16": ("F16", "F16"), "BF16": ("BF16", "BF16"),
    "Q8_0": ("Q8_0", "Q8_0"), "Q4_0": ("Q4_0", "Q6_K"), "Q4_K_M": ("Q4_K", "Q6_K"),
    "Q5_K_M": ("Q5_K", "Q6_K"), "Q6_K": ("Q6_K", "Q6_K"),
}
# Q4_K_M / Q5_K_M keep these at Q6_K (llama.cpp does so for attn_v and ffn_down on about
# half the layers; here every other layer).
_MIXED_UP = ("attn_v", "ffn_down")


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(nb, 8) 6-bit scales and mins -> Q4_K/Q5_K's 12 bytes (inverse of get_scale_min_k4)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def _k_fit(x: np.ndarray, levels: int):
    """Super-blocks (nb, 256) -> codes (nb, 8, 32), d, dmin (nb,), 6-bit sc, mn (nb, 8)."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    step = (sub.max(-1) - lo) / levels
    d = step.max(-1) / 63
    dmin = (-lo).max(-1) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(
        np.float32)
    sc = np.clip(np.rint(step / np.where(d16 == 0, 1, d16)[:, None]), 0, 63)
    mn = np.clip(np.rint(-lo / np.where(dmin16 == 0, 1, dmin16)[:, None]), 0, 63)
    scale = (d16[:, None] * sc)[..., None]
    q = np.clip(np.rint((sub + (dmin16[:, None] * mn)[..., None]) / np.where(scale == 0, 1,
                                                                                  scale)),
                0, levels).astype(np.uint8)
    return q, d16, dmin16, sc, mn


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """float (n * 256,) -> Q4_K blocks (n, 144) uint8."""
    q, d, dmin, sc, mn = _k_fit(x.astype(np.float32), 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qs], 1)


def encode_q5_k(x: np.ndarray) -> np.ndarray:
    """float (n * 256,) -> Q5_K blocks (n, 176) uint8."""
    q, d, dmin, sc, mn = _k_fit(x.astype(np.float32), 31)
    low = q & 0xF
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for s in range(8):
        qh |= ((q[:, s] >> 4) & 1) << s
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qh, qs],
                          1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """float (n * 256,) -> Q6_K blocks (n, 210) uint8."""
    sub = x.astype(np.float32).reshape(-1, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(step / np.where(d == 0, 1, d)[:, None]), 0, 127)
    scale = (d[:, None] * sc)[..., None]
    q = (np.clip(np.rint(sub / np.where(scale == 0, 1, scale)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # (nb, half, quarter, l)
    ql = np.concatenate([q[:, :, 0] & 0xF | ((q[:, :, 2] & 0xF) << 4),
                         q[:, :, 1] & 0xF | ((q[:, :, 3] & 0xF) << 4)], axis=2)  # (nb, 2, 64)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6))  # (nb, 2, 32)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                           sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], 1)


_ENCODERS = {"Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k}


def encode(x: np.ndarray, kind: str) -> np.ndarray:
    """A float matrix (rows, cols) as ``kind`` blocks: (rows, bytes per row) uint8, or the
    float array itself for F32/F16 (BF16 as uint16 bits)."""
    from gguf import GGMLQuantizationType, quants

    x = np.ascontiguousarray(x, dtype=np.float32)
    if kind == "F32":
        return x
    if kind == "F16":
        return x.astype(np.float16)
    if kind == "BF16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation is enough for tests
    if kind in _ENCODERS:
        rows = x.shape[0]
        return _ENCODERS[kind](x.reshape(-1)).reshape(rows, -1)
    return quants.quantize(x, GGMLQuantizationType[kind])


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for interleaved RoPE (convert_hf_to_gguf)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def gguf_name(name: str, arch: str) -> str:
    """mlx-lm parameter name -> llama.cpp tensor name: `gguf_config`'s reading tables
    inverted, so writer and reader cannot disagree."""
    module, suffix = name.rsplit(".", 1)
    top = {hf: g for g, hf in gguf_config.TOP_NAMES.items()}
    if module in top:
        return f"{top[module]}.{suffix}"
    parts = module.split(".")  # model.layers.N.<module path>
    layers = {hf: g for g, hf in gguf_config.LAYER_NAMES[arch].items()}
    return f"blk.{parts[2]}.{layers['.'.join(parts[3:])]}.{suffix}"


_ARCH = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe"}  # mlx-lm -> llama.cpp


def _check_moe(config: dict) -> None:
    """llama.cpp's qwen3moe: experts in every layer, top-k weights always renormalized."""
    if (config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers")
            or not config.get("norm_topk_prob", True)):
        raise ValueError("GGUF qwen3moe holds experts in every layer with normalized top-k "
                         "weights (decoder_sparse_step=1, mlp_only_layers=[], "
                         "norm_topk_prob=true)")


def _tensor_kind(gname: str, arch_kind: tuple[str, str], layer: int | None) -> str:
    main, head = arch_kind
    if gname in ("output.weight", "token_embd.weight"):
        return head
    if main in ("Q4_K", "Q5_K") and any(p in gname for p in _MIXED_UP) and layer % 2 == 0:
        return "Q6_K"
    return main


def write_gguf(path: Path, config: dict, params: dict, tokenizer_meta: dict, *,
               file_type: str = "F16", name: str = "kvchat-random") -> Path:
    """Write ``params`` (mlx-lm names -> float numpy arrays) of an mlx-lm model with
    ``config`` as a GGUF file of ``file_type`` (a key of `FILE_TYPES`).

    ``tokenizer_meta`` holds the ``tokenizer.*`` metadata to copy (e.g. the default model's).
    Supported ``model_type``: llama, qwen2, qwen3, gemma3_text, phi3, qwen3_moe.
    """
    import gguf

    arch = _ARCH.get(config["model_type"], config["model_type"])
    if arch not in gguf_config.ARCHITECTURES:
        raise ValueError(f"no GGUF writer for {config['model_type']}")
    if arch == "qwen3moe":
        _check_moe(config)
    kinds = FILE_TYPES[file_type]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads")
    kv = kv or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config.get("max_position_embeddings", 4096))
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    if arch == "gemma3":
        w.add_sliding_window(config["sliding_window"])
        w.add_uint32("gemma3.attention.sliding_window_pattern",
                     config.get("sliding_window_pattern", 6))
        w.add_float32("gemma3.rope.freq_base_swa", config.get("rope_local_base_freq", 1e4))
    if arch == "qwen3moe":
        w.add_expert_count(config["num_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    _add_tokenizer(w, tokenizer_meta)
    for pname, value in params.items():
        gname = gguf_name(pname, arch)
        value = np.asarray(value, dtype=np.float32)
        if arch == "llama" and pname.endswith("q_proj.weight"):
            value = _permute(value, heads)
        elif arch == "llama" and pname.endswith("k_proj.weight"):
            value = _permute(value, kv)
        if gguf_config.is_norm(arch, gname):
            value = value + 1.0
        layer = int(gname.split(".")[1]) if gname.startswith("blk.") else None
        # 1-D tensors and the experts' router stay F32, as llama.cpp's converter keeps them
        kind = (_tensor_kind(gname, kinds, layer)
                if value.ndim in (2, 3) and "ffn_gate_inp" not in gname else "F32")
        if kind in _ENCODERS and value.shape[-1] % QK_K:
            kind = "Q8_0"  # as llama.cpp falls back for rows not in whole super-blocks
        # experts (n, rows, columns): each row's blocks as in a 2-D matrix
        data = encode(value.reshape(-1, value.shape[-1]) if value.ndim == 3 else value, kind)
        data = data.reshape(*value.shape[:-1], -1) if value.ndim == 3 else data
        if kind == "BF16":
            data = data.view(np.uint8)
        qtype = gguf.GGMLQuantizationType[kind]
        w.add_tensor(gname, data, raw_dtype=qtype if kind not in ("F32", "F16") else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tokenizer(w, meta: dict) -> None:
    """The ``tokenizer.ggml.*`` keys (and chat template) of ``meta`` (as `engine.model.gguf.read`
    gives them)."""
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(list(meta["tokenizer.ggml.tokens"]))
    w.add_token_types([int(t) for t in meta["tokenizer.ggml.token_type"]])
    if "tokenizer.ggml.merges" in meta:
        w.add_token_merges(list(meta["tokenizer.ggml.merges"]))
    if "tokenizer.ggml.scores" in meta:
        w.add_token_scores([float(x) for x in meta["tokenizer.ggml.scores"]])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("padding_token_id", w.add_pad_token_id),
                     ("unknown_token_id", w.add_unk_token_id)):
        if f"tokenizer.ggml.{key}" in meta:
            add(int(meta[f"tokenizer.ggml.{key}"]))
    if "tokenizer.ggml.add_bos_token" in meta:
        w.add_add_bos_token(bool(meta["tokenizer.ggml.add_bos_token"]))
    if "tokenizer.chat_template" in meta:
        w.add_chat_template(meta["tokenizer.chat_template"])

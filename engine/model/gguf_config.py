"""GGUF architectures onto mlx-lm's modules: tensor names and config.json per architecture.

llama.cpp's converter changes some tensors on the way in, and this undoes it:
- llama: Q/K rows permuted for interleaved RoPE -> ``rope_traditional`` (the others keep
  Hugging Face's layout: NEOX RoPE, mlx-lm's default);
- gemma3: RMSNorm weights stored as 1 + w -> w again (mlx-lm's Gemma norm adds the 1);
- llama 3.x: ``rope_scaling`` written as a ``rope_freqs`` tensor of per-frequency factors ->
  the llama3 parameters that give exactly those factors (or a refusal);
- phi3 long-RoPE: ``rope_factors_long/short`` tensors -> ``rope_scaling`` lists;
- qwen3moe: experts stacked (experts, rows, columns) as mlx-lm's ``switch_mlp``, router
  ``ffn_gate_inp`` as ``mlp.gate``; top-k weights renormalized, as llama.cpp always does.
"""

from __future__ import annotations

import re

import numpy as np

from engine.errors import ModelLoadError

_COMMON = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
LAYER_NAMES = {
    "llama": _COMMON,
    "qwen2": _COMMON,
    "qwen3": {**_COMMON, **_QK_NORM},
    "gemma3": {**_COMMON, **_QK_NORM, "ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {**_COMMON, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # llama.cpp's qwen3moe has experts in every layer (no dense ffn_gate/up/down)
    "qwen3moe": {**{k: v for k, v in _COMMON.items() if not k.startswith("ffn_")},
                 "ffn_norm": "post_attention_layernorm", **_QK_NORM,
                 "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
                 "ffn_up_exps": "mlp.switch_mlp.up_proj",
                 "ffn_down_exps": "mlp.switch_mlp.down_proj"},
}
ARCHITECTURES = tuple(LAYER_NAMES)
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
               "phi3": "Phi3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors that carry configuration, not weights (read into config.json, not saved).
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|bias)$")
# Llama 3.x rope_scaling as shipped (3.1: factor 8, 3.2: factor 32); others are refused.
_LLAMA3_SCALINGS = [{"rope_type": "llama3", "factor": f, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
                    for f in (8.0, 32.0, 16.0, 4.0)]


def check_architecture(arch) -> str:
    """The GGUF ``general.architecture`` if kvchat maps it, else a one-line refusal."""
    if arch not in LAYER_NAMES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
    return arch


def rename_tensor(name: str, arch: str = "llama") -> str:
    """Map a GGUF tensor name to the Hugging Face / mlx-lm name (``.weight``/``.bias``)."""
    layers = LAYER_NAMES[arch]
    if m := _BLOCK.match(name):
        layer, part, suffix = m.groups()
        if part not in layers:
            raise ModelLoadError(f"unsupported GGUF tensor {name!r} for {arch}")
        return f"model.layers.{layer}.{layers[part]}.{suffix}"
    if (m := _TOP.match(name)) and m.group(1) in TOP_NAMES:
        return f"{TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(f"unsupported GGUF tensor {name!r}")


def is_norm(arch: str, name: str) -> bool:
    """Whether GGUF tensor ``name`` is a norm weight llama.cpp stored as 1 + w (gemma3)."""
    return arch == "gemma3" and name.endswith("norm.weight")


def scalar(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}")
    return value.item() if hasattr(value, "item") else value


def _llama3_scaling(factors: np.ndarray, head_dim: int, base: float) -> dict:
    """The llama3 ``rope_scaling`` whose frequencies are base's times ``factors``."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    plain = base ** (np.arange(0, head_dim, 2) / head_dim)
    for scaling in _LLAMA3_SCALINGS:
        freqs = np.array(Llama3RoPE(head_dim, base=base, scaling_config=scaling)._freqs)
        if freqs.shape == factors.shape and np.allclose(freqs / plain, factors, rtol=1e-3):
            return scaling
    raise ModelLoadError("GGUF rope_freqs do not match a Llama 3 rope_scaling kvchat knows")


def _moe_config(meta: dict, intermediate: int) -> dict:
    """mlx-lm's qwen3_moe fields. llama.cpp's qwen3moe graph has experts in every layer,
    softmax routing and the top-k weights always renormalized (it reads no
    ``expert_weights_norm``/``_scale`` for it), so those are fixed here too."""
    experts = int(scalar(meta, "qwen3moe.expert_count"))
    used = int(scalar(meta, "qwen3moe.expert_used_count"))
    # one size, or one per layer (llama.cpp reads either): kvchat needs them all equal
    ff_exp = np.asarray(meta.get("qwen3moe.expert_feed_forward_length",
                                 intermediate // max(used, 1))).reshape(-1)
    if ff_exp.size == 0 or (ff_exp != ff_exp[0]).any():
        raise ModelLoadError("GGUF qwen3moe with per-layer expert sizes is not supported")
    return {"model_type": "qwen3_moe", "num_experts": experts, "num_experts_per_tok": used,
            "moe_intermediate_size": int(ff_exp[0]), "decoder_sparse_step": 1,
            "mlp_only_layers": [], "norm_topk_prob": True}


def model_config(meta: dict, weights, quantization: dict, extra: dict) -> dict:
    """mlx-lm config.json for GGUF metadata ``meta``, the renamed tensors' names (``weights``,
    a set or a dict; to tell tied
    heads and biases) and the per-layer ``quantization``; ``extra`` holds the tensors of
    `CONFIG_TENSORS` as numpy arrays."""
    arch = check_architecture(meta.get("general.architecture"))

    def key(name, default=None):
        return scalar(meta, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // heads)))
    base = float(key("rope.freq_base", 10000.0))
    tokens = meta["tokenizer.ggml.tokens"]
    config = {
        "model_type": arch,
        "architectures": [_HF_CLASSES[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": base,
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": len(tokens),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": int(scalar(meta, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(scalar(meta, "tokenizer.ggml.eos_token_id")),
    }
    if arch == "llama":
        config["rope_traditional"] = True  # the converter permuted Q/K for it
        if "rope_freqs.weight" in extra:
            config["rope_scaling"] = _llama3_scaling(extra["rope_freqs.weight"].reshape(-1),
                                                     head_dim, base)
    elif arch == "gemma3":
        config["model_type"] = "gemma3_text"
        window = int(key("attention.sliding_window", 0))
        config.update(
            sliding_window=window or config["max_position_embeddings"],
            sliding_window_pattern=int(key("attention.sliding_window_pattern", 6)) if window
            else 1,
            rope_local_base_freq=float(key("rope.freq_base_swa", 10000.0)),
            # llama.cpp: 1/sqrt(head_dim), except Gemma 3 27B (62 layers): hidden / heads
            query_pre_attn_scalar=hidden // heads if config["num_hidden_layers"] == 62
            else head_dim)
        if str(key("rope.scaling.type", "none")) == "linear":
            config["rope_scaling"] = {"rope_type": "linear",
                                      "factor": float(key("rope.scaling.factor"))}
    elif arch == "phi3":
        del config["head_dim"]
        if "rope_factors_long.weight" in extra:
            config["rope_scaling"] = {
                "type": "longrope",
                "long_factor": extra["rope_factors_long.weight"].reshape(-1).tolist(),
                "short_factor": extra["rope_factors_short.weight"].reshape(-1).tolist()}
            config["original_max_position_embeddings"] = int(
                key("rope.scaling.original_context_length"))
    elif arch == "qwen3moe":
        config.update(_moe_config(meta, config["intermediate_size"]))
    if quantization:
        config["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine",
                                  **quantization}
    return config

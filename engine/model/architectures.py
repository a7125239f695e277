"""The architectures the paged engine runs, how it runs each, and why it refuses the rest.

Two paths, both on mlx-lm's own modules (projections, norms, RoPE variants, MLPs, experts,
weight sanitizing); kvchat owns only attention over the pool:

- ``fused``: llama-family blocks (pre-norm attention + SwiGLU MLP). The runner calls the
  projections itself, q/k/v and gate/up fused (`fused.py`): the fast path on CPU.
- ``modules``: every other block runs its own mlx-lm ``__call__`` with a `LayerStep` as
  its cache (`layer_step.py`), so residual layouts, q/k norms, NoPE layers, soft-capping,
  expert routing and scalings are mlx-lm's by construction.

Sliding windows are read from the model's own ``make_cache`` (a ``RotatingKVCache`` of
size W is a window of W), the same caches mlx-lm's generation uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

Hook = Callable[[Any, mx.array], mx.array]  # (model args, array) -> array


@dataclass(frozen=True)
class Architecture:
    """How one mlx-lm ``model_type`` runs through the paged runner."""

    model_type: str
    path: str  # "fused" or "modules"
    embed_scale: Hook | None = None  # applied to the token embeddings
    logits_scale: Hook | None = None  # applied to the logits
    # (args, layer, h, step) -> h; None: ``layer(h, None, step)`` as mlx-lm's loops call it
    call: Callable[[Any, nn.Module, mx.array, Any], mx.array] | None = None


def _gemma_embed(args, h):
    # Gemma rounds the scale to bfloat16 before scaling, whatever the weights' dtype.
    return h * mx.array(args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)


def _llama4_scaled_call(args, layer, h, step):
    # Ministral 3 scales queries by position (Llama-4 style); mlx-lm computes it once per
    # forward from the first cache's offset, here from each row's own offset.
    from mlx_lm.models.ministral3 import _get_llama_4_attn_scale

    rope = args.rope_parameters
    scale = _get_llama_4_attn_scale(h.shape[1], step.offset, rope["llama_4_scaling_beta"],
                                    rope["original_max_position_embeddings"]).astype(h.dtype)
    return layer(h, scale, None, cache=step)


_ARCHS = [  # what each uses is the README's table ("The models it runs")
    Architecture("llama", "fused"),
    Architecture("mistral", "fused"),
    Architecture("qwen2", "fused"),
    Architecture("qwen3", "fused"),
    Architecture("smollm3", "fused"),
    Architecture("phi3", "modules"),
    Architecture("granite", "modules", embed_scale=lambda a, h: h * a.embedding_multiplier,
                 logits_scale=lambda a, x: x / a.logits_scaling),
    Architecture("gemma3_text", "modules", embed_scale=_gemma_embed),
    Architecture("gpt_oss", "modules"),
    Architecture("olmo3", "modules"),
    Architecture("cohere2", "modules", logits_scale=lambda a, x: x * a.logit_scale),
    Architecture("exaone4", "modules"),
    Architecture("ministral3", "modules", call=_llama4_scaled_call),
    Architecture("mixtral", "modules"),
    Architecture("qwen3_moe", "modules"),
    Architecture("olmoe", "modules"),
    Architecture("glm4_moe", "modules"),
]
ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in _ARCHS}
# Multimodal checkpoints whose text model runs alone (vision weights are dropped by sanitize).
TEXT_WRAPPERS = {"mistral3"}

_STATE = ("keeps recurrent state (state-space or linear-attention layers) beside its KV "
          "cache; the pool pages only K/V, so prefix reuse and preemption could not restore it")
_MLA = ("uses multi-head latent attention (one compressed latent per token plus a shared "
        "RoPE key), which the pool's per-head K/V layout does not hold")
REFUSED: dict[str, str] = {
    **dict.fromkeys(("qwen3_5", "qwen3_5_moe", "qwen3_next", "granitemoehybrid", "lfm2",
                     "lfm2_moe", "nemotron_h", "jamba", "mamba", "mamba2", "falcon_h1",
                     "recurrent_gemma", "rwkv7", "plamo2", "kimi_linear", "minimax"), _STATE),
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25",
                     "minicpm3", "mistral4", "glm4_moe_lite"), _MLA),
    **dict.fromkeys(("gemma4", "gemma4_text", "gemma3n"), (
        "shares K/V across layers and gives its global layers other head sizes than its "
        "sliding ones; the pool holds one head layout for every layer")),
}


def text_model_type(config: dict) -> str:
    """The model_type whose layers run: a text wrapper's inner one."""
    model_type = str(config.get("model_type", "?"))
    if model_type in TEXT_WRAPPERS:
        return str((config.get("text_config") or {}).get("model_type", "llama"))
    return model_type


def check_supported(config: dict) -> Architecture:
    """The architecture of ``config``, or ValueError saying in one line why not."""
    model_type = str(config.get("model_type", "?"))
    inner = text_model_type(config)
    for name in (model_type, inner):
        if name in REFUSED:
            raise ValueError(f"model type {name!r} is not supported: it {REFUSED[name]}")
    if inner not in ARCHITECTURES:
        raise ValueError(f"model type {model_type!r} is not supported yet "
                         f"(supported: {', '.join(supported_types())})")
    return ARCHITECTURES[inner]


def supported_types() -> list[str]:
    return [*ARCHITECTURES, *sorted(TEXT_WRAPPERS)]


def text_model(model: nn.Module) -> nn.Module:
    """The module holding ``.model`` (embeddings, layers, norm) and the LM head."""
    return getattr(model, "language_model", model)


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each layer's sliding window (None: global), from the caches mlx-lm would use; a
    cache that is not K/V is refused with the reason."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    windows = []
    for cache in make_prompt_cache(model):
        if type(cache) is KVCache:
            windows.append(None)
        elif type(cache) is RotatingKVCache and cache.keep == 0:
            windows.append(int(cache.max_size))
        else:
            raise ValueError(f"the model keeps {type(cache).__name__} state in some layers; "
                             "the paged pool holds only K/V")
    return windows


def num_experts(args) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def summary(config: dict) -> str:
    """What a checkpoint's config.json says it is, in a few words, without loading it:
    its architecture and what it uses (windows, sinks, experts), or why it cannot run."""
    try:
        arch = check_supported(config)
    except ValueError as e:
        why = str(e).split(": it ", 1)
        reason = f" ({why[1]})" if len(why) == 2 else " yet"
        return f"{config.get('model_type', '?')}: not supported{reason}"
    text = config.get("text_config") or config
    parts = [arch.model_type]
    if text.get("num_hidden_layers"):
        parts.append(f"{text['num_hidden_layers']} layers")
    kinds = text.get("layer_types") or []
    window = text.get("sliding_window")
    if window and ("sliding_attention" in kinds or text.get("sliding_window_pattern")):
        parts.append(f"sliding window {window}")
    if arch.model_type == "gpt_oss":
        parts.append("attention sinks")
    experts = next((text[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if text.get(k)), 0)
    if experts:
        parts.append(f"{experts} experts")
    return ", ".join(parts)


def describe(model) -> str:
    """A `PagedModel` in a few words: type, layers, heads, windows, sinks, experts."""
    n = len(model.layers)
    windowed = [w for w in model.windows if w]
    parts = [f"{model.arch.model_type}, {n} layers, {model.num_heads}/{model.num_kv_heads} "
             f"heads of {model.head_dim}"]
    if windowed:
        parts.append(f"{len(windowed)} sliding (window {max(windowed)}) + "
                     f"{n - len(windowed)} global")
    if any(getattr(layer.self_attn, "sinks", None) is not None for layer in model.layers):
        parts.append("attention sinks")
    experts = num_experts(model.args)
    if experts:
        parts.append(f"{experts} experts, {model.args.num_experts_per_tok} per token")
    return "; ".join(parts)


def _first(*values):
    return next((v for v in values if v), None)


def head_layout(attn, args) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a layer's attention module and the model args,
    wherever the architecture keeps them."""
    heads = _first(getattr(attn, "n_heads", None), getattr(attn, "num_attention_heads", None),
                   args.num_attention_heads)
    kv_heads = _first(getattr(attn, "n_kv_heads", None),
                      getattr(attn, "num_key_value_heads", None),
                      getattr(args, "num_key_value_heads", None), heads)
    head_dim = _first(getattr(args, "head_dim", None), getattr(attn, "head_dim", None),
                      args.hidden_size // args.num_attention_heads)
    return heads, kv_heads, head_dim

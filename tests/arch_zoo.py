"""Tiny random-weight models of every architecture the paged runner lists (no downloads).

Each config keeps the real head layout of its family (GQA ratios, head_dim 64/128/256
where the family uses them, window patterns, sinks, experts) at 2-4 layers and a small
vocabulary; `build` saves one as a model directory the loader reads like any checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from app.dev.make_model import save_random_model

VOCAB = 512
WINDOW = 16  # shorter than the parity prompts, so windows are crossed
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}

_BASE = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
             max_position_embeddings=4096, tie_word_embeddings=False)

ZOO: dict[str, dict] = {
    "llama3": dict(_BASE, model_type="llama", num_hidden_layers=2, head_dim=64,
                   rope_scaling=LLAMA3_ROPE),
    "llama_sliding": dict(_BASE, model_type="llama", num_hidden_layers=3, head_dim=32,
                          layer_types=["sliding_attention", "sliding_attention",
                                       "full_attention"], sliding_window=WINDOW),
    "mistral": dict(_BASE, model_type="mistral", num_hidden_layers=2, head_dim=32),
    "smollm3": dict(_BASE, model_type="smollm3", num_hidden_layers=4, head_dim=32,
                    no_rope_layer_interval=2, tie_word_embeddings=True),
    "phi3": dict(_BASE, model_type="phi3", num_hidden_layers=2, num_key_value_heads=4),
    "granite": dict(_BASE, model_type="granite", num_hidden_layers=2, logits_scaling=4.0,
                    attention_multiplier=0.05, embedding_multiplier=6.0,
                    residual_multiplier=0.3, attention_bias=False, mlp_bias=False),
    "gemma3_text": dict(_BASE, model_type="gemma3_text", num_hidden_layers=4, head_dim=256,
                        num_attention_heads=2, num_key_value_heads=1,
                        query_pre_attn_scalar=256, sliding_window=WINDOW,
                        sliding_window_pattern=2, rope_local_base_freq=10000.0,
                        rope_theta=1e6),
    "gpt_oss": dict(_BASE, model_type="gpt_oss", num_hidden_layers=2, head_dim=64,
                    num_attention_heads=4, num_key_value_heads=1, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"], intermediate_size=64),
    "olmo3": dict(_BASE, model_type="olmo3", num_hidden_layers=4, head_dim=32,
                  sliding_window=WINDOW),
    "cohere2": dict(_BASE, model_type="cohere2", num_hidden_layers=4, head_dim=32,
                    layer_norm_eps=1e-5, logit_scale=0.25, sliding_window=WINDOW,
                    sliding_window_pattern=2),
    "exaone4": dict(_BASE, model_type="exaone4", num_hidden_layers=4, head_dim=32,
                    rope_scaling=None, sliding_window=WINDOW, sliding_window_pattern="LLLG",
                    # as EXAONE 4 checkpoints ship it (transformers reads layer_types)
                    layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "ministral3": dict(_BASE, model_type="ministral3", num_hidden_layers=3, head_dim=32,
                       sliding_window=WINDOW,
                       layer_types=["sliding_attention", "sliding_attention",
                                    "full_attention"],
                       rope_parameters={"rope_type": "yarn", "rope_theta": 1e6,
                                        "factor": 4.0, "original_max_position_embeddings": 32,
                                        "llama_4_scaling_beta": 0.1, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "mscale": 1.0,
                                        "mscale_all_dim": 1.0}),
    # a multimodal checkpoint's text model alone (Mistral 3 / Ministral 3 with vision)
    "mistral3": dict(model_type="mistral3", text_config=dict(
        _BASE, model_type="ministral3", num_hidden_layers=2, head_dim=32, vocab_size=VOCAB,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                         "original_max_position_embeddings": 64, "llama_4_scaling_beta": 0.1})),
    "mixtral": dict(_BASE, model_type="mixtral", num_hidden_layers=2, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=64),
    "qwen3_moe": dict(_BASE, model_type="qwen3_moe", num_hidden_layers=2, head_dim=128,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[], moe_intermediate_size=64, norm_topk_prob=True),
    "olmoe": dict(_BASE, model_type="olmoe", num_hidden_layers=2, num_experts=4,
                  num_experts_per_tok=2, intermediate_size=64),
    "glm4_moe": dict(_BASE, model_type="glm4_moe", num_hidden_layers=3, head_dim=32,
                     moe_intermediate_size=64, norm_topk_prob=True, n_group=2, topk_group=1,
                     n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.5,
                     num_experts_per_tok=2, first_k_dense_replace=1, use_qk_norm=True,
                     attention_bias=True, partial_rotary_factor=0.5, rope_scaling=None),
}


def build(path: Path, name: str, tokenizer_dir: Path, *, eos: int, bits: int | None = None,
          seed: int = 0, overrides: dict | None = None) -> Path:
    """``ZOO[name]`` (with ``overrides``) as a random-weight model directory."""
    config = {**ZOO[name], "vocab_size": VOCAB, "eos_token_id": eos, **(overrides or {})}
    return save_random_model(path, config, tokenizer_dir, seed=seed, bits=bits)

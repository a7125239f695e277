"""Random-weight models of real shapes, no downloads: `kvchat dev make-model`.

Any architecture mlx-lm has (its own `ModelArgs` + `Model`), any size, saved as an MLX
directory (float32/float16/bfloat16, or 4/8-bit affine at group 32/64/128) with the default
model's tokenizer, or as a GGUF file (`gguf_writer`: F32/F16/BF16, Q8_0, Q4_0, Q4_K_M,
Q5_K_M, Q6_K) for the architectures kvchat reads from GGUF. Greedy text from random weights
is meaningless: compare speed at fixed lengths, and tokens or logits against a float
reference on the same weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

# Real shapes, named by what they stand for (vocabulary: the default model's tokenizer).
PRESETS: dict[str, dict] = {
    # Llama-3.2-1B's layout at SmolLM's vocabulary (the 1B-class model)
    "llama-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16,
                     intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, rope_theta=500000.0, tie_word_embeddings=True),
    # Llama-3.2-3B's layout
    "llama-3b": dict(model_type="llama", hidden_size=3072, num_hidden_layers=28,
                     intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
                     head_dim=128, rope_theta=500000.0, tie_word_embeddings=True),
    # Qwen3-30B-A3B's expert layout (8 of 128 experts), at 8 layers and 64 experts
    "qwen3-moe": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=8,
                      intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, num_experts=64, num_experts_per_tok=8,
                      moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=True, rope_theta=1e6, tie_word_embeddings=False),
    # Gemma-3-1B's layout (5 sliding layers of 512 per global one)
    "gemma3-1b": dict(model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26,
                      intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1,
                      head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                      sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4),
}
_DEFAULTS = dict(rms_norm_eps=1e-6, max_position_embeddings=8192, vocab_size=49152)
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
MLX_FORMATS = ("float32", "float16", "bfloat16", "q4", "q8")


def random_model(config: dict, *, seed: int = 0, scale: float = 3):
    """An mlx-lm model of ``config`` with random weights; matrices are scaled by ``scale``
    so logits are peaked and greedy is meaningful."""
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    params = {k: v * scale if v.ndim >= 2 and "norm" not in k else v for k, v in params.items()}
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    return model


def save_random_model(path: Path, config: dict, tokenizer_dir: Path, *, seed: int,
                      scale: float = 3, bits: int | None = None, group_size: int = 32,
                      dtype: str = "float32") -> Path:
    """Random weights for the mlx-lm ``config`` (``dtype`` floats, or quantized to ``bits``
    at ``group_size``) saved as a model directory with ``tokenizer_dir``'s tokenizer."""
    from mlx_lm.utils import quantize_model

    model = random_model(config, seed=seed, scale=scale)
    if dtype != "float32":
        model.set_dtype(getattr(mx, dtype))
    if bits:
        model, config = quantize_model(model, config, group_size=group_size, bits=bits)
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def tokenizer_meta(vocab: int) -> dict:
    """The default model's ``tokenizer.*`` GGUF metadata cut to the first ``vocab`` tokens
    (merges whose parts and result survive)."""
    from engine.model.gguf import read
    from engine.model.loader import default_gguf_path

    meta, _ = read(default_gguf_path())
    meta = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    tokens = list(meta["tokenizer.ggml.tokens"])[:vocab]
    if len(tokens) < vocab:
        raise ValueError(f"the default tokenizer has {len(tokens)} tokens, not {vocab}")
    known = set(tokens)
    meta["tokenizer.ggml.tokens"] = tokens
    meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"])[:vocab]
    meta["tokenizer.ggml.merges"] = [
        m for m in meta["tokenizer.ggml.merges"]
        if (a := m.split(" ", 1)) and all(p in known for p in a) and "".join(a) in known]
    return meta


def make_model(out: Path, config: dict, fmt: str, *, seed: int = 0, group_size: int = 32
               ) -> Path:
    """Write a random model of ``config`` to ``out``: a directory for an MLX format
    (`MLX_FORMATS`), a ``.gguf`` file for a GGUF type (`GGUF_TYPES`)."""
    from engine.model.loader import resolve_model_path

    config = {**_DEFAULTS, **config}
    if fmt in GGUF_TYPES:
        from app.dev.gguf_writer import write_gguf

        model = random_model(config, seed=seed)
        params = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
        return write_gguf(out, config, {k: _np(v) for k, v in params.items()},
                          tokenizer_meta(config["vocab_size"]), file_type=fmt)
    if fmt not in MLX_FORMATS:
        raise ValueError(f"format must be one of {MLX_FORMATS + GGUF_TYPES}, not {fmt!r}")
    bits = {"q4": 4, "q8": 8}.get(fmt)
    # q4/q8 as mlx-community's converter writes them from a bfloat16 checkpoint: bfloat16
    # scales, biases and norms
    dtype = fmt if fmt.startswith(("float", "bfloat")) else "bfloat16"
    return save_random_model(out, config, resolve_model_path(None), seed=seed, bits=bits,
                             group_size=group_size, dtype=dtype)


def _np(a: mx.array):
    import numpy as np

    return np.array(a, copy=False)


def add_parser(sub) -> None:
    """Register ``dev`` (``dev make-model``) on the CLI's subparsers object."""
    from app import arg_types

    dev = sub.add_parser("dev", help="developer tools (random-weight models of real shapes)")
    dsub = dev.add_subparsers(dest="dev_command", required=True)
    m = dsub.add_parser("make-model", help="write a random-weight model (MLX dir or .gguf)")
    m.add_argument("out", type=Path, help="a new directory, or a .gguf file for GGUF types")
    m.add_argument("--preset", choices=sorted(PRESETS), default=None)
    m.add_argument("--config", type=Path, default=None,
                   help="an mlx-lm config.json to take the shape from (overrides the preset)")
    m.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override one config field, e.g. --set num_hidden_layers=4")
    m.add_argument("--format", default="q4", choices=MLX_FORMATS + GGUF_TYPES)
    m.add_argument("--group-size", type=int, choices=[32, 64, 128], default=32)
    m.add_argument("--seed", type=arg_types.non_negative_int, default=0)
    m.set_defaults(func=run)


def run(args) -> int:
    config = dict(PRESETS[args.preset]) if args.preset else {}
    if args.config:
        config.update(json.loads(args.config.read_text()))
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            config[key] = json.loads(value)
        except ValueError:
            config[key] = value
    if "model_type" not in config:
        raise ValueError("give --preset, --config or --set model_type=...")
    if args.out.exists():
        raise ValueError(f"{args.out} exists")
    out = make_model(args.out, config, args.format, seed=args.seed, group_size=args.group_size)
    print(out)
    return 0

"""Convert a llama-architecture GGUF file into an MLX model directory.

The directory (safetensors in MLX affine format, config.json, tokenizer.json,
tokenizer_config.json) is what `mlx_lm.load` opens, so kvchat and mlx-lm run
the very same weights. GGUF facts this relies on (see DESIGN.md):
- `mx.load` returns Q4_0/Q4_1/Q8_0 tensors already as MLX affine triples
  (weight, scales, biases) with group size 32; bits differ per tensor.
- GGUF permutes Q/K rows for interleaved RoPE, hence ``rope_traditional``.
- The tokenizer (byte-level BPE) and chat template live in the metadata.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from engine.errors import ModelLoadError
from engine.model.fingerprint import file_digest
from engine.paths import cache_root

GGUF_GROUP_SIZE = 32
CONTROL_TOKEN = 3

_LAYER_NAMES = {
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
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")

# llama.cpp's "smollm"/"gpt2"-family pre-tokenizer: single digits, then GPT-2's regex.
_PRE_TOKENIZERS_WITH_DIGITS = {"smollm", "starcoder", "refact", "codeshell", "exaone"}


def rename_tensor(name: str) -> str:
    """Map a GGUF tensor name to the Hugging Face / mlx-lm name."""
    if m := _BLOCK.match(name):
        layer, part, suffix = m.groups()
        if part not in _LAYER_NAMES:
            raise ModelLoadError(f"unsupported GGUF tensor {name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    if (m := _TOP.match(name)) and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(f"unsupported GGUF tensor {name!r}")


def _scalar(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}")
    return value.item() if hasattr(value, "item") else value


def model_config(meta: dict, weights: dict) -> dict:
    """Build an mlx-lm llama config.json from GGUF metadata and the tensors."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (only llama)")
    hidden = int(_scalar(meta, "llama.embedding_length"))
    heads = int(_scalar(meta, "llama.attention.head_count"))
    quantization: dict = {"group_size": GGUF_GROUP_SIZE, "bits": 4, "mode": "affine"}
    for name, w in weights.items():
        if name.endswith(".scales"):
            base = name[: -len(".scales")]
            in_features = w.shape[-1] * GGUF_GROUP_SIZE
            bits = weights[base + ".weight"].shape[-1] * 32 // in_features
            quantization[base] = {"group_size": GGUF_GROUP_SIZE, "bits": int(bits)}
    tokens = meta["tokenizer.ggml.tokens"]
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_scalar(meta, "llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base", 10000.0)),
        "rope_traditional": True,
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "vocab_size": len(tokens),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
    }
    if any(isinstance(v, dict) for v in quantization.values()):
        config["quantization"] = quantization
    return config


def build_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` for GGUF's byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelLoadError("only byte-level BPE ('gpt2') GGUF tokenizers are supported")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre", "gpt2") in _PRE_TOKENIZERS_WITH_DIGITS:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, ty in zip(tokens, types, strict=True) if ty == CONTROL_TOKEN]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def tokenizer_config(meta: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str, default: int | None = None) -> str | None:
        idx = meta.get(key, default)
        return None if idx is None else tokens[int(idx.item() if hasattr(idx, "item") else idx)]

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
    }
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return {k: v for k, v in cfg.items() if v is not None}


def convert(gguf_path: Path, out_dir: Path) -> Path:
    """Write the MLX model directory for ``gguf_path`` to ``out_dir`` atomically."""
    import mlx.core as mx

    try:
        raw, meta = mx.load(str(gguf_path), return_metadata=True)
    except Exception as e:  # MLX raises ValueError/RuntimeError for bad files
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {e}") from e
    weights = {rename_tensor(k): v for k, v in raw.items()}
    config = model_config(meta, weights)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        build_tokenizer(meta).save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta), indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps({"eos_token_id": config["eos_token_id"]})
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def check_header(path: Path) -> None:
    """Reject files that are not GGUF v2/v3 before any native reader sees them."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic)")
    version, num_tensors, num_kv = struct.unpack("<IQQ", head[4:])
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: unsupported GGUF version {version}")
    if num_tensors > size // 16 or num_kv > size // 8:
        raise ModelLoadError(f"{path}: corrupt GGUF header")


def converted_dir(gguf_path: Path, root: Path | None = None) -> Path:
    """The MLX directory for a GGUF file, converting it once (keyed by content hash).

    The conversion runs in a child process: MLX's native GGUF reader can crash
    (SIGSEGV) on a corrupt file, and a bad file must never take the app down.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    check_header(gguf_path)
    digest = file_digest(gguf_path)[:16]
    out = (root or cache_root() / "models") / f"{gguf_path.stem}-{digest}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [sys.executable, "-m", "engine.model.gguf", str(gguf_path), str(out)],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            detail = lines[-1] if lines else f"the GGUF reader died (status {proc.returncode})"
            raise ModelLoadError(f"cannot convert GGUF file {gguf_path}: {detail}")
    return out


if __name__ == "__main__":
    try:
        convert(Path(sys.argv[1]), Path(sys.argv[2]))
    except ModelLoadError as e:
        print(e, file=sys.stderr)
        sys.exit(2)

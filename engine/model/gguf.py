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
from engine.paths import (
    cache_root,
    is_private_tree,
    private_dir,
    remove_own,
    temp_path,
    write_private,
)

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


def _write_tree(out_dir: Path, files: dict[str, bytes], weights: dict) -> None:
    """Write the model files into a fresh private temp dir, then rename it to ``out_dir``."""
    import mlx.core as mx

    private_dir(out_dir.parent)
    tmp = temp_path(out_dir)
    os.mkdir(tmp, 0o700)
    try:
        os.chmod(tmp, 0o700)  # exact, whatever the umask
        weights_path = tmp / "model.safetensors"
        mx.save_safetensors(str(weights_path), weights, metadata={"format": "mlx"})
        os.chmod(weights_path, 0o600)  # MLX creates it per the umask; the dir keeps others out
        for name, data in files.items():
            write_private(tmp / name, data)
        if is_private_tree(out_dir, required="config.json"):
            return  # another process converted the same file meanwhile; keep what it loads
        remove_own(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise  # not just another process that converted the same file first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert(gguf_path: Path, out_dir: Path) -> Path:
    """Write the MLX model directory for ``gguf_path`` to ``out_dir`` atomically.

    The directory and every file in it are private (0700 / 0600) whatever the umask.

    Raises:
        ModelLoadError: the file is not a valid GGUF file, or not a supported model.
    """
    import mlx.core as mx

    try:
        raw, meta = mx.load(str(gguf_path), return_metadata=True)
    except Exception as e:  # MLX raises ValueError/RuntimeError for bad files
        raise ModelLoadError(f"not a valid GGUF file: {gguf_path} ({e})") from e
    if "general.architecture" not in meta or "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(f"not a valid GGUF file: {gguf_path} (no model metadata)")
    weights = {rename_tensor(k): v for k, v in raw.items()}
    config = model_config(meta, weights)
    files = {
        "config.json": json.dumps(config, indent=2),
        "tokenizer.json": build_tokenizer(meta).to_str(pretty=True),  # as .save() writes it
        "tokenizer_config.json": json.dumps(tokenizer_config(meta), indent=2),
        "generation_config.json": json.dumps({"eos_token_id": config["eos_token_id"]}),
    }
    try:
        _write_tree(out_dir, {k: v.encode() for k, v in files.items()}, weights)
    except OSError as e:
        raise ModelLoadError(f"cannot write the converted model to {out_dir}: {e}") from e
    return out_dir


def check_header(path: Path) -> None:
    """Reject files that are not GGUF v2/v3 before any native reader sees them."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise ModelLoadError(f"not a valid GGUF file: {path} (bad magic)")
    version, num_tensors, num_kv = struct.unpack("<IQQ", head[4:])
    if version not in (2, 3):
        raise ModelLoadError(f"not a valid GGUF file: {path} (unsupported version {version})")
    if num_tensors > size // 16 or num_kv > size // 8:
        raise ModelLoadError(f"not a valid GGUF file: {path} (corrupt header)")


# The child reports a ModelLoadError on one marked stderr line; anything else it prints
# (warnings, a native crash) is never taken for the reason.
_ERROR_MARK = "kvchat-gguf-error: "


def _child_code() -> str:
    # -c, not -m: the package already imports engine.model.gguf, and runpy warns about it
    # on stderr. The path goes first so the child runs this very code, whatever its cwd.
    root = str(Path(__file__).resolve().parents[2])
    return (f"import sys; sys.path.insert(0, {root!r})\n"
            "from engine.model.gguf import child_main\n"
            "sys.exit(child_main(sys.argv[1:]))\n")


def _child_failure(gguf_path: Path, proc: subprocess.CompletedProcess) -> ModelLoadError:
    for line in reversed(proc.stderr.splitlines()):
        if line.startswith(_ERROR_MARK):
            return ModelLoadError(line[len(_ERROR_MARK):])
    if proc.returncode < 0:
        reason = f"the GGUF reader crashed with signal {-proc.returncode}"
    else:
        reason = f"the converter exited with status {proc.returncode}"
    return ModelLoadError(f"not a valid GGUF file: {gguf_path} ({reason})")


def converted_dir(gguf_path: Path, root: Path | None = None) -> Path:
    """The MLX directory for a GGUF file, converting it once (keyed by content hash).

    The conversion runs in a child process: MLX's native GGUF reader can crash
    (SIGSEGV) on a corrupt file, and a bad file must never take the app down.

    Raises:
        ModelLoadError: missing or corrupt file ("not a valid GGUF file: <path> (<reason>)"),
            an unsupported model, or the converted directory cannot be written.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    check_header(gguf_path)
    digest = file_digest(gguf_path)[:16]
    out = (root or cache_root() / "models") / f"{gguf_path.stem}-{digest}"
    if not is_private_tree(out, required="config.json"):
        try:
            private_dir(out.parent)
        except OSError as e:
            raise ModelLoadError(f"cannot create {out.parent}: {e}") from e
        proc = subprocess.run(
            [sys.executable, "-c", _child_code(), str(gguf_path), str(out)],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            raise _child_failure(gguf_path, proc)
    return out


def child_main(argv: list[str]) -> int:
    """Entry point of the conversion child: ``<gguf path> <out dir>``; 0 on success."""
    gguf_path, out_dir = Path(argv[0]), Path(argv[1])
    try:
        convert(gguf_path, out_dir)
    except ModelLoadError as e:
        print(_ERROR_MARK + " ".join(str(e).split()), file=sys.stderr)
        return 2
    except Exception as e:  # malformed metadata surfacing as KeyError, TypeError, ...
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        print(f"{_ERROR_MARK}not a valid GGUF file: {gguf_path} ({reason})", file=sys.stderr)
        return 2
    return 0

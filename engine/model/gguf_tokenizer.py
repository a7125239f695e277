"""The tokenizer and tokenizer_config.json of a GGUF file, from its metadata.

kvchat's own builder makes GPT-2-style byte-level BPE vocabularies (the default model's
"smollm" split: single digits, then GPT-2's regex); transformers' GGUF converter makes the
rest (Llama 3 and Qwen splits, SentencePiece vocabularies of gemma3 and phi3).
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import ModelLoadError
from engine.model.gguf_config import scalar

CONTROL_TOKEN = 3
# llama.cpp's "smollm"/"gpt2"-family pre-tokenizer: single digits, then GPT-2's regex.
_PRE_TOKENIZERS_WITH_DIGITS = {"smollm", "starcoder", "refact", "codeshell", "exaone"}
_OWN_TOKENIZER_PRE = _PRE_TOKENIZERS_WITH_DIGITS | {"gpt2", "default"}


def own_tokenizer(meta: dict) -> bool:
    """Whether kvchat's own builder makes this file's tokenizer: GPT-2-style byte-level BPE
    with GPT-2's split (and single digits for the smollm family)."""
    return (meta.get("tokenizer.ggml.model") == "gpt2"
            and meta.get("tokenizer.ggml.pre", "default") in _OWN_TOKENIZER_PRE)


def build_tokenizer(meta: dict, path: Path | None = None):
    """A `tokenizers.Tokenizer` for the file's vocabulary: kvchat's byte-level BPE builder
    where it applies (`own_tokenizer`), else transformers' GGUF converter (Llama 3 and Qwen
    splits, SentencePiece vocabularies of gemma3 and phi3), which reads ``path``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if not own_tokenizer(meta):
        return _transformers_tokenizer(path)
    tokens = meta["tokenizer.ggml.tokens"]
    types = list(meta["tokenizer.ggml.token_type"])
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


def _transformers_tokenizer(path: Path | None):
    if path is None:
        raise ModelLoadError("this GGUF tokenizer needs the file to convert it")
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )

        arch, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
        return convert_gguf_tokenizer(arch, tokenizer_dict)[0]
    except ModelLoadError:
        raise
    except Exception as e:  # an unknown tokenizer type, malformed vocabulary
        raise ModelLoadError(f"cannot build the GGUF tokenizer of {path}: "
                             f"{' '.join(str(e).split())[:200]}") from e


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
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        "add_bos_token": bool(scalar(meta, "tokenizer.ggml.add_bos_token",
                                     meta.get("tokenizer.ggml.model") == "llama")),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(scalar(meta, f"{meta['general.architecture']}.context_length")),
    }
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return {k: v for k, v in cfg.items() if v is not None}

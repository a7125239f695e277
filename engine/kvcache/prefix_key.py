"""Prefix-cache keys: a salt naming everything that makes K/V differ, and chained block hashes.

``h_0 = sha256(salt.digest() + tokens_0)``, ``h_i = sha256(h_{i-1} + tokens_i)``, tokens as int32
little-endian. A block's hash therefore names its whole prefix *and* the salt: two tenants, two
permission versions or two models never produce the same key for identical text. Hashes are only
keys; every hit must still compare the stored token ids (see `disk.store`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np

HASH_SIZE = 32
# Domain tag: a future change of the salt encoding must never collide with today's keys.
_SALT_TAG = b"kvchat-prefix-salt/1\x00"


@dataclass(frozen=True, slots=True)
class CacheSalt:
    """Everything that makes cached K/V differ or must keep it apart.

    Attributes:
        model_fingerprint: content hash of the weights (never a path).
        tokenizer_fingerprint: content hash of the tokenizer files.
        prompt_version: chat-template hash, or ``"raw"`` for untemplated prompts.
        position: RoPE / position parameters, e.g.
            ``"rope_theta=10000,traditional=True,scaling=None"``.
        kv_format: KV dtype / quantization, e.g. ``"float32"`` or ``"q8g64"``.
        block_size: tokens per block.
        tenant: who may read the blocks; identical text in two tenants is never shared.
        permission_version: bumping it makes every older entry of the tenant unreachable.
    """

    model_fingerprint: str
    tokenizer_fingerprint: str
    prompt_version: str
    position: str
    kv_format: str
    block_size: int
    tenant: str = "local"
    permission_version: int = 0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("block_size", "permission_version"):
                # bool is an int subclass; True must not pass for a block size
                if type(value) is not int:
                    raise TypeError(f"CacheSalt.{f.name} must be an int, got {value!r}")
            elif not isinstance(value, str):
                raise TypeError(f"CacheSalt.{f.name} must be a str, got {value!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.permission_version < 0:
            raise ValueError(f"permission_version must be >= 0, got {self.permission_version}")

    def to_dict(self) -> dict[str, str | int]:
        """All fields as a plain dict (what the disk store writes into entry headers)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CacheSalt:
        """Rebuild a salt from `to_dict` output.

        Raises:
            ValueError: on missing or unknown keys (an entry from another salt scheme).
            TypeError: on wrongly typed values.
        """
        if not isinstance(data, dict):
            raise TypeError("salt must be a dict")
        names = {f.name for f in fields(cls)}
        if set(data) != names:
            raise ValueError(f"salt keys {sorted(data)} != {sorted(names)}")
        return cls(**data)

    def digest(self) -> bytes:
        """sha256 of a canonical encoding of every field: the parent hash of the first block."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(_SALT_TAG + canon.encode()).digest()

    def scope(self) -> tuple[str, int]:
        """``(tenant, permission_version)``: who may see blocks keyed by this salt."""
        return self.tenant, self.permission_version


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    # numpy 2 raises OverflowError for ids outside int32 instead of wrapping them silently
    return np.asarray(token_ids, dtype="<i4").reshape(-1).tobytes()


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The 32-byte key of a block: ``sha256(parent + int32-LE(token_ids))``.

    Args:
        parent (bytes): the previous block's hash, or ``salt.digest()`` for the first block.
        token_ids (Sequence[int]): the block's tokens.
    """
    if len(parent) != HASH_SIZE:
        raise ValueError(f"parent hash must be {HASH_SIZE} bytes, got {len(parent)}")
    return hashlib.sha256(bytes(parent) + _token_bytes(token_ids)).digest()


def block_hashes(
    salt: CacheSalt, token_ids: Sequence[int], block_size: int | None = None
) -> list[bytes]:
    """Chained hashes of every FULL block of ``token_ids``; a trailing partial block gets none.

    Args:
        salt (CacheSalt): the key salt; its digest is the first block's parent.
        token_ids (Sequence[int]): the prompt's tokens.
        block_size (int, optional): must equal ``salt.block_size`` (the salt covers it).
            Default: ``salt.block_size``.
    """
    if block_size is None:
        block_size = salt.block_size
    if block_size != salt.block_size:
        raise ValueError(f"block_size {block_size} != salt.block_size {salt.block_size}")
    raw = _token_bytes(token_ids)
    step = 4 * block_size
    hashes: list[bytes] = []
    parent = salt.digest()
    for start in range(0, len(raw) - step + 1, step):
        parent = hashlib.sha256(parent + raw[start : start + step]).digest()
        hashes.append(parent)
    return hashes


def salt_base(*, model_fingerprint: str, tokenizer_fingerprint: str, chat_template: str | None,
              model_config: dict, kv_format: str, block_size: int) -> dict:
    """The salt's parts shared by every sequence of one engine (all but the tenant scope)."""
    scaling = model_config.get("rope_scaling")
    position = (f"rope_theta={model_config.get('rope_theta')},"
                f"traditional={model_config.get('rope_traditional')},"
                f"scaling={sorted(scaling.items()) if isinstance(scaling, dict) else scaling}")
    template = chat_template or ""
    return dict(
        model_fingerprint=model_fingerprint,
        tokenizer_fingerprint=tokenizer_fingerprint,
        prompt_version="tmpl-" + hashlib.sha256(template.encode()).hexdigest()[:16],
        position=position,
        kv_format=kv_format,
        block_size=block_size,
    )

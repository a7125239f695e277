"""Engine configuration: plain data, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    """How the engine sizes and runs its KV pool."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_budget_bytes: int = 1 << 30
    """Bytes for the KV pool; the number of blocks is derived from it."""
    kv_dtype: str | None = None
    """KV storage dtype ("float32", "float16", "bfloat16"); None = the model's compute dtype."""
    prefill_chunk: int = 512
    """Prompt tokens per prefill step (bounds memory and cancel latency)."""
    max_context: int | None = None
    """Cap on tokens per sequence; None = the model's context length."""
    fuse_projections: bool = True
    """Concatenate q/k/v and gate/up weights of float models (fewer, larger matmuls)."""

    def __post_init__(self):
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError("block_size must be in 1..1024")
        if self.kv_budget_bytes <= 0:
            raise ValueError("kv_budget_bytes must be positive")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be positive")
        if self.kv_dtype not in (None, "float32", "float16", "bfloat16"):
            raise ValueError("kv_dtype must be float32, float16 or bfloat16")

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
    kv_bits: int | None = None
    """Store K and V quantized at 8 or 4 bits (MLX affine, float16 scales); None = kv_dtype."""
    k_bits: int | None = None
    """K's bits alone (overrides kv_bits for K; 16 = unquantized), like llama.cpp's cache-type-k."""
    v_bits: int | None = None
    """V's bits alone (overrides kv_bits for V; 16 = unquantized)."""
    kv_group_size: int = 64
    """Elements per quantization group (32, 64 or 128); head_dim must divide by it."""
    kv_rotation: bool = True
    """Rotate quantized K/V rows before quantizing them (`kvcache.rotation`): measured to cut
    the quantization's cost several-fold on held-out text; False stores them as they are."""
    kv_residual: bool = False
    """Keep each block in the compute dtype until it fills, then quantize it once
    (`kvcache.residual`); needs K and V quantized. A query reads its own block exact."""
    kv_key_channel: bool = False
    """Quantize K per channel within a block (one scale and bias per head and channel over a
    block's tokens, KIVI) instead of per token; needs ``kv_residual``."""
    prefill_chunk: int = 512
    """Prompt tokens per prefill step (bounds memory and cancel latency)."""
    max_context: int | None = None
    """Cap on tokens per sequence; None = the model's context length."""
    fuse_projections: bool = True
    """Concatenate q/k/v and gate/up weights of float models (fewer, larger matmuls)."""
    max_running: int = 16
    """Sequences running (prefilling or decoding) at once; all decodes share one forward."""
    pool_sequences: int | None = None
    """Cut the pool to this many full-context sequences when the budget is larger (a
    one-shot command: a bigger pool would be allocated and never used); None = the budget."""
    max_step_tokens: int | None = None
    """Prompt tokens prefilled per step over all requests; None = prefill_chunk."""
    max_step_tokens_decoding: int = 128
    """Prefill budget of a step while other sequences decode: bounds their inter-token latency
    (a 512-token chunk takes seconds on a CPU); a lone prompt still prefills in full chunks."""
    step_target_s: float | None = 0.2
    """Seconds a step with decodes should take: its prefill budget is sized from measured
    forward times so decoding sequences keep their pace (max_step_tokens_decoding caps it);
    None keeps the fixed budget."""
    cancel_check_s: float = 0.12
    """Seconds of a long prefill forward between cancel checks (layer groups): a cancel
    lands within about this, not after a whole chunk."""
    watermark: float = 0.01
    """Fraction of the pool kept free at admission so running sequences can grow."""
    preempt_mode: str | None = None
    """How a preempted sequence gives its blocks back: "recompute" or "swap" (to host).
    None: recompute for a float pool, swap for a quantized one (recomputed K/V come from a
    prefill, not decode steps, and re-quantizing them can change later tokens)."""
    swap_budget_bytes: int = 1 << 30
    """Host memory for swapped-out K/V; beyond it, preemption falls back to recompute."""
    prefix_cache: bool = True
    """Reuse the K/V of full blocks shared with earlier prompts (same tenant and salt)."""
    disk_cache: bool = False
    """Persist prompt prefix blocks to disk and restore them (also after a restart)."""
    disk_cache_dir: str | None = None
    """The disk store's directory; None = ~/.cache/kvchat/prefix (or $KVCHAT_HOME/prefix)."""
    disk_budget_bytes: int = 2 << 30
    """Bytes the disk store may hold; least recently used entries go first."""
    disk_ttl_s: float = 24 * 3600
    """Lifetime of a disk entry; cached K/V is user data and never outlives it."""
    window_pool: bool = True
    """Sliding-window layers keep K/V only for the blocks their window covers (a smaller
    store of its own); False keeps every block in every layer (the A/B baseline)."""
    overflow: str = "truncate"
    """A request whose output cannot fit: "truncate" its max tokens (and say so) or "reject"."""
    kernels: bool = True
    """Decode with the Metal/CUDA paged kernels where they apply; False (or the environment
    variable KVCHAT_KERNELS=0) keeps every step on the pure-MLX reference path."""
    speculate: str = "off"
    """Speculative decoding: "lookup" verifies draft tokens copied from n-grams of the prompt
    and answer, "draft:MODEL" tokens a smaller model of the same tokenizer guesses
    (`engine.speculation`; greedy output is unchanged, sampled output keeps its
    distribution); "off" decodes one token per step."""
    context_shift: bool = False
    """A generation that fills the context drops the middle and goes on (`engine.shifting`):
    the first ``shift_sinks`` tokens and the newest half stay; the default of requests
    that do not say (`SamplingParams.context_shift`)."""
    shift_sinks: int = 4
    """Leading tokens a context shift keeps (attention sinks), rounded up to whole blocks."""
    pipeline: bool | None = None
    """Launch greedy decode steps ahead (`mx.async_eval`) while the next one is built.
    None: on a GPU backend and with the CPU extension. There the extension's greedy pick
    feeds the next step unread: ~14 % at 1 stream, ~7 % at 4, ~3 % at 8 (2 cores). The
    residual formats, whose writes a dropped graph cannot undo, chain with mlx-lm's
    logsumexp per row instead (~0.6 ms a row): only single-stream steps (+10 %; it cost
    ~19 % at 4 streams)."""

    def __post_init__(self):
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError("block_size must be in 1..1024")
        if self.kv_budget_bytes <= 0:
            raise ValueError("kv_budget_bytes must be positive")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be positive")
        if self.max_running < 1:
            raise ValueError("max_running must be positive")
        if self.pool_sequences is not None and self.pool_sequences < 1:
            raise ValueError("pool_sequences must be positive or None")
        if self.step_target_s is not None and not self.step_target_s > 0:
            raise ValueError("step_target_s must be positive or None")
        if not self.cancel_check_s > 0:
            raise ValueError("cancel_check_s must be positive")
        if not 0 <= self.watermark < 1:
            raise ValueError("watermark must be in [0, 1)")
        if self.preempt_mode not in (None, "recompute", "swap"):
            raise ValueError("preempt_mode must be recompute or swap")
        if self.speculate not in ("off", "lookup") and not (
                self.speculate.startswith("draft:") and len(self.speculate) > 6):
            raise ValueError("speculate must be off, lookup or draft:MODEL")
        if self.shift_sinks < 0:
            raise ValueError("shift_sinks must be >= 0")
        if self.overflow not in ("truncate", "reject"):
            raise ValueError("overflow must be truncate or reject")
        for name in ("kv_bits", "k_bits", "v_bits"):
            if getattr(self, name) not in (None, 4, 8, 16):
                raise ValueError(f"{name} must be 4, 8 or 16")
        if self.kv_key_channel and not self.kv_residual:
            raise ValueError("kv_key_channel needs kv_residual (a block is quantized when full)")
        if self.kv_group_size not in (32, 64, 128):
            raise ValueError("kv_group_size must be 32, 64 or 128")
        if self.kv_dtype not in (None, "float32", "float16", "bfloat16"):
            raise ValueError("kv_dtype must be float32, float16 or bfloat16")


SPEC_MODES = ("off", "lookup", "draft")


@dataclass(slots=True)
class SpecConfig:
    """Speculative decoding settings (`EngineConfig.speculate`)."""

    mode: str = "off"  # "off", "lookup" or "draft" (a `DraftModel` proposes)
    max_draft: int = 6  # drafts verified per sequence and step at most
    # shortest suffix n-gram a lookup matches on: one token (a name's first piece) already
    # finds spans worth copying; whether its guesses pay is measured like any other's
    min_ngram: int = 1
    max_ngram: int = 4
    fixed: int | None = None  # verify this many drafts every step, unmeasured (A/B, tests)

    def __post_init__(self):
        if self.mode not in SPEC_MODES:
            raise ValueError(f"speculate must be one of {', '.join(SPEC_MODES)}")
        if not 1 <= self.max_draft <= 16:
            raise ValueError("max_draft must be in 1..16")
        if not 1 <= self.min_ngram <= self.max_ngram <= 8:
            raise ValueError("need 1 <= min_ngram <= max_ngram <= 8")

"""Builds an engine's parts from a loaded model and an `EngineConfig`.

The one place where the model side (runner, layout) meets the KV-cache side
(pool, block manager, prefix cache, disk store, swap): the parts below it stay
independent of each other and of the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import mlx.core as mx

from engine.config import EngineConfig
from engine.errors import KVChatError
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.disk.store import DiskPrefixStore
from engine.kvcache.kv_cache import POOL_BITS, KVLayout, PagedKVCache
from engine.kvcache.prefix_cache import PrefixCache
from engine.kvcache.prefix_key import salt_base
from engine.kvcache.quant import MIN_ROTATION_BLOCK, QuantSpec, rotation_block
from engine.kvcache.residual import ResidualKVCache
from engine.kvcache.swap import HostSwap
from engine.kvcache.window_blocks import WindowBlocks, pool_bytes
from engine.model import memory
from engine.model.attention import cpu_residual
from engine.model.loader import LoadedModel
from engine.model.model_runner import PagedModel
from engine.scheduler import SchedulerConfig
from engine.shifting import ContextShifter


def kv_writers(loaded) -> dict:
    """`PagedKVCache`'s writers: the CPU extension's one-op K/V writes (plain and quantized
    stores, and both sides of a layer at once) when the model runs on it, else none (MLX's
    indexing and `mx.quantize`)."""
    if not loaded.cpu_ext:
        return {"row_writer": None, "quant_writer": None, "sides_writer": None}
    from engine.model.cpu_ext.ops import kv_write, kv_write_quant, kv_write_sides

    return {"row_writer": kv_write, "quant_writer": kv_write_quant,
            "sides_writer": kv_write_sides}


def residual_writers(loaded) -> dict:
    """`ResidualKVCache`'s writers: `kv_writers` and the one-op per-channel key quantization
    of filled blocks, or none."""
    if not loaded.cpu_ext:
        return {**kv_writers(loaded), "channel_quant": None}
    from engine.model.cpu_ext.ops import channel_quant

    return {**kv_writers(loaded), "channel_quant": channel_quant}


def kv_quant(config: EngineConfig, head_dim: int) -> tuple[QuantSpec | None, QuantSpec | None,
                                                          str | None, str | None]:
    """(K format, V format, a dtype override, a notice) from the config's bits.

    A head dim the group does not divide cannot be quantized: the pool falls back to
    float16 (half of float32, no quantization error) and says so.
    """
    k = config.k_bits or config.kv_bits
    v = config.v_bits or config.kv_bits
    if not any(b in POOL_BITS for b in (k, v)):
        return None, None, None, None
    g = config.kv_group_size
    if head_dim % g:
        return None, None, "float16", (f"KV quantization needs a head dim divisible by the "
                                       f"group size {g} (this model: {head_dim}); "
                                       f"the KV cache uses float16 instead")
    rotation, notice = 0, None
    if config.kv_rotation:
        if rotation_block(head_dim) >= MIN_ROTATION_BLOCK:
            rotation = 1
        else:
            notice = (f"KV rows of {head_dim} have no power-of-two block of "
                      f"{MIN_ROTATION_BLOCK} or more: quantized without rotation")
    spec = {b: QuantSpec(b, g, rotation) for b in POOL_BITS}
    return spec.get(k), spec.get(v), None, notice


def residual_layout(layout: KVLayout, config: EngineConfig) -> KVLayout:
    """``layout`` with the config's residual block and per-channel keys; raises
    `KVChatError` where this model's pool cannot take them."""
    if not config.kv_residual:
        return layout
    if not (layout.k_quant and layout.v_quant):
        raise KVChatError("the residual KV formats need K and V quantized (this model's "
                          "head dim or the bits chosen leave a side unquantized)")
    if config.kv_key_channel and config.block_size * layout.k_quant.bits % 8:
        raise KVChatError("per-channel 4-bit keys need an even block size")
    return replace(layout, residual=True, key_channel=config.kv_key_channel)


@dataclass(slots=True)
class EngineParts:
    runner: PagedModel
    layout: KVLayout
    kv: PagedKVCache
    blocks: BlockManager
    prefix: PrefixCache
    swap: HostSwap
    scheduler_config: SchedulerConfig
    notices: list[str]
    shifter: ContextShifter | None = None  # context shift (`engine.shifting`)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_kv_budget(budget: int, weight_bytes: int, limit: int | None = None) -> None:
    """Refuse a KV budget beyond the memory the engine may use next to its weights.

    The pool is allocated (and zero-filled) up front, so an oversized budget would
    otherwise end in an out-of-memory kill with no message.
    """
    limit = memory.engine_memory_limit() if limit is None else limit
    room = limit - weight_bytes
    if budget > room:
        suggest = max(room // 2, 0)
        raise KVChatError(
            f"a KV budget of {_gib(budget)} exceeds the {_gib(max(room, 0))} this machine "
            f"leaves for the KV cache next to {_gib(weight_bytes)} of weights; "
            f"try --kv-budget {max(suggest >> 20, 1)}M")


def window_pool(runner: PagedModel, layout: KVLayout, config: EngineConfig, num_blocks: int,
                max_context: int) -> tuple[WindowBlocks | None, int]:
    """The sliding-window layers' store, and the pool's blocks once that store is carved
    out of the budget; (None, num_blocks) when the model has no windows or its windows
    would span the whole pool anyway.

    Every running sequence may hold its window and margin (`window_blocks`), and one
    more such span stays retained for the next turn of a chat. Fewer would only limit
    how many sequences run at once: `BlockManager.can_append` counts window blocks.
    """
    windows = [w for w in runner.windows if w]
    if not (config.window_pool and windows):
        return None, num_blocks
    bs, window = config.block_size, max(windows)
    # A step's queries read back W - 1 keys before its chunk (margin >= chunk), and the
    # disk writer reads a chunk one step late: its first key may sit 2 chunks - W behind.
    chunk = max(config.prefill_chunk, config.max_step_tokens or 0)
    margin = max(chunk, 2 * chunk - window)
    per_seq = -(-(window + margin) // bs) + 2
    num_window_blocks = 1 + ((config.pool_sequences or config.max_running) + 1) * per_seq
    store_bytes = partial(pool_bytes, layout.bytes_per_block, layout.num_layers, len(windows))
    room = config.kv_budget_bytes - store_bytes(0, num_window_blocks)
    # every layer windowed: pool blocks only name tokens, as many as the plain pool had
    global_block = store_bytes(1, 0)
    pool_blocks = room // global_block if global_block else num_blocks
    if config.pool_sequences is not None:
        pool_blocks = min(pool_blocks, config.pool_sequences * -(-max_context // bs) + 1)
    if room <= 0 or num_window_blocks >= pool_blocks:
        return None, num_blocks
    return WindowBlocks(pool_blocks, num_window_blocks, bs, window, margin,
                        layers=len(windows)), pool_blocks


def build_kv(loaded: LoadedModel, config: EngineConfig) -> EngineParts:
    """The runner, the KV pool and its bookkeeping, the prefix cache and the scheduler config."""
    check_kv_budget(config.kv_budget_bytes, loaded.weight_bytes)
    runner = PagedModel(loaded.model, loaded.model_type)
    runner.use_kernels = config.kernels
    if config.fuse_projections:
        runner.fuse_projections()
    k_quant, v_quant, fallback, notice = kv_quant(config, runner.head_dim)
    notices = [notice] if notice else []
    dtype_name = fallback or config.kv_dtype
    dtype = getattr(mx, dtype_name) if dtype_name else None
    layout = residual_layout(
        runner.kv_layout(config.block_size, dtype, k_quant=k_quant, v_quant=v_quant), config)
    num_blocks = layout.num_blocks_for(config.kv_budget_bytes)
    if num_blocks < 1:
        raise KVChatError(f"a KV budget of {config.kv_budget_bytes} bytes holds no block of "
                          f"{layout.bytes_per_block} bytes")
    max_context = min(config.max_context or loaded.context_length, loaded.context_length)
    if config.pool_sequences is not None:
        per_seq = -(-max_context // config.block_size)
        num_blocks = min(num_blocks, config.pool_sequences * per_seq + 1)
    # A residual pool has no window store: its windowed layers keep every block, as its
    # global layers do, and read only their window (the store holds per-token rows only).
    window, num_blocks = (None, num_blocks) if layout.residual else \
        window_pool(runner, layout, config, num_blocks, max_context)
    windowed = [w is not None for w in runner.windows]
    if layout.residual and any(windowed) and layout.head_dim not in cpu_residual.HEAD_DIMS:
        # other head dims run the reference residual path, whose rows round differently by
        # how a step is cut (measured on Gemma 3's 256: batched log-probs up to 0.1 apart)
        dims = " or ".join(map(str, cpu_residual.HEAD_DIMS))
        raise KVChatError(f"the residual KV formats run sliding-window layers at head dim "
                          f"{dims} only (this model's is {layout.head_dim}); use --kv-bits")
    if layout.residual:
        kv = ResidualKVCache(layout, num_blocks, **residual_writers(loaded))
    else:
        kv = PagedKVCache(layout, num_blocks, **kv_writers(loaded), window=window,
                          windowed=windowed)
    blocks = BlockManager(num_blocks, config.block_size, window)
    if layout.residual:
        kv.free_ids = lambda: blocks.free_block_ids  # residual rows of blocks freed mid-fill
        blocks.on_reopen = kv.reopen  # a block a rejected draft filled is exact again
    store = None
    if config.prefix_cache and config.disk_cache:
        root = Path(config.disk_cache_dir).expanduser() if config.disk_cache_dir else None
        # blocks are written once no sequence holds the pool: a write took CPU from decode
        store = DiskPrefixStore(root, budget_bytes=config.disk_budget_bytes,
                                default_ttl_s=config.disk_ttl_s, max_pending=256,
                                hold=lambda: bool(blocks.block_tables))
    base = salt_base(model_fingerprint=loaded.fingerprint,
                     tokenizer_fingerprint=loaded.tokenizer_fingerprint,
                     chat_template=getattr(loaded.tokenizer, "chat_template", None),
                     model_config=loaded.config,
                     kv_format=layout.kv_format,
                     block_size=layout.block_size)
    prefix = PrefixCache(kv, blocks, base, enabled=config.prefix_cache, store=store)
    swap = HostSwap(kv, blocks, config.swap_budget_bytes)
    sched = SchedulerConfig(
        max_context=max_context,
        max_running=config.max_running,
        max_prefill_tokens=config.max_step_tokens or config.prefill_chunk,
        prefill_chunk=config.prefill_chunk,
        max_prefill_tokens_decoding=config.max_step_tokens_decoding,
        watermark_blocks=max(1, int(config.watermark * num_blocks)),
        preempt_mode=config.preempt_mode or (
            "swap" if layout.quantized and not layout.residual else "recompute"),
        overflow=config.overflow,
    )
    shifter = ContextShifter(runner, kv, blocks, max_context, default=config.context_shift,
                             sink_tokens=config.shift_sinks)
    return EngineParts(runner, layout, kv, blocks, prefix, swap, sched, notices, shifter)

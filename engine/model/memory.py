"""Memory facts: how much memory the engine may use on this backend, KV sizing.

The seed's KV formula: layers x 2 x kv_heads x head_dim x tokens x batch x
bytes per element (plus scales for a quantized format).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import mlx.core as mx

from engine.kvcache.quant import QuantSpec
from engine.model import memory_limits
from engine.model.backend import backend

ENGINE_MEMORY_FRACTION = 0.75  # of physical RAM (CPU) or Metal's working-set limit
FLOAT_WEIGHT_FRACTION = 0.25  # float32 weights on CPU only while they fit this share


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


@contextlib.contextmanager
def no_buffer_cache():
    """MLX keeps no freed buffers for reuse inside: a load that replaces arrays one by one
    then peaks at the model plus one layer, not at two models."""
    old = mx.set_cache_limit(0)
    try:
        yield
    finally:
        mx.set_cache_limit(old)


@contextlib.contextmanager
def prefill_scratch_on_cpu():
    """For a prefill step on the CPU backend: MLX's buffer cache off and emptied (freed
    scratch went to it in sizes the next layer did not reuse, so it grew beside the live
    arrays: a Gemma-3-1B-shaped Q4_0 file's 606-token prompt peaked at 730.6 MB RSS with
    it, 700.6 MB without), and glibc's mmap threshold raised to 32 MiB meanwhile, so what
    the scratch frees goes back to the heap and the next layer's scratch is carved from
    it. With the 1 MiB threshold every layer's scratch was fresh pages: a 1B Q4_0 512-token
    prefill took ~105k page faults (~420 MB zeroed by the kernel, 15-24 % of its wall time
    in the system); now none, peak RSS +6-12 MB. Metal and CUDA keep their cache."""
    if backend() != "cpu":
        yield
        return
    with no_buffer_cache():
        mx.clear_cache()  # what earlier steps left cached is no use to a chunk's sizes
        _mallopt(M_MMAP_THRESHOLD, PREFILL_MMAP_THRESHOLD)
        try:
            yield
        finally:
            _mallopt(M_MMAP_THRESHOLD, _settled["mmap"])


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 1 << 20
TRIM_THRESHOLD = PREFILL_MMAP_THRESHOLD = 32 << 20  # glibc's largest mmap threshold
_settled = {"mmap": MMAP_THRESHOLD}  # what a prefill step puts back (`set_mmap_threshold`)


@functools.cache
def glibc():
    """This process's C library if it is glibc's (it has `mallopt` and `malloc_trim`), else
    None (macOS, musl): what the heap settings here and the server's trimming act on."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _mallopt(param: int, value: int) -> bool:
    libc = glibc()
    return libc is not None and libc.mallopt(param, value) == 1


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold for this process (and for after each prefill step)."""
    _settled["mmap"] = nbytes
    return _mallopt(M_MMAP_THRESHOLD, nbytes)


def pin_mmap_threshold() -> None:
    """Serve every allocation of 1 MiB or more (weights, activations) by its own mmap, so
    freeing it returns it to the OS at once. glibc's default threshold moves up to the
    largest buffer freed (up to 32 MiB): after a load frees its source layers, fusing
    q/k/v then left 106 MiB of freed buffers resident on a 1B model. Setting it fixes it.
    The heap's free top is kept up to 32 MiB (glibc's default with a fixed threshold:
    128 KiB), so a prefill's scratch stays for its next layer (`prefill_scratch_on_cpu`)."""
    set_mmap_threshold(MMAP_THRESHOLD)
    _mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def release_freed() -> None:
    """Give memory freed while loading back to the OS: MLX's buffer cache, then glibc's
    free heap (after large frees glibc raises its mmap threshold, so a model's worth of
    freed buffers would stay resident: measured 1.45 GB RSS for 0.69 GB of weights)."""
    mx.clear_cache()
    if (libc := glibc()) is not None:  # not glibc: nothing to trim this way
        libc.malloc_trim(0)


def engine_memory_limit() -> int:
    """Bytes the engine may use for weights plus KV on this machine: a share of its RAM,
    or of a container's memory limit, and never past an address-space rlimit's room."""
    if backend() == "metal":
        info = mx.metal.device_info()
        return int(info.get("max_recommended_working_set_size", physical_memory()))
    total = min(physical_memory(), memory_limits.cgroup_limit() or physical_memory())
    limit = int(total * ENGINE_MEMORY_FRACTION)
    room = memory_limits.address_space_room()
    return limit if room is None else min(limit, room)


def float_weight_budget() -> int:
    return int(physical_memory() * FLOAT_WEIGHT_FRACTION)


def kv_bytes_per_element(kv_bits: int, group_size: int = 64) -> float:
    """Bytes per stored K/V element: 2 for fp16, bits/8 plus per-group scale+bias else."""
    if kv_bits == 16:
        return 2.0
    if kv_bits == 32:
        return 4.0
    # the pool's own accounting: packed bits plus a float16 scale and bias per group
    return QuantSpec(kv_bits, group_size).bytes_per_row(group_size) / group_size


@dataclass(slots=True)
class KVEstimate:
    """What a KV cache of ``tokens`` x ``batch`` costs and how it fits here."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens: int
    batch: int
    kv_bits: int
    bytes_per_element: float
    block_size: int

    @property
    def bytes_per_token(self) -> float:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.bytes_per_element

    @property
    def total_bytes(self) -> int:
        return int(self.bytes_per_token * self.tokens * self.batch)

    @property
    def blocks(self) -> int:
        """Blocks needed: each sequence rounds up to whole blocks."""
        return -(-self.tokens // self.block_size) * self.batch

    @property
    def block_bytes(self) -> int:
        return int(self.blocks * self.block_size * self.bytes_per_token)


def estimate(num_layers: int, num_kv_heads: int, head_dim: int, *, tokens: int,
             batch: int = 1, kv_bits: int = 16, block_size: int = 16) -> KVEstimate:
    if tokens < 1 or batch < 1:
        raise ValueError("tokens and batch must be positive")
    if kv_bits not in (4, 8, 16, 32):
        raise ValueError("kv_bits must be 4, 8, 16 or 32")
    return KVEstimate(num_layers, num_kv_heads, head_dim, tokens, batch, kv_bits,
                      kv_bytes_per_element(kv_bits), block_size)

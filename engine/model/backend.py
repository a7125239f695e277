"""Which MLX backend runs here, and whether kvchat's own kernels may run on it.

The one backend probe: chosen by what MLX can run (`mx.metal.is_available()`,
`mx.cuda.is_available()`), never by platform string. Switches are environment
variables read on every call, so a test or a user can flip them in-process.
"""

from __future__ import annotations

import os

import mlx.core as mx

KERNELS_SWITCH = "KVCHAT_KERNELS"
"""Set to 0 (false, off, no) to keep attention on the MLX reference, CPU and GPU alike."""
_OFF_VALUES = ("0", "false", "off", "no")


def backend() -> str:
    """"metal", "cuda" or "cpu"."""
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def kernel_backend() -> str | None:
    """"metal" or "cuda" when this MLX build runs custom GPU kernels, else None."""
    name = backend()
    return name if name in ("metal", "cuda") else None


def switched_off(variable: str) -> bool:
    """True when the environment variable says 0, false, off or no (any case)."""
    return os.environ.get(variable, "1").strip().lower() in _OFF_VALUES


def kernels_enabled() -> bool:
    """False when `KVCHAT_KERNELS` turns kvchat's attention kernels off."""
    return not switched_off(KERNELS_SWITCH)


def cpu_compile_off() -> None:
    """Turn `mx.compile` off on MLX's CPU backend.

    A function compiled on a worker thread (the engine's; mlx-lm's `swiglu` and samplers
    are compiled) makes the process abort at exit with "terminate called without an
    active exception" (3 of 5 runs of a 4-line script with MLX 0.32.4). On the CPU
    the compiled and plain functions give bit-identical results (checked for `swiglu`
    in float32/16, bf16) and fusing saves little; Metal and CUDA keep compiling.
    """
    if backend() == "cpu":
        mx.disable_compile()

"""One first-launch check and one fallback switch for every attention kernel.

Each kernel variant (what selects a distinct compiled kernel: path, dtypes, template
values) is checked against the reference on its first launch; any exception (build,
launch) or mismatch turns kvchat's attention kernels off for the rest of the process,
CPU and GPU alike, said once. Generation goes on on the reference.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import mlx.core as mx

from engine.model.fallback import FallbackSwitch

# Max |kernel - reference| allowed, as a fraction of max(1, max |reference|). Loose (a few
# ulps of the output dtype would do): it catches a miscompiled or misindexed kernel on an
# untested machine, not rounding.
FIRST_LAUNCH_TOLERANCE = {mx.float16: 1e-2, mx.bfloat16: 6e-2, mx.float32: 1e-3}


class KernelMismatch(RuntimeError):
    """A kernel's first launch disagreed with the reference."""


def check_first_launch(out: mx.array, ref: mx.array, pools=()) -> None:
    """Raise `KernelMismatch` unless ``out`` matches ``ref``; a ``ref`` of fewer query rows
    (axis 2) than ``out`` is the reference of its last rows.

    The allowance is the output dtype's, or float16's when a pool is stored in less than
    float32 (half or quantized rows): the reference rounds them to float16, a kernel may not.
    """
    if ref.ndim == 4 and ref.shape[2] < out.shape[2]:
        out = out[:, :, out.shape[2] - ref.shape[2]:]
    mx.eval(out, ref)  # surfaces build errors now, not at some later mx.eval
    tolerance = FIRST_LAUNCH_TOLERANCE[ref.dtype]
    if any(p.dtype != mx.float32 for p in pools):
        tolerance = max(tolerance, FIRST_LAUNCH_TOLERANCE[mx.float16])
    err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    bound = tolerance * max(1.0, mx.abs(ref).max().item())
    if not err <= bound:  # NaN fails too
        raise KernelMismatch(f"first launch differs from the reference by {err:.3g} "
                             f"(allowed {bound:.3g})")


class LaunchGuard:
    """Runs kernel launches behind the first-launch check and the process's switch."""

    def __init__(self, switch: FallbackSwitch):
        self.switch = switch
        self._lock = threading.Lock()
        self._validated: set[tuple] = set()

    def run(self, name: str, key: tuple, launch: Callable[..., mx.array], args: tuple,
            reference: Callable[[], mx.array], pools=()) -> mx.array | None:
        """``launch(*args)``, or None ("use the reference") once anything failed; ``name``
        says which kernel in the message."""
        if self.switch.tripped:
            return None
        try:
            out = launch(*args)
            if key not in self._validated:
                check_first_launch(out, reference(), pools)
                with self._lock:
                    self._validated.add(key)
        except Exception as exc:  # noqa: BLE001 - any failure means: not on this machine
            self.switch.trip(f"{name} failed: {type(exc).__name__}: {exc}")
            return None
        return out

    def validated(self, key: tuple) -> bool:
        """Whether variant ``key`` passed its first-launch check and nothing has failed."""
        return not self.switch.tripped and key in self._validated

    def reset(self) -> None:
        """Forget the fallback and the validated variants (tests)."""
        with self._lock:
            self._validated.clear()
        self.switch.reset()


GUARD = LaunchGuard(FallbackSwitch(
    "kvchat.attention", "kvchat: attention kernels off for this process, using the MLX "
    "reference"))
"""The process's guard: every backend's kernels share it."""


def kernel_fallback() -> str | None:
    """Why the attention kernels were dropped for this process; None while they are not."""
    return GUARD.switch.reason

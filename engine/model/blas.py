"""Load an optimized BLAS before MLX so the CPU backend's matmuls use it.

The `mlx[cpu]` Linux wheel links a reference BLAS (a 512x576x1536 float32 matmul
takes ~358 ms); loading OpenBLAS with RTLD_GLOBAL *before* `import mlx.core`
makes MLX resolve `cblas_*` there (~11-22 ms). This module must not import MLX.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)

loaded_path: str | None = None
"""Path of the BLAS library that was preloaded, or None."""
gemv_shim: bool = False
"""Whether the GEMV-routing shim (csrc/gemv_shim.c) is in front of the BLAS."""

_SHIM_SRC = Path(__file__).with_name("csrc") / "gemv_shim.c"


def _build_shim() -> Path | None:
    """Compile the shim once into the user cache (keyed by its source hash)."""
    from engine.paths import cache_root

    src = _SHIM_SRC.read_bytes()
    out = cache_root() / "blas" / f"gemv_shim-{hashlib.sha256(src).hexdigest()[:12]}.so"
    if out.exists():
        return out
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(_SHIM_SRC), "-ldl", "-lpthread"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    os.replace(tmp, out)
    return out


def _load_with_shim(path: str) -> bool:
    if os.environ.get("KVCHAT_GEMV_SHIM", "1") == "0":
        return False
    shim_path = _build_shim()
    if shim_path is None:
        return False
    shim = ctypes.CDLL(str(shim_path), mode=ctypes.RTLD_GLOBAL)
    return shim.kvchat_blas_init(path.encode()) == 0


def preload() -> str | None:
    """Preload OpenBLAS on Linux unless MLX is already imported or it is disabled.

    Set ``KVCHAT_BLAS`` to a library path to choose one, or to ``none`` to skip;
    ``KVCHAT_GEMV_SHIM=0`` keeps OpenBLAS's own GEMM for matrix-vector products.
    Returns the loaded path (None on macOS, where MLX uses Accelerate).
    """
    global loaded_path, gemv_shim
    if loaded_path is not None or not sys.platform.startswith("linux"):
        return loaded_path
    if "mlx.core" in sys.modules:
        return None  # too late: MLX already bound its BLAS symbols
    choice = os.environ.get("KVCHAT_BLAS", "")
    if choice.lower() == "none":
        return None
    for path in (choice,) if choice else CANDIDATES:
        if os.path.exists(path):
            try:
                # The shim goes first so MLX binds its cblas_sgemm to the shim.
                gemv_shim = _load_with_shim(path)
                if not gemv_shim:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded_path = path
            return path
    return None

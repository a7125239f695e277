"""Load an optimized BLAS before MLX so the CPU backend's matmuls use it.

The `mlx[cpu]` Linux wheel links a reference BLAS (a 512x576x1536 float32 matmul
takes ~358 ms); loading OpenBLAS with RTLD_GLOBAL *before* `import mlx.core`
makes MLX resolve `cblas_*` there (~11-22 ms). This module must not import MLX.

`preload` runs when `engine` is imported, so it compiles nothing: besides the dlopen it
only reads what an earlier process left in the user cache, the compiled GEMV shim
(`engine.model.gemv_shim`, in front of OpenBLAS) and the core OpenBLAS detects on this CPU
(probed in a child process while none is recorded). `prepare_cache`, run when a model
is loaded, compiles the shim and records the core. MLX binds `cblas_sgemm` once it is
imported and OpenBLAS reads its core as it loads, so neither can change later in the
same process: the first process to load a model on a machine (per shim source) runs
without the shim, its matrix-vector products at OpenBLAS's GEMM speed (see the shim's
source), and every process after it starts with the shim.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from engine.model import gemv_shim as shim
from engine.paths import cache_root, is_private_dir, private_dir, read_private, write_private

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)

loaded_path: str | None = None
"""Path of the BLAS library that was preloaded, or None."""
gemv_shim: bool = False
"""Whether the GEMV-routing shim (`engine.model.gemv_shim`) is in front of the BLAS."""

# OpenBLAS names for the generic cores it falls back to on a CPU newer than its build
# (0.3.21 on an Emerald Rapids VM: "Prescott", SSE3 kernels, 5-6x slower GEMMs)
_GENERIC_CORES = {"prescott", "core2", "nehalem", "katmai", "coppermine", "northwood",
                  "banias", "atom", "unknown"}
_PROBE = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
          "lib.openblas_get_corename.restype = ctypes.c_char_p; "
          "print(lib.openblas_get_corename().decode())")


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags":
                    return model, set(value.split())
    except OSError:
        pass
    return model, set()


def _cpu_flags() -> set[str]:
    return _cpuinfo()[1]


def coretype_for(corename: str, flags: set[str]) -> str | None:
    """The OpenBLAS core to ask for when it detected a generic one on a CPU with AVX2 or
    AVX-512 (None: its own choice stands)."""
    if corename.strip().lower() not in _GENERIC_CORES:
        return None
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


_probed: tuple[Path, str] | None = None
"""(where to record it, the core) when this process probed one; `prepare_cache` writes it."""


def corename_path(path: str) -> Path:
    """Where the core that OpenBLAS at ``path`` detects is recorded: keyed by the library
    file and the CPU, as one cache directory may serve several machines."""
    st = os.stat(path)
    model, flags = _cpuinfo()
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{model}|{sorted(flags)}"
    return cache_root() / "blas" / f"corename-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _detected_core(path: str) -> str | None:
    """The core OpenBLAS at ``path`` picks on its own: recorded, or probed in a child (as
    loading it here is final); None if the probe fails."""
    global _probed
    try:
        record = corename_path(path)
    except OSError:
        return None
    data = read_private(record) if is_private_dir(record.parent) else None
    if data is not None:
        return data.decode(errors="replace").strip()
    try:
        out = subprocess.run([sys.executable, "-S", "-c", _PROBE, path], capture_output=True,
                             text=True, timeout=30, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    _probed = (record, out.stdout.strip())
    return _probed[1]


def _choose_coretype(path: str) -> None:
    """Set OPENBLAS_CORETYPE (read when the library loads) when OpenBLAS would fall back
    to a generic core on this x86 CPU."""
    if "OPENBLAS_CORETYPE" in os.environ or "libopenblas" not in path:
        return
    flags = _cpu_flags()
    if "avx2" not in flags:
        return
    corename = _detected_core(path)
    core = coretype_for(corename, flags) if corename is not None else None
    if core is not None:
        os.environ["OPENBLAS_CORETYPE"] = core


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
            _choose_coretype(path)
            try:
                # The shim goes first so MLX binds its cblas_sgemm to the shim.
                gemv_shim = shim.load(path)
                if not gemv_shim:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded_path = path
            return path
    return None


def prepare_cache() -> None:
    """Leave in the cache what `preload` looks for, for the processes after this one: the
    compiled shim and the core this process probed. Called when a model is loaded; cheap
    once both are there, and nothing when this process preloaded no OpenBLAS. Failures
    only cost the next process the speed-up."""
    global _probed
    if loaded_path is None:
        return
    if _probed is not None:
        record, corename = _probed
        with contextlib.suppress(OSError):
            private_dir(record.parent)
            if is_private_dir(record.parent):
                write_private(record, corename.encode())
                _probed = None
    if shim.wanted() and not gemv_shim:
        shim.build()

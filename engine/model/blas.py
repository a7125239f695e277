"""Load an optimized BLAS before MLX so the CPU backend's matmuls use it.

The `mlx[cpu]` Linux wheel links a reference BLAS (a 512x576x1536 float32 matmul
takes ~358 ms); loading OpenBLAS with RTLD_GLOBAL *before* `import mlx.core`
makes MLX resolve `cblas_*` there (~11-22 ms). This module must not import MLX.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
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
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def shim_path() -> Path:
    """Where the compiled shim is cached: the user cache, keyed by its source hash."""
    from engine.paths import cache_root

    digest = hashlib.sha256(_SHIM_SRC.read_bytes()).hexdigest()[:12]
    return cache_root() / "blas" / f"gemv_shim-{digest}.so"


def shim_is_trusted(path: Path) -> bool:
    """True when the shim at ``path`` may be loaded into the process (RTLD_GLOBAL).

    It must be a regular file, not a symlink, owned by us and not writable by group or
    others, in a directory that is likewise ours and private: anyone who could write
    either could run code in every kvchat process.
    """
    from engine.paths import is_private

    path = Path(path)
    try:
        return _dir_is_private(path.parent) and is_private(os.lstat(path))
    except OSError:
        return False


def _dir_is_private(path: Path) -> bool:
    from engine.paths import is_private

    try:
        return is_private(os.lstat(path), kind=stat.S_IFDIR)
    except OSError:
        return False


def _compile(out: Path) -> Path | None:
    """Compile the shim to ``out`` (in a private directory) via a kvchat-named temp file."""
    from engine.paths import temp_path

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    tmp = temp_path(out)
    cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(_SHIM_SRC), "-ldl", "-lpthread"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask; a shared object needs no more
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None
    return out


def build_shim() -> Path | None:
    """A shim that passes `shim_is_trusted`: the cached build, or a fresh private one.

    An untrusted cached file (group/world-writable, foreign, a symlink) is never loaded:
    it is rebuilt in place when the cache directory is ours and private, otherwise into a
    fresh private temp directory (the caller removes it once loaded). None if no compiler.
    """
    from engine.paths import private_dir

    out = shim_path()
    if shim_is_trusted(out):
        return out
    with contextlib.suppress(OSError):
        private_dir(out.parent)
    one_off = not _dir_is_private(out.parent)
    if one_off:  # foreign or loose: never chmod a directory we may not own; build elsewhere
        out = Path(tempfile.mkdtemp(prefix="kvchat-blas-")) / out.name
    built = _compile(out)
    if built is not None and shim_is_trusted(built):
        return built
    if one_off:
        shutil.rmtree(out.parent, ignore_errors=True)
    return None


def _dlopen_trusted(path: Path) -> ctypes.CDLL | None:
    """Load ``path`` RTLD_GLOBAL through a descriptor that was checked, so no swap slips in."""
    from engine.paths import is_private

    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    try:
        if not is_private(os.fstat(fd)):
            return None
        by_fd = f"/proc/self/fd/{fd}"
        return ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(path), mode=ctypes.RTLD_GLOBAL)
    finally:
        os.close(fd)


def _load_with_shim(path: str) -> bool:
    if os.environ.get("KVCHAT_GEMV_SHIM", "1") == "0":
        return False
    shim_file = build_shim()
    if shim_file is None:
        return False
    try:
        shim = _dlopen_trusted(shim_file)
    except OSError:
        return False  # plain BLAS still loads
    finally:
        if shim_file.parent != shim_path().parent:  # a one-off build: once mapped, not needed
            shutil.rmtree(shim_file.parent, ignore_errors=True)
    return shim is not None and shim.kvchat_blas_init(path.encode()) == 0


# OpenBLAS names for the generic cores it falls back to on a CPU newer than its build
# (0.3.21 on an Emerald Rapids VM: "Prescott", SSE3 kernels, 5-6x slower GEMMs)
_GENERIC_CORES = {"prescott", "core2", "nehalem", "katmai", "coppermine", "northwood",
                  "banias", "atom", "unknown"}
_PROBE = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
          "lib.openblas_get_corename.restype = ctypes.c_char_p; "
          "print(lib.openblas_get_corename().decode())")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


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


def _choose_coretype(path: str) -> None:
    """Set OPENBLAS_CORETYPE (read when the library loads) when OpenBLAS would fall back
    to a generic core on this x86 CPU; probed in a child, as loading it here is final."""
    if "OPENBLAS_CORETYPE" in os.environ or "libopenblas" not in path:
        return
    flags = _cpu_flags()
    if "avx2" not in flags:
        return
    try:
        out = subprocess.run([sys.executable, "-S", "-c", _PROBE, path], capture_output=True,
                             text=True, timeout=30, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    except (OSError, subprocess.SubprocessError):
        return
    core = coretype_for(out.stdout, flags) if out.returncode == 0 else None
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
                gemv_shim = _load_with_shim(path)
                if not gemv_shim:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded_path = path
            return path
    return None

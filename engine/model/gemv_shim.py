"""The GEMV shim: csrc/gemv_shim.c, compiled once into the user cache and loaded from there.

MLX's CPU backend sends every float32 matmul to ``cblas_sgemm``, the M == 1 products of a
decode step too, which OpenBLAS's GEMM runs well below its GEMV speed (the source says by
how much). Loaded RTLD_GLOBAL in front of OpenBLAS, before MLX, the shim routes those to
``cblas_sgemv``. Since it runs code in every kvchat process, only a build that passes
`shim_is_trusted` is ever loaded, and `load` never compiles: `build` does, when a model
is loaded (`engine.model.blas.prepare_cache`). This module must not import MLX.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from engine.paths import (
    cache_root,
    is_private,
    is_private_dir,
    is_trusted_file,
    private_dir,
    temp_path,
)

_SRC = Path(__file__).with_name("csrc") / "gemv_shim.c"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def wanted() -> bool:
    """False when ``KVCHAT_GEMV_SHIM=0`` keeps OpenBLAS's own GEMM for M == 1."""
    return os.environ.get("KVCHAT_GEMV_SHIM", "1") != "0"


def shim_path() -> Path:
    """Where the compiled shim is cached: the user cache, keyed by its source hash."""
    digest = hashlib.sha256(_SRC.read_bytes()).hexdigest()[:12]
    return cache_root() / "blas" / f"gemv_shim-{digest}.so"


def shim_is_trusted(path: Path) -> bool:
    """True when the shim at ``path`` may be loaded into the process (RTLD_GLOBAL).

    It must be a regular file, not a symlink, owned by us and not writable by group or
    others, in a directory that is likewise ours and private: anyone who could write
    either could run code in every kvchat process.
    """
    return is_trusted_file(Path(path))


def _compile(out: Path) -> Path | None:
    """Compile the shim to ``out`` (in a private directory) via a kvchat-named temp file."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    tmp = temp_path(out)
    cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(_SRC), "-ldl", "-lpthread"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask; a shared object needs no more
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return None
    return out


def build() -> Path | None:
    """The cached shim, compiled unless a build that passes `shim_is_trusted` is there.

    An untrusted cached file (group/world-writable, foreign, a symlink) is never loaded:
    it is rebuilt in place. None without a compiler, or when the cache directory is not
    ours and private: it is left alone (never chmodded), and as only the cached shim is
    ever loaded, a build elsewhere would serve no process.
    """
    out = shim_path()
    if shim_is_trusted(out):
        return out
    with contextlib.suppress(OSError):
        private_dir(out.parent)
    if not is_private_dir(out.parent):
        return None
    built = _compile(out)
    return built if built is not None and shim_is_trusted(built) else None


def _dlopen_trusted(path: Path) -> ctypes.CDLL | None:
    """Load ``path`` RTLD_GLOBAL through a descriptor that was checked, so no swap slips in."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    try:
        if not is_private(os.fstat(fd)):
            return None
        by_fd = f"/proc/self/fd/{fd}"
        return ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(path), mode=ctypes.RTLD_GLOBAL)
    finally:
        os.close(fd)


def load(blas_path: str) -> bool:
    """Put the cached shim in front of the BLAS at ``blas_path``; False (plain BLAS) when it
    is off, not built yet or not trusted. Never compiles."""
    if not wanted():
        return False
    shim_file = shim_path()
    if not shim_is_trusted(shim_file):
        return False
    try:
        shim = _dlopen_trusted(shim_file)
    except OSError:
        return False  # plain BLAS still loads
    return shim is not None and shim.kvchat_blas_init(blas_path.encode()) == 0

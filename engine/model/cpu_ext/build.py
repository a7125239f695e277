"""Build the C++ extension on first use, cache it, and fall back cleanly without it.

The extension (csrc/) is compiled on the machine that runs it (``-march=native``) with
the C++ compiler found there, against the installed MLX (headers and libmlx from the
wheel) and nanobind (ABI v22, the one MLX 0.32 was built with), and cached under
``cache_root()/cpu_ext/<digest>/`` where the digest covers the sources, flags, compiler,
MLX, nanobind, Python and CPU. A file lock keeps concurrent processes from building
twice. Any failure (no compiler, no nanobind, no Python headers, a compile error, an
import error) is said once as a warning and `available()` is False: the caller keeps
MLX's own path.

``KVCHAT_CPU_EXT=0`` turns the extension off; ``KVCHAT_CXX`` names the compiler.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import importlib.util
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from types import ModuleType

from engine.model import backend
from engine.model.cpu_ext.toolchain import (
    MODULE_NAME,
    BuildError,
    commands,
    digest,
    library_name,
    run,
    toolchain,
)
from engine.model.fallback import FallbackSwitch
from engine.paths import is_private_dir, is_trusted_file

ENV_SWITCH = "KVCHAT_CPU_EXT"
LOCK_TIMEOUT_S = 300  # waiting for another process's build (one takes ~0.5-2 min here)

_log = logging.getLogger("kvchat.cpu_ext")
_lock = threading.Lock()
_module: ModuleType | None = None
_off: str | None = None  # turned off by the environment: not a failure, nothing to warn
_failed = FallbackSwitch("kvchat.cpu_ext", "kvchat: CPU extension unavailable, using MLX's "
                         "own ops")
_tried = False
build_seconds: float | None = None
"""Wall time of this process's build, when it built one (None: cached or not built)."""
build_progress: tuple[int, int] | None = None
"""(steps done, steps) of this process's build while it runs: files compiled, then the link
(the chat's status line shows it); None when no build runs."""


def enabled() -> bool:
    """False when ``KVCHAT_CPU_EXT`` turns the extension off."""
    return not backend.switched_off(ENV_SWITCH)


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float):
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        deadline, said = time.monotonic() + timeout_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:  # a wait of minutes must not look like a hang
                    holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
                    _log.warning("kvchat: waiting for another kvchat process (pid %s) that is "
                                 "building the CPU extension; giving up after %.0f s", holder,
                                 timeout_s)
                    said = True
                if time.monotonic() > deadline:
                    raise BuildError(f"another process held {path} for over {timeout_s:.0f} s "
                                     "(still building the extension?)") from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # whoever waits can name the builder
        yield
    finally:
        os.close(fd)  # releases the lock


def _build(final: Path, compiles: list[list[str]], link: list[str], tmp_dir: Path) -> None:
    """Compile (two jobs: the build machines have 2 cores) and link, then move into place."""
    global build_seconds, build_progress
    start = time.monotonic()
    jobs = max(1, min(2, os.cpu_count() or 1))
    steps = len(compiles) + 1  # each file compiled, then the link
    build_progress = (0, steps)
    try:
        with ThreadPoolExecutor(jobs) as pool:
            for done, future in enumerate(as_completed([pool.submit(run, cmd)
                                                        for cmd in compiles]), 1):
                future.result()
                build_progress = (done, steps)
        run(link)
    finally:
        build_progress = None
    built = tmp_dir / library_name()
    os.chmod(built, 0o700)
    os.replace(built, final)
    build_seconds = time.monotonic() - start
    _log.info("kvchat: built the CPU extension in %.1f s (%s)", build_seconds, final)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:  # a few MB: read whole (file_digest needs Python 3.11)
        return hashlib.sha256(f.read()).hexdigest()


def _seal_path(final: Path) -> Path:
    return final.with_name(final.name + ".sha256")


def _seal(final: Path) -> None:
    """Write the built library's SHA-256 next to it (private), after it is in place."""
    seal = _seal_path(final)
    tmp = seal.with_name(seal.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0),
                 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(_sha256(final) + "\n")
    os.replace(tmp, seal)


def _sealed(final: Path) -> bool:
    """The library is ours, private, and byte for byte what was built: a damaged file
    (a bit flipped on disk, a truncated copy) would kill the process by a signal at load."""
    seal = _seal_path(final)
    if not (is_trusted_file(final) and is_trusted_file(seal)):
        return False
    try:
        return hmac.compare_digest(seal.read_text().strip(), _sha256(final))
    except OSError:
        return False


def library_path() -> Path:
    """Where this machine's build lives (it may not exist yet). Raises BuildError."""
    from engine.paths import cache_root

    cxx, mlx_dir, nb_dir, py_include = toolchain()
    compiles, _ = commands(cxx, mlx_dir, nb_dir, py_include, Path("/"))
    return cache_root() / "cpu_ext" / digest(cxx, compiles) / library_name()


def build() -> Path:
    """The extension's library path, building it now if needed. Raises BuildError."""
    from engine.paths import cache_root, private_dir

    cxx, mlx_dir, nb_dir, py_include = toolchain()
    root = private_dir(cache_root() / "cpu_ext")
    probe, _ = commands(cxx, mlx_dir, nb_dir, py_include, Path("/"))
    final = root / digest(cxx, probe) / library_name()
    # the library runs code in this process: ours, in a directory of ours, unwritable by
    # others, and the bytes that were built
    if _sealed(final):
        return final
    with _file_lock(root / "build.lock", LOCK_TIMEOUT_S):
        if _sealed(final):  # built by another process while we waited
            return final
        if final.exists():
            _log.warning("kvchat: the cached CPU extension %s is damaged or was built by an "
                         "older kvchat (no matching digest); rebuilding it", final)
            final.unlink()
        private_dir(final.parent)
        if not (is_private_dir(root) and is_private_dir(final.parent)):
            raise BuildError(f"{final.parent} is not private to this user; not building there")
        tmp_dir = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
        try:
            compiles, link = commands(cxx, mlx_dir, nb_dir, py_include, tmp_dir)
            _build(final, compiles, link, tmp_dir)
            _seal(final)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    if not is_trusted_file(final):
        raise BuildError(f"the built library at {final} is not private")
    return final


def _smoke_test(module: ModuleType) -> None:
    """One tiny qmm against MLX's own: catches an ABI or miscompile problem at load."""
    import mlx.core as mx

    w, s, b = mx.quantize(mx.arange(64 * 32, dtype=mx.float32).reshape(64, 32) / 997.0,
                          group_size=32, bits=4)
    x = mx.linspace(-1, 1, 64).reshape(2, 32)
    ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=32, bits=4)
    out = module.qmm(x, w, s, b, group_size=32, bits=4)
    if not mx.allclose(out, ref, rtol=1e-4, atol=1e-4).item():
        raise BuildError("the built extension computes wrong results (smoke test)")


def _import(path: Path) -> ModuleType:
    import mlx.core  # noqa: F401  (registers mx.array with nanobind first)

    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise BuildError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _smoke_test(module)
    return module


def load() -> ModuleType | None:
    """The extension module (built and imported once per process), or None with a reason."""
    global _module, _off, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if not enabled():
            _off = f"turned off by {ENV_SWITCH}=0"
            return None
        try:
            _module = _import(build())
        except Exception as e:  # noqa: BLE001 - any failure means: MLX's own path
            _failed.trip(str(e) if isinstance(e, BuildError) else f"{type(e).__name__}: {e}")
        return _module


def require() -> ModuleType:
    """The extension module; raises RuntimeError (with the reason) where it is unavailable."""
    module = load()
    if module is None:
        raise RuntimeError(f"the CPU extension is unavailable: {unavailable_reason()}")
    return module


def loaded() -> ModuleType | None:
    """The extension if this process already built and imported it; never builds."""
    return _module


def available() -> bool:
    """Whether the extension is built and imported (builds it on the first call)."""
    return load() is not None


def build_pending() -> bool:
    """Whether the next `load()` will compile the extension (its first use on this machine,
    on the CPU backend): callers say so, as it takes ~20-30 s."""
    if _tried or not enabled() or backend.backend() != "cpu":
        return False
    try:
        return not _sealed(library_path())
    except Exception:  # noqa: BLE001 - no compiler or nanobind: nothing will be built
        return False


def unavailable_reason() -> str | None:
    """Why `available()` is False; None when it is True or was not tried yet."""
    return None if _module is not None else (_off or _failed.reason)


def reset() -> None:
    """Forget the outcome so the next `load()` tries again (tests)."""
    global _module, _off, _tried
    with _lock:
        _module, _off, _tried = None, None, False
    _failed.reset()

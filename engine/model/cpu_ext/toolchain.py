"""The toolchain for the CPU extension: compiler, flags, build commands, cache digest.

Everything here only looks things up (the build itself is `build`): which C++ compiler,
which MLX (headers, libmlx) and nanobind (whose ABI tag must equal the one MLX's own
bindings carry, so mx.array passes between them), the compile and link commands, and
a digest of all that plus the CPU (the code is built with ``-march=native``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

MODULE_NAME = "_kvchat_cpu_ext"  # must match NB_MODULE in csrc/bindings.cpp
ENV_COMPILER = "KVCHAT_CXX"
BUILD_TIMEOUT_S = 600  # one compiler run; a loaded 2-core machine can be slow
CSRC = Path(__file__).with_name("csrc")
SOURCES = ("qmm.cpp", "qmm_tiled.cpp", "qmm_tiled_lanes.cpp", "qmm_tiled_int8.cpp",
           "qmm_tiled_int8_lanes.cpp", "kv_write.cpp", "kv_write_quant.cpp", "kv_write_sides.cpp",
           "qgemm.cpp",
           "channel_quant.cpp",
           "paged_attention.cpp", "paged_decode_kernel.cpp", "paged_prefill_kernel.cpp",
           "paged_residual.cpp", "paged_residual_kernel.cpp",
           "paged_residual_prefill.cpp", "norm_rope.cpp", "qkv_rope.cpp",
           "layer_ops.cpp",
           "layer_parts.cpp", "layer_stack.cpp",
           "gemma_tail.cpp", "switch_qmm.cpp", "tile_rows.cpp",
           "swiglu.cpp", "greedy.cpp", "embed_rows.cpp", "hadamard.cpp",
           "tensor.cpp", "pool.cpp", "bindings.cpp")


class BuildError(RuntimeError):
    """The extension could not be built or loaded here (the message says why)."""


def find_compiler() -> str | None:
    """The C++ compiler: ``$KVCHAT_CXX``, ``$CXX``, then c++, g++, clang++ on PATH."""
    for name in (os.environ.get(ENV_COMPILER), os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name:
            found = shutil.which(name)
            if found:
                return found
            if name == os.environ.get(ENV_COMPILER):
                return None  # an explicit choice that is missing: no silent substitute
    return None


def _arch_flags() -> list[str]:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return ["-march=native"]
    if machine in ("arm64", "aarch64"):
        return ["-mcpu=native"]
    return []


def _cpu_signature() -> str:
    """What -march=native depends on: a cached build must not move to another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return platform.machine() + ":" + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() + ":" + platform.processor()


def nanobind_abi(mlx_dir: Path, nb_dir: Path) -> None:
    """Raise BuildError when nanobind's ABI tag differs from the one MLX's bindings carry
    (then mx.array could not pass between them); silent when either cannot be read."""

    def first(pattern: bytes, paths) -> bytes | None:
        for path in paths:
            with contextlib.suppress(OSError):
                found = re.search(pattern, Path(path).read_bytes())
                if found:
                    return found.group(1)
        return None

    ours = first(rb"define NB_INTERNALS_VERSION (\d+)", [nb_dir / "src" / "nb_internals.h"])
    theirs = first(rb"nanobind_[a-z0-9_]+_v(\d+)\0", sorted(mlx_dir.glob("core*.so")))
    if ours and theirs and ours != theirs:
        raise BuildError(f"nanobind's ABI v{ours.decode()} differs from MLX's v{theirs.decode()}"
                         " (pip install 'nanobind>=3.0.1,<3.2' for MLX 0.32)")


def toolchain():
    """(compiler, mlx dir, nanobind dir, python include dir); raises BuildError."""
    cxx = find_compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set KVCHAT_CXX or install g++)")
    try:
        import nanobind
    except ImportError as e:
        raise BuildError("nanobind is not installed (pip install 'nanobind>=3.0.1,<3.2')") from e
    import mlx.core as mx

    mlx_dir = Path(mx.__file__).resolve().parent
    py_include = Path(sysconfig.get_paths()["include"])
    if not (py_include / "Python.h").is_file():
        raise BuildError(f"Python headers are missing ({py_include}/Python.h)")
    if not (mlx_dir / "include" / "mlx" / "primitives.h").is_file():
        raise BuildError(f"the MLX wheel has no C++ headers under {mlx_dir}/include")
    nb_dir = Path(nanobind.__file__).resolve().parent
    nanobind_abi(mlx_dir, nb_dir)
    return cxx, mlx_dir, nb_dir, py_include


def commands(cxx: str, mlx_dir: Path, nb_dir: Path, py_include: Path, out_dir: Path):
    """(compile commands, link command) for a build in ``out_dir``."""
    common = ["-fPIC", "-fvisibility=hidden", "-DNDEBUG", f"-I{nb_dir / 'include'}",
              f"-I{py_include}"]
    nb_cmd = [cxx, "-std=c++17", "-O2", *common, "-fno-strict-aliasing", "-DNB_BUILD",
              "-DNB_COMPACT_ASSERTIONS", f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}",
              "-c", str(nb_dir / "src" / "nb_combined.cpp"), "-o", str(out_dir / "nb.o")]
    ours = [cxx, "-std=gnu++20", "-O3", *_arch_flags(), *common, "-DNB_DOMAIN=mlx",
            f"-I{mlx_dir / 'include'}", "-w"]
    compiles = [nb_cmd] + [[*ours, "-c", str(CSRC / s), "-o", str(out_dir / (s + ".o"))]
                           for s in SOURCES]
    objects = [str(out_dir / "nb.o")] + [str(out_dir / (s + ".o")) for s in SOURCES]
    lib = mlx_dir / "lib"
    link = [cxx, "-shared", "-o", str(out_dir / library_name()), *objects, f"-L{lib}", "-lmlx",
            f"-Wl,-rpath,{lib}"]
    if sys.platform == "darwin":
        link += ["-undefined", "dynamic_lookup"]
    return compiles, link


def library_name() -> str:
    """The extension's file name for this Python (``_kvchat_cpu_ext.cpython-311-...so``)."""
    return MODULE_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def digest(cxx: str, cmds: list[list[str]]) -> str:
    """16 hex digits naming a build: sources, flags, compiler, MLX, nanobind, Python, CPU."""
    import mlx.core as mx
    import nanobind

    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "?"
    flags = [a for cmd in cmds for a in cmd if a.startswith("-") and not a.startswith("-I")]
    for part in (version, " ".join(flags), mx.__version__, nanobind.__version__,
                 sys.version, library_name(), _cpu_signature()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def run(cmd: list[str]) -> None:
    """Run one compiler command; BuildError with its first error line when it fails."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{Path(cmd[0]).name} failed to run: {e}") from e
    if proc.returncode != 0:
        first = next((ln for ln in proc.stderr.splitlines() if "error" in ln),
                     proc.stderr.strip()[-300:])
        raise BuildError(f"{Path(cmd[0]).name} exited {proc.returncode}: {first.strip()}")

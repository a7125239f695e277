"""Run the exact kernel source MLX generates on the CPU, as C++ with a shim.

Metal: the source comes from `metal_source.generated_metal_source` (export
tracing), is compiled with `msl_shim.h`, and runs one OS thread per lane.
CUDA: `cuda_generated_source` rebuilds the text `mx.fast.cuda_kernel` would
compile (mlx/backend/cuda/custom_kernel.cpp, build_kernel) and compiles it
against `cuda_include/` stand-ins. Several kernels share one binary; the
driver (shim_driver.cpp, compiled once per sanitizer and linked into each
binary) picks one by name from the input file.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

HARNESS_DIR = Path(__file__).resolve().parent
CXX = os.environ.get("CXX", "g++")
# -g1: line tables (sanitizer reports and backtraces keep file:line and function
# names) without full type debug info, which cost ~25% of every kernel build.
CXXFLAGS = ["-std=c++20", "-O1", "-g1", "-Wno-attributes", "-pthread"]
SANITIZER_FLAGS = {
    None: [],
    "address": ["-fsanitize=address", "-fno-omit-frame-pointer"],
    "thread": ["-fsanitize=thread"],
    # Shifts past the width, signed overflow, misaligned or null access: fail, not warn.
    "undefined": ["-fsanitize=undefined", "-fno-sanitize-recover=undefined"],
}
# How TG_ARRAY compiles: "checked" = the shim's memory-model-checked arrays;
# "real" = the backend header's own expansion (Metal `threadgroup T x[N]`, CUDA
# `__shared__ T x[N]`), so that text is compiled too.
TG_MODES = {"checked": [], "real": ["-DSHIM_REAL_TG_ARRAY"]}
MAX_NDIM_CUDA = 10  # MLX's MAX_NDIM: Shape/Strides are fixed-size arrays on CUDA


@dataclass(frozen=True)
class Param:
    """One kernel parameter: kind is input|shape|strides|ndim|output|attr."""

    name: str
    ctype: str
    kind: str
    base: str = ""  # the input a shape/strides/ndim parameter describes


@dataclass(frozen=True)
class KernelSource:
    backend: str  # "metal" | "cuda"
    name: str
    text: str
    params: tuple[Param, ...]
    template_call: str  # "<float16_t, 64, ...>" for Metal, "" for CUDA


@dataclass
class RunResult:
    returncode: int
    stderr: str
    outputs: list[bytes] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def tg_bytes(self) -> int:
        found = re.search(r"SHIM_TG_BYTES (\d+)", self.stderr)
        return int(found.group(1)) if found else -1


# ---- Metal ------------------------------------------------------------------

_METAL_PARAM = re.compile(r"^\s*(.+?)\s+(\w+)\s*\[\[(\w+)(?:\((\d+)\))?\]\],?\s*(?:\)\s*\{)?$")


def parse_metal(text: str, input_names: list[str], output_names: list[str]) -> KernelSource:
    """Parse a generated Metal kernel: name, parameters in order, template args."""
    head = re.search(r"\[\[kernel\]\] void (\w+)\(\n(.*?)\) \{\n", text, re.S)
    if head is None:
        raise ValueError("no [[kernel]] signature in the generated source")
    name, body = head.group(1), head.group(2)
    params = []
    for line in body.splitlines():
        found = _METAL_PARAM.match(line)
        if found is None:
            raise ValueError(f"unparsed parameter line: {line!r}")
        ctype, pname, attribute, _ = found.groups()
        params.append(_classify(pname, ctype, attribute != "buffer", input_names, output_names))
    inst = re.search(r"decltype\(" + re.escape(name) + r"(<[^)]*>)\)", text)
    return KernelSource("metal", name, text, tuple(params), inst.group(1) if inst else "")


def _classify(
    pname: str, ctype: str, is_attr: bool, input_names: list[str], output_names: list[str]
) -> Param:
    if is_attr:
        return Param(pname, ctype, "attr")
    if pname in input_names:
        return Param(pname, ctype, "input")
    if pname in output_names:
        return Param(pname, ctype, "output")
    for suffix in ("shape", "strides", "ndim"):
        base = pname.removesuffix("_" + suffix)
        if base != pname and base in input_names:
            return Param(pname, ctype, suffix, base)
    raise ValueError(f"unknown parameter {pname}")


def _metal_glue(src: KernelSource, index: int) -> str:
    args, buf = [], 0
    for p in src.params:
        if p.kind == "attr":
            args.append(f"metal::attr::{p.name}()")
            continue
        if p.ctype.endswith("&"):
            args.append(f"*({p.ctype[:-1]}*)B[{buf}]")
        else:
            args.append(f"({p.ctype})B[{buf}]")
        buf += 1
    call = f"{src.name}{src.template_call}(\n      " + ",\n      ".join(args) + ")"
    return (
        f"\nstatic void shim_thunk_{index}(void** B) {{\n  {call};\n}}\n"
        f'static shim::KernelRegistrar shim_reg_{index}("{src.name}", &shim_thunk_{index});\n'
    )


# ---- CUDA -------------------------------------------------------------------

_CUDA_TYPES = {
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint32: "uint32_t",
    mx.uint8: "uint8_t",
}
_TYPE_STRINGS = {mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.float32: "float"}


def cuda_generated_source(
    name: str,
    input_names: list[str],
    inputs: list[mx.array],
    output_names: list[str],
    output_dtypes: list[mx.Dtype],
    source: str,
    header: str,
    template: list[tuple[str, object]],
) -> KernelSource:
    """The text `mx.fast.cuda_kernel` compiles (MLX 0.32 build_kernel), and its params."""
    suffix = ""
    for _, arg in template:
        if isinstance(arg, bool):
            suffix += "_t" if arg else "_f"
        elif isinstance(arg, int):
            suffix += f"_{arg}"
        else:
            suffix += "_" + _TYPE_STRINGS[arg]
    kname = f"custom_kernel_{name}{suffix}"
    lines = [f"__global__ void {kname}("]
    params = []
    for iname, arr in zip(input_names, inputs, strict=True):
        lines.append(f"    const {_CUDA_TYPES[arr.dtype]}* {iname},")
        params.append(Param(iname, f"const {_CUDA_TYPES[arr.dtype]}*", "input"))
        if arr.ndim > 0:
            for suffix_name, ctype in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
                if f"{iname}_{suffix_name}" in source:
                    lines.append(f"    const __grid_constant__ {ctype} {iname}_{suffix_name},")
                    params.append(Param(f"{iname}_{suffix_name}", ctype, suffix_name, iname))
    for i, (oname, dtype) in enumerate(zip(output_names, output_dtypes, strict=True)):
        end = ",\n" if i < len(output_names) - 1 else ") {\n"
        lines.append(f"    {_CUDA_TYPES[dtype]}* {oname}" + end.rstrip("\n"))
        params.append(Param(oname, f"{_CUDA_TYPES[dtype]}*", "output"))
    consts = []
    for tname, arg in template:
        if isinstance(arg, bool):
            consts.append(f"  constexpr bool {tname} = {str(arg).lower()};")
        elif isinstance(arg, int):
            consts.append(f"  constexpr int {tname} = {arg};")
        else:
            consts.append(f"  using {tname} = {_CUDA_TYPES[arg]};")
    text = (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        + header
        + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        + "\n".join(lines)
        + "\n"
        + ("\n".join(consts) + "\n\n" if consts else "")
        + source
        + "\n}\n\n} // namespace mlx::core::cu\n"
    )
    return KernelSource("cuda", kname, text, tuple(params), "")


def _cuda_glue(src: KernelSource, index: int) -> str:
    args = []
    for buf, p in enumerate(src.params):
        if p.kind in ("shape", "strides"):
            args.append(f"*(const mlx::core::cu::{p.ctype}*)B[{buf}]")
        elif p.kind == "ndim":
            args.append(f"*(const int*)B[{buf}]")
        else:
            args.append(f"({p.ctype})B[{buf}]")
    call = f"mlx::core::cu::{src.name}(\n      " + ",\n      ".join(args) + ")"
    return (
        f"\nstatic void shim_thunk_{index}(void** B) {{\n  {call};\n}}\n"
        f'static shim::KernelRegistrar shim_reg_{index}("{src.name}", &shim_thunk_{index});\n'
    )


# ---- build and run ----------------------------------------------------------

_build_lock = threading.Lock()
_builds: dict[str, Path] = {}
_drivers: dict[str, Path] = {}
_driver_locks: dict[str, threading.Lock] = {}
DRIVER_SOURCE = HARNESS_DIR / "shim_driver.cpp"


def translation_unit(sources: list[KernelSource]) -> str:
    """One C++ file holding every kernel (distinct names; headers are guarded)."""
    backends = {s.backend for s in sources}
    assert len(backends) == 1, "one backend per binary"
    unique = list({s.name: s for s in sources}.values())
    if "metal" in backends:
        parts = ['#include "msl_shim.h"\n']
        for i, src in enumerate(unique):
            parts += [f"// ---- {src.name}\n", src.text, _metal_glue(src, i)]
        parts.append('#include "msl_shim_end.h"\n')
    else:
        parts = []
        for i, src in enumerate(unique):
            parts += [f"// ---- {src.name}\n", src.text, _cuda_glue(src, i)]
    parts.append("\nint main(int argc, char** argv) { return shim::driver_main(argc, argv); }\n")
    return "".join(parts)


def build(
    sources: list[KernelSource],
    out_dir: Path,
    *,
    sanitizer: str | None = None,
    tg_mode: str = "checked",
) -> Path:
    """Compile (cached by content) a driver binary containing `sources`.

    The kernels' translation unit is linked with the shim's driver object
    (`shim_driver.cpp`), which is compiled once per sanitizer and reused.
    """
    text = translation_unit(sources)
    flags = CXXFLAGS + SANITIZER_FLAGS[sanitizer] + TG_MODES[tg_mode]
    key = hashlib.sha1((text + " ".join(flags) + _shim_digest()).encode()).hexdigest()[:16]
    with _build_lock:
        cached = _builds.get(key)
        if cached is not None and cached.exists():
            return cached
    out_dir.mkdir(parents=True, exist_ok=True)
    driver = _driver_object(sanitizer, out_dir)
    cpp = out_dir / f"kernels_{key}.cpp"
    binary = out_dir / f"kernels_{key}_{sanitizer or 'plain'}_{tg_mode}"
    cpp.write_text(text)
    _compile([*flags, *_includes(), str(cpp), str(driver), "-o", str(binary)], cpp)
    with _build_lock:
        _builds[key] = binary
    return binary


def _driver_object(sanitizer: str | None, out_dir: Path) -> Path:
    """shim_driver.cpp compiled with this sanitizer's flags (once per session and flags)."""
    flags = CXXFLAGS + SANITIZER_FLAGS[sanitizer]
    key = hashlib.sha1((" ".join(flags) + _shim_digest()).encode()).hexdigest()[:16]
    with _build_lock:
        lock = _driver_locks.setdefault(key, threading.Lock())
    with lock:  # concurrent builds with the same flags wait for one compile
        cached = _drivers.get(key)
        if cached is not None and cached.exists():
            return cached
        out_dir.mkdir(parents=True, exist_ok=True)
        obj = out_dir / f"shim_driver_{key}_{sanitizer or 'plain'}.o"
        _compile([*flags, *_includes(), "-c", str(DRIVER_SOURCE), "-o", str(obj)], DRIVER_SOURCE)
        _drivers[key] = obj
        return obj


def _includes() -> list[str]:
    return ["-I", str(HARNESS_DIR), "-I", str(HARNESS_DIR / "cuda_include")]


def _compile(args: list[str], source: Path) -> None:
    proc = subprocess.run([CXX, *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"C++ build failed ({source}):\n{proc.stderr[-6000:]}")


def _shim_digest() -> str:
    files = sorted(HARNESS_DIR.rglob("*.h")) + sorted(HARNESS_DIR.rglob("*.cuh"))
    return hashlib.sha1(
        b"".join(f.read_bytes() for f in [*files, DRIVER_SOURCE])
    ).hexdigest()


def _bytes(arr: mx.array) -> bytes:
    if arr.dtype == mx.bfloat16:
        arr = arr.view(mx.uint16)
    return np.asarray(arr).tobytes()


def make_buffers(
    src: KernelSource, inputs: dict[str, mx.array], outputs: dict[str, tuple[tuple, mx.Dtype]]
) -> list[tuple[bool, bytes | int]]:
    """(is_output, data or nbytes) per buffer parameter, bound as MLX binds them."""
    pad = MAX_NDIM_CUDA if src.backend == "cuda" else 0
    buffers: list[tuple[bool, bytes | int]] = []
    for p in src.params:
        if p.kind == "attr":
            continue
        if p.kind == "input":
            buffers.append((False, _bytes(mx.contiguous(inputs[p.name]))))
        elif p.kind == "output":
            shape, dtype = outputs[p.name]
            buffers.append((True, int(np.prod(shape)) * dtype.size))
        else:
            base = inputs[p.base]
            if p.kind == "shape":
                vals = list(base.shape) + [0] * max(0, pad - base.ndim)
                buffers.append((False, np.asarray(vals, np.int32).tobytes()))
            elif p.kind == "strides":
                strides = [int(np.prod(base.shape[i + 1 :])) for i in range(base.ndim)]
                vals = strides + [0] * max(0, pad - base.ndim)
                buffers.append((False, np.asarray(vals, np.int64).tobytes()))
            else:
                buffers.append((False, np.asarray([base.ndim], np.int32).tobytes()))
    return buffers


def run(
    binary: Path,
    src: KernelSource,
    inputs: dict[str, mx.array],
    outputs: dict[str, tuple[tuple, mx.Dtype]],
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
    work_dir: Path,
    *,
    barrier_timeout_ms: int = 30000,
    timeout_s: float = 120.0,
) -> RunResult:
    """Run one kernel launch in the emulator; outputs come back as raw bytes."""
    if src.backend == "cuda":
        # cuda_kernel launches ceil(grid / block) full blocks.
        grid = tuple(-(-g // t) * t for g, t in zip(grid, threadgroup, strict=True))
    buffers = make_buffers(src, inputs, outputs)
    tag = hashlib.sha1(os.urandom(8)).hexdigest()[:12]
    in_path, out_path = work_dir / f"in_{tag}.bin", work_dir / f"out_{tag}.bin"
    with open(in_path, "wb") as f:
        f.write(b"KVEM" + struct.pack("<II", 1, len(src.name)) + src.name.encode())
        f.write(struct.pack("<3i3ii", *grid, *threadgroup, len(buffers)))
        for is_output, data in buffers:
            nbytes = data if is_output else len(data)
            f.write(struct.pack("<iq", int(is_output), nbytes))
            if not is_output:
                f.write(data)
    env = dict(os.environ, SHIM_BARRIER_TIMEOUT_MS=str(barrier_timeout_ms))
    env.setdefault("TSAN_OPTIONS", "halt_on_error=0 second_deadlock_stack=1")
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1")
    proc = subprocess.run(
        [str(binary), str(in_path), str(out_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
        check=False,
    )
    result = RunResult(proc.returncode, proc.stderr)
    if proc.returncode == 0:
        blob = out_path.read_bytes()
        offset = 0
        for is_output, nbytes in buffers:
            if is_output:
                result.outputs.append(blob[offset : offset + nbytes])
                offset += nbytes
    in_path.unlink(missing_ok=True)
    out_path.unlink(missing_ok=True)
    return result


def to_array(data: bytes, shape: tuple, dtype: mx.Dtype) -> mx.array:
    """Raw output bytes back into an MLX array."""
    if dtype == mx.bfloat16:
        return mx.array(np.frombuffer(data, np.uint16).reshape(shape)).view(mx.bfloat16)
    np_dtype = {mx.float16: np.float16, mx.float32: np.float32}[dtype]
    return mx.array(np.frombuffer(data, np_dtype).reshape(shape))

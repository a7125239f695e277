"""Convert a GGUF file into an MLX model directory.

The directory (safetensors in MLX affine format, config.json, tokenizer.json,
tokenizer_config.json) is what `mlx_lm.load` opens, so kvchat and mlx-lm run
the very same weights. What it relies on:
- gguf-py's reader (memory-mapped; metadata and each tensor's raw blocks);
- `gguf_quants`: Q4_0/Q4_1/Q4_K -> 4-bit, Q5_0/Q5_1/Q5_K -> 5-bit and Q8_0 -> 8-bit MLX
  affine tensors exactly, Q6_K re-quantized to 6 bits per 32; other types refused in one
  line; Q4_K/Q5_K steps per 256 weights also to `KQUANT_STEPS` (the tiled path's codes);
- `gguf_config`: llama, qwen2, qwen3, gemma3, phi3, qwen3moe onto mlx-lm's modules;
- the tokenizer from the metadata: kvchat's own byte-level BPE builder for the GPT-2-style
  vocabularies it was written for, transformers' GGUF converter for the rest.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from engine.errors import ModelLoadError
from engine.model import gguf_config, gguf_quants
from engine.model.fingerprint import file_digest
from engine.model.gguf_config import rename_tensor
from engine.model.gguf_tokenizer import build_tokenizer, tokenizer_config
from engine.model.safetensors_stream import SafetensorsWriter
from engine.paths import (
    cache_root,
    is_private_tree,
    private_dir,
    remove_own,
    temp_path,
    write_private,
)

# Bumped when the conversion changes what it writes: a new directory, not a stale one.
CONVERTER_VERSION = 4
# Q4_K/Q5_K tensors' steps per 256 weights (`gguf_quants.k_steps`), beside the model: not a
# model*.safetensors file, so mlx-lm's loader never sees them.
KQUANT_STEPS = "kquant_steps.safetensors"


def _write_tree(out_dir: Path, write) -> None:
    """``write(tmp)`` fills a fresh private temp dir, which then becomes ``out_dir``."""
    private_dir(out_dir.parent)
    tmp = temp_path(out_dir)
    os.mkdir(tmp, 0o700)
    try:
        os.chmod(tmp, 0o700)  # exact, whatever the umask
        write(tmp)
        if is_private_tree(out_dir, required="config.json"):
            return  # another process converted the same file meanwhile; keep what it loads
        remove_own(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise  # not just another process that converted the same file first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read(gguf_path: Path) -> tuple[dict, list]:
    """The file's metadata (scalars as Python values, number arrays as numpy, string
    arrays as lists) and its tensors (gguf-py `ReaderTensor`s, memory-mapped)."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(str(gguf_path))
        meta = {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            value = field.contents()
            if (field.types and field.types[0] == GGUFValueType.ARRAY and len(field.types) > 1
                    and field.types[-1] != GGUFValueType.STRING):
                value = np.asarray(value)
            meta[name] = value
    except Exception as e:  # bad magic, truncated, inconsistent offsets, ...
        raise ModelLoadError(f"not a valid GGUF file: {gguf_path} (corrupt or truncated: "
                             f"{type(e).__name__}: {' '.join(str(e).split())[:160]})") from e
    return meta, reader.tensors


def _matrix(t) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def _raw(f, t):
    """Tensor ``t``'s bytes read from the open file ``f``: a read, not the reader's memory
    map, so the pages of tensors already converted do not stay in this process's RSS."""
    import numpy as np

    f.seek(int(t.data_offset))
    raw = np.frombuffer(f.read(int(t.n_bytes)), dtype=np.uint8)
    if raw.size != int(t.n_bytes):
        raise ModelLoadError(f"GGUF tensor {t.name} is cut short (truncated file)")
    return raw


def convert_tensor(t, raw, arch: str) -> tuple[list, dict]:
    """One GGUF tensor (``raw``: its bytes) as [(mlx-lm name, numpy array, safetensors
    dtype)] and its config.json ``quantization`` entry: quantized blocks as MLX affine
    ``weight``/``scales``/``biases`` ({layer: group, bits}; 3-D experts stacked per
    expert), float tensors as they are (gemma3 norms less 1; no entry). A Q4_K/Q5_K
    tensor adds its ``scales_step`` and ``biases_step`` (`gguf_quants.k_steps`), which
    `convert` writes to `KQUANT_STEPS`."""
    import numpy as np

    kind = t.tensor_type.name
    name = rename_tensor(t.name, arch)
    shape = _matrix(t)
    if kind not in gguf_quants.SUPPORTED:
        raise ModelLoadError(
            f"GGUF tensor {t.name} is {kind}: kvchat reads {', '.join(gguf_quants.SUPPORTED)} "
            "(re-quantize the file with llama-quantize, e.g. to Q4_K_M)")
    if kind in gguf_quants.FLOATS:
        arr = raw.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[kind])
        arr = arr.reshape(shape)
        if gguf_config.is_norm(arch, t.name):
            if kind == "BF16":  # bfloat16 bits are the high half of a float32's
                arr = (arr.astype(np.uint32) << 16).view(np.float32)
            return [(name, arr.astype(np.float32) - 1.0, None)], {}
        return [(name, arr, "BF16" if kind == "BF16" else None)], {}
    if len(shape) not in (2, 3):
        raise ModelLoadError(f"GGUF tensor {t.name}: a quantized tensor of shape {shape}")
    # experts (n, rows, columns): blocks never span rows, so the n matrices convert as one
    # of n * rows rows, each row exactly as in its own 2-D matrix
    matrix = (int(np.prod(shape[:-1])), shape[-1])
    w, scales, biases, bits = gguf_quants.to_affine(kind, raw, matrix)
    w, scales, biases = (a.reshape(*shape[:-1], a.shape[-1]) for a in (w, scales, biases))
    base = name.removesuffix(".weight")
    arrays = [(name, w, None), (f"{base}.scales", scales, None), (f"{base}.biases", biases, None)]
    steps = gguf_quants.k_steps(kind, raw, matrix)
    if steps is not None:
        for side, step in zip(("scales", "biases"), steps, strict=True):
            arrays.append((f"{base}.{side}_step", step.reshape(*shape[:-1], -1), None))
    return arrays, {base: {"group_size": gguf_quants.GROUP, "bits": bits}}


def convert(gguf_path: Path, out_dir: Path) -> Path:
    """Write the MLX model directory for ``gguf_path`` to ``out_dir`` atomically.

    The directory and every file in it are private (0700 / 0600) whatever the umask.
    Tensors are converted and written one at a time (`SafetensorsWriter`): the peak is
    one tensor's conversion, not the model's.

    Raises:
        ModelLoadError: the file is not a valid GGUF file, or not a supported model.
    """
    import numpy as np

    meta, tensors = read(gguf_path)
    if "general.architecture" not in meta or "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(f"not a valid GGUF file: {gguf_path} (no model metadata)")
    arch = gguf_config.check_architecture(meta["general.architecture"])

    def write(tmp: Path) -> None:
        names, quantization, extra = set(), {}, {}
        writer = SafetensorsWriter(tmp / "model.safetensors")
        steps = SafetensorsWriter(tmp / KQUANT_STEPS)
        try:
            with open(gguf_path, "rb") as f:
                for t in tensors:
                    if t.name in gguf_config.CONFIG_TENSORS:
                        extra[t.name] = np.asarray(t.data, dtype=np.float32)
                        continue
                    arrays, quant = convert_tensor(t, _raw(f, t), arch)
                    for name, arr, dtype in arrays:
                        if name.endswith("_step"):
                            steps.add(name, arr, dtype)
                            continue
                        writer.add(name, arr, dtype)
                        names.add(name)
                    quantization.update(quant)
                    del arrays  # before the next tensor's conversion
        except BaseException:
            writer.abort()
            steps.abort()
            raise
        writer.close({"format": "mlx"})
        steps.close({"format": "kvchat-kquant-steps"}) if len(steps) else steps.abort()
        config = gguf_config.model_config(meta, names, quantization, extra)
        files = {
            "config.json": json.dumps(config, indent=2),
            "tokenizer.json": build_tokenizer(meta, gguf_path).to_str(pretty=True),
            "tokenizer_config.json": json.dumps(tokenizer_config(meta), indent=2),
            "generation_config.json": json.dumps({"eos_token_id": config["eos_token_id"]}),
        }
        for name, data in files.items():
            write_private(tmp / name, data.encode())

    try:
        _write_tree(out_dir, write)
    except OSError as e:
        raise ModelLoadError(f"cannot write the converted model to {out_dir}: {e}") from e
    return out_dir


def check_header(path: Path) -> None:
    """Reject files that are not GGUF v2/v3 before any native reader sees them."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise ModelLoadError(f"not a valid GGUF file: {path} (bad magic)")
    version, num_tensors, num_kv = struct.unpack("<IQQ", head[4:])
    if version not in (2, 3):
        raise ModelLoadError(f"not a valid GGUF file: {path} (unsupported version {version})")
    if num_tensors > size // 16 or num_kv > size // 8:
        raise ModelLoadError(f"not a valid GGUF file: {path} (corrupt header)")


# The child reports a ModelLoadError on one marked stderr line; anything else it prints
# (warnings, a native crash) is never taken for the reason.
_ERROR_MARK = "kvchat-gguf-error: "


def _child_code() -> str:
    # -c, not -m: the package already imports engine.model.gguf, and runpy warns about it
    # on stderr. The path goes first so the child runs this very code, whatever its cwd.
    root = str(Path(__file__).resolve().parents[2])
    return (f"import sys; sys.path.insert(0, {root!r})\n"
            "from engine.model.gguf import child_main\n"
            "sys.exit(child_main(sys.argv[1:]))\n")


def _child_failure(gguf_path: Path, proc: subprocess.CompletedProcess) -> ModelLoadError:
    for line in reversed(proc.stderr.splitlines()):
        if line.startswith(_ERROR_MARK):
            return ModelLoadError(line[len(_ERROR_MARK):])
    if proc.returncode < 0:
        reason = f"the GGUF reader crashed with signal {-proc.returncode}"
    else:
        reason = f"the converter exited with status {proc.returncode}"
    return ModelLoadError(f"not a valid GGUF file: {gguf_path} ({reason})")


def converted_dir(gguf_path: Path, root: Path | None = None) -> Path:
    """The MLX directory for a GGUF file, converting it once (keyed by content hash).

    The conversion runs in a child process: MLX's native GGUF reader can crash
    (SIGSEGV) on a corrupt file, and a bad file must never take the app down.

    Raises:
        ModelLoadError: missing or corrupt file ("not a valid GGUF file: <path> (<reason>)"),
            an unsupported model, or the converted directory cannot be written.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    check_header(gguf_path)
    digest = file_digest(gguf_path)[:16]
    out = (root or cache_root() / "models") / f"{gguf_path.stem}-{digest}-v{CONVERTER_VERSION}"
    if not is_private_tree(out, required="config.json"):
        try:
            private_dir(out.parent)
        except OSError as e:
            raise ModelLoadError(f"cannot create {out.parent}: {e}") from e
        proc = subprocess.run(
            [sys.executable, "-c", _child_code(), str(gguf_path), str(out)],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            raise _child_failure(gguf_path, proc)
        _drop_other_versions(out)
    return out


def _drop_other_versions(out: Path) -> None:
    """Remove other converter versions' directories of the same file (as big as the model,
    never read again); one not ours or not a conversion stays."""
    stem = out.name.rsplit("-v", 1)[0]
    for old in out.parent.glob(f"{glob.escape(stem)}-v*"):
        if old != out and old.name[len(stem) + 2:].isdigit() and is_private_tree(old):
            with contextlib.suppress(OSError):
                remove_own(old)


def child_main(argv: list[str]) -> int:
    """Entry point of the conversion child: ``<gguf path> <out dir>``; 0 on success."""
    gguf_path, out_dir = Path(argv[0]), Path(argv[1])
    try:
        convert(gguf_path, out_dir)
    except ModelLoadError as e:
        print(_ERROR_MARK + " ".join(str(e).split()), file=sys.stderr)
        return 2
    except Exception as e:  # malformed metadata surfacing as KeyError, TypeError, ...
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        print(f"{_ERROR_MARK}not a valid GGUF file: {gguf_path} ({reason})", file=sys.stderr)
        return 2
    return 0

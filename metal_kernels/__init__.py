"""Kernel sources for `mx.fast.metal_kernel` / `mx.fast.cuda_kernel` (no MLX import here).

- `paged_attention.metal`: body of the paged decode-attention kernel (plain MSL;
  the same text compiles as CUDA through `cuda_backend.h`), for float or
  4/8-bit quantized K and V, each side chosen by template values;
- `paged_decode_split.metal` / `paged_decode_reduce.metal`: the two-pass
  (split-K) variant for long contexts: partial softmax per partition of
  tokens, one threadgroup serving all query heads of a KV head (shared K/V
  loads), then a merge of the partitions;
- `paged_residual.metal`: decode over a residual-format pool (keys per channel within a
  block, values per token, each row's own block exact from the residual rows);
- `metal_backend.h` / `cuda_backend.h`: per-backend builtins and helpers;
- `common.h`: backend-neutral helpers, placed after the backend header,
  among them the K/V row reader that dequantizes in registers.
"""

from __future__ import annotations

from importlib import resources

BACKENDS = ("metal", "cuda")

# The MLX releases whose generated kernel source (signature, buffer binding,
# CUDA wrapper) the golden tests and the emulator were checked against. The
# same range is pinned in pyproject.toml; widen both only after the golden
# tests pass on the new release (tests/test_kernels_source.py).
MLX_RANGE = (">=0.32", "<0.33")
_MLX_LOW, _MLX_HIGH = (0, 32), (0, 33)


def mlx_range_text() -> str:
    """The pinned range as pip writes it, e.g. "mlx>=0.32,<0.33"."""
    return "mlx" + ",".join(MLX_RANGE)


def mlx_version_checked(version: str) -> bool:
    """Whether MLX `version` (e.g. "0.32.4", "0.33.0.dev1") lies in the checked range."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return _MLX_LOW <= tuple(parts) < _MLX_HIGH


def read_source(name: str) -> str:
    """Text of one kernel source file in this package, e.g. `read_source("common.h")`."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def kernel_header(backend: str) -> str:
    """The `header=` string for `backend`: its backend header, then `common.h`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    return read_source(f"{backend}_backend.h") + "\n" + read_source("common.h")

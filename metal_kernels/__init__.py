"""Kernel sources for `mx.fast.metal_kernel` / `mx.fast.cuda_kernel` (no MLX import here).

- `paged_attention.metal`: body of the paged decode-attention kernel (plain MSL;
  the same text compiles as CUDA through `cuda_backend.h`), for float or
  4/8-bit quantized K and V, each side chosen by template values;
- `metal_backend.h` / `cuda_backend.h`: per-backend builtins and helpers;
- `common.h`: backend-neutral helpers, placed after the backend header,
  among them the K/V row reader that dequantizes in registers.
"""

from __future__ import annotations

from importlib import resources

BACKENDS = ("metal", "cuda")


def read_source(name: str) -> str:
    """Text of one kernel source file in this package, e.g. `read_source("common.h")`."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def kernel_header(backend: str) -> str:
    """The `header=` string for `backend`: its backend header, then `common.h`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    return read_source(f"{backend}_backend.h") + "\n" + read_source("common.h")

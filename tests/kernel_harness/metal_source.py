"""The exact Metal source MLX would compile for the paged decode kernel, without Metal.

Test tooling (not part of engine.model.attention.gpu): it traces the launch with
`mx.export_function`, which records custom kernels on a placeholder GPU
stream, and captures MLX's `verbose=True` print at the fd level.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable, Sequence

import mlx.core as mx

from engine.model.attention import spec
from engine.model.attention.gpu import abi, one_pass

_FENCE = re.compile(r"Generated source code for `([^`]+)`:\n```\n(.*?)\n```", re.S)


def generated_metal_source(
    queries: mx.array,
    k_pool: spec.Pool,
    v_pool: spec.Pool,
    block_tables: mx.array,
    context_lens: Sequence[int] | mx.array,
    scale: float,
    *,
    body: str | None = None,
    header: str | None = None,
    name: str = one_pass.KERNEL_NAME,
    num_simdgroups: int = abi.NUM_SIMDGROUPS,
) -> str:
    """The generated Metal source for these inputs, launched as the engine launches it."""
    kernel = one_pass.make_paged_decode_kernel("metal", body=body, header=header, name=name)
    inputs = abi.kernel_inputs(queries, k_pool, v_pool, block_tables, context_lens, scale)
    # From the pools, before tracing: the traced args are the flat arrays.
    template = abi.template_args(queries, k_pool, v_pool, num_simdgroups=num_simdgroups)
    q = inputs[0]
    grid, threadgroup = one_pass.launch_dims(q, num_simdgroups=num_simdgroups)
    return traced_metal_source(
        kernel,
        inputs,
        template=template,
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )


def traced_metal_source(kernel, inputs: list[mx.array], **launch: object) -> str:
    """The Metal source MLX generates when `kernel` is launched on `inputs` with `launch`."""

    def fn(*args: mx.array) -> list[mx.array]:
        return kernel(inputs=list(args), verbose=True, **launch)

    with tempfile.TemporaryDirectory() as tmp:
        text = _capture_stdout_fd(
            lambda: mx.export_function(os.path.join(tmp, "trace.mlxfn"), fn, *inputs)
        )
    found = _FENCE.findall(text)
    if len(found) != 1:
        raise RuntimeError(f"expected one generated kernel in the trace, got {len(found)}")
    return found[0][1] + "\n"


def _capture_stdout_fd(action: Callable[[], object]) -> str:
    """Run `action` with file descriptor 1 redirected to a temp file; return what it wrote."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        try:
            os.dup2(sink.fileno(), 1)
            action()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        return sink.read().decode("utf-8", errors="replace")

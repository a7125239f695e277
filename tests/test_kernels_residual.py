"""The GPU decode kernel over a residual pool (metal_kernels/paged_residual.metal) without
a GPU: the kernel callable is replaced by the emulator (the exact Metal source MLX would
compile for each launch, or the CUDA text, built as C++ and run one thread per lane), and
the engine's own dispatch launches it. Outputs are held to a float64 oracle of the stored
bytes by the rule (the CPU tests' `oracle`): the kernel accumulates in float32 and the
rotations around it run in float32, so the float32 bound is the plain kernel's 1e-5;
float16 queries and outputs round once (2e-3, the plain kernel's float16 bound)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kernel_harness import emulator, metal_source
from test_cpu_ext_residual import LENS, make_pool, oracle

from engine.model import backend
from engine.model.attention import AttentionSpec, dispatch, guard, paged_attention, routes
from engine.model.attention.gpu import residual as gpu_residual
from engine.model.attention.spec import PagedCall
from metal_kernels import kernel_header, read_source

TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3}


class EmulatedKernel:
    """Stands in for the built kernel: each launch traces the source MLX would compile on
    ``target`` for these inputs, builds it with the emulator (cached by its text) and runs
    it."""

    def __init__(self, work_dir, target: str = "metal"):
        self.work_dir, self.target, self.launches = work_dir, target, []

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes,
                 **_):
        names, outs = gpu_residual.INPUT_NAMES, gpu_residual.OUTPUT_NAMES
        if self.target == "metal":
            text = metal_source.traced_metal_source(
                gpu_residual.make_kernel("metal"), inputs, template=template, grid=grid,
                threadgroup=threadgroup, output_shapes=output_shapes,
                output_dtypes=output_dtypes)
            src = emulator.parse_metal(text, names, outs)
        else:
            src = emulator.cuda_generated_source(
                gpu_residual.KERNEL_NAME, names, inputs, outs, output_dtypes,
                read_source("paged_residual.metal"), kernel_header("cuda"), template)
        binary = emulator.build([src], self.work_dir)
        result = emulator.run(binary, src, dict(zip(names, inputs, strict=True)),
                              {"out": (output_shapes[0], output_dtypes[0])}, grid,
                              threadgroup, self.work_dir)
        assert result.ok, result.stderr[-4000:]
        self.launches.append(src)
        return [emulator.to_array(result.outputs[0], output_shapes[0], output_dtypes[0])]


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("residual_emulation")


@pytest.fixture
def gpu(monkeypatch, work_dir):
    """A faked Metal backend whose residual kernel is the emulator; the guard fresh."""
    monkeypatch.delenv(backend.KERNELS_SWITCH, raising=False)
    monkeypatch.setattr(backend, "kernel_backend", lambda: "metal")
    kernel = EmulatedKernel(work_dir)
    monkeypatch.setattr(gpu_residual, "_kernel", lambda name: kernel)
    guard.GUARD.reset()
    yield kernel
    guard.GUARD.reset()


def check(out: mx.array, want: np.ndarray, dtype) -> None:
    got = np.array(out.astype(mx.float32), dtype=np.float64)
    err = np.abs(got - want).max()
    assert err <= TOLERANCE[dtype] * max(1.0, np.abs(want).max()), err


@pytest.mark.parametrize("k_bits,v_bits,rot,dtype", [(4, 4, 1, mx.float32),
                                                      (8, 4, 0, mx.float32),
                                                      (8, 8, 1, mx.float16)])
def test_dispatch_runs_the_kernel_by_the_rule(gpu, k_bits, v_bits, rot, dtype):
    """Lengths inside a first block, just filling one (still exact in its step), mid-block
    and long; through `paged_attention` as the engine calls it, the first launch checked
    against the reference by the guard (which must not trip)."""
    kv, table = make_pool(LENS, k_bits, v_bits, rot, seed=k_bits + v_bits + rot)
    q = mx.random.normal((len(LENS), 9, 1, 64), key=mx.random.key(3)).astype(dtype)
    kp, vp = kv.block_view(0)
    call = PagedCall(q, kp, vp, table, tuple(LENS), AttentionSpec(0.125))
    assert routes.route(call, "metal").path == "gpu_residual" and gpu_residual.supports(call)
    out = paged_attention(q, kp, vp, table, LENS, 0.125)
    assert len(gpu.launches) == 1 and not guard.GUARD.switch.tripped
    assert out.dtype == dtype
    check(out, oracle(q, kv, table, LENS, 0.125), dtype)


def test_windows_and_sinks(gpu):
    kv, table = make_pool(LENS, 4, 4, 1, seed=5)
    q = mx.random.normal((len(LENS), 9, 1, 64), key=mx.random.key(6))
    sinks = mx.random.normal((9,), key=mx.random.key(7))
    spec = AttentionSpec(0.125, 40, sinks=sinks)
    kp, vp = kv.block_view(0)
    out = paged_attention(q, kp, vp, table, LENS, spec)
    assert len(gpu.launches) == 1 and not guard.GUARD.switch.tripped
    check(out, oracle(q, kv, table, LENS, 0.125, sinks=np.array(sinks), window=40), mx.float32)


def test_a_bad_block_id_poisons_its_sequence_only(gpu):
    kv, table = make_pool([40, 40], 8, 8, 1, seed=7)
    bad = mx.array([[int(table[0, 0]), 10_000, int(table[0, 2])], table[1].tolist()],
                   dtype=mx.int32)
    q = mx.random.normal((2, 9, 1, 64), key=mx.random.key(5))
    kp, vp = kv.block_view(0)
    out = gpu_residual.launch(q, kp, vp, bad, [40, 40], 0.125)
    assert mx.all(mx.isnan(out[0])).item() and not mx.any(mx.isnan(out[1])).item()
    check(out[1:], oracle(q[1:], kv, table[1:], [40], 0.125), mx.float32)


def test_the_cuda_text_runs_alike(work_dir, monkeypatch):
    monkeypatch.setattr(backend, "kernel_backend", lambda: "cuda")
    kernel = EmulatedKernel(work_dir, "cuda")
    monkeypatch.setattr(gpu_residual, "_kernel", lambda name: kernel)
    kv, table = make_pool(LENS, 4, 8, 1, seed=11)
    q = mx.random.normal((len(LENS), 9, 1, 64), key=mx.random.key(12))
    kp, vp = kv.block_view(0)
    out = gpu_residual.launch(q, kp, vp, table, LENS, 0.125)
    assert kernel.launches[0].backend == "cuda"
    check(out, oracle(q, kv, table, LENS, 0.125), mx.float32)


def test_calls_the_kernel_does_not_read_take_other_paths():
    kv, table = make_pool([20], 4, 4, 1)
    kp, vp = kv.block_view(0)
    q = mx.zeros((1, 9, 1, 64))
    assert gpu_residual.supports(PagedCall(q, kp, vp, table, (20,), AttentionSpec(0.125)))
    chunk = PagedCall(mx.zeros((1, 9, 4, 64)), kp, vp, table, (20,), AttentionSpec(0.125))
    assert not gpu_residual.supports(chunk)  # a prefill chunk: the reference on the GPU
    assert routes.route(chunk, "metal").path == "reference"
    assert dispatch.KERNEL_PATHS["gpu_residual"].rotates
    with pytest.raises(RuntimeError, match="no Metal or CUDA"):
        gpu_residual.launch(q, kp, vp, table, [20], 0.125)


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal (Apple GPU)")
@pytest.mark.parametrize("k_bits,v_bits,rot", [(4, 4, 1), (8, 8, 1), (8, 4, 0)])
def test_the_real_metal_kernel_by_the_rule(k_bits, v_bits, rot):
    """On an Apple GPU: the compiled kernel itself, float32 queries, against the oracle."""
    kv, table = make_pool(LENS, k_bits, v_bits, rot, seed=2)
    q = mx.random.normal((len(LENS), 9, 1, 64), key=mx.random.key(9))
    kp, vp = kv.block_view(0)
    check(gpu_residual.launch(q, kp, vp, table, LENS, 0.125), oracle(q, kv, table, LENS, 0.125),
          mx.float32)


def test_the_body_passes_the_msl_lint():
    """What g++ accepts but Metal rejects, lane-divergent simd_sum, threadgroup memory at
    the engine's tiling and the largest head dim."""
    from kernel_harness import msl_lint

    text = kernel_header("metal") + read_source("paged_residual.metal")
    assert msl_lint.lint_msl(text) == []
    assert msl_lint.threadgroup_bytes(text, {"NSG": 8, "D": 256}) <= msl_lint.MAX_THREADGROUP_BYTES

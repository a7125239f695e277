"""`paged_attention`: the route table's path, behind the guard, or the reference."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import mlx.core as mx

from engine.kvcache import rotation
from engine.kvcache.quantized_blocks import QuantizedBlocks
from engine.model import backend
from engine.model.attention import cpu, cpu_residual, reference, residual, routes
from engine.model.attention.gpu import abi, one_pass, two_pass
from engine.model.attention.gpu import residual as gpu_residual
from engine.model.attention.guard import GUARD
from engine.model.attention.spec import AttentionSpec, PagedCall, Pool


@dataclass(frozen=True)
class KernelPath:
    """A kernel the route table can name: whether it takes a call, its launch, its variant."""

    ready: Callable[[PagedCall], bool]
    launch: Callable[..., mx.array]  # the kernel entry point, fed `PagedCall.args()`
    variant: Callable[[PagedCall], tuple]  # what the first-launch check tells apart, per backend
    rotates: bool = False  # launch takes ``rotated=(K, V)`` and rotates inside (no extra ops)


def _cpu_ready(call: PagedCall) -> bool:
    return cpu.available() and cpu.supports(call.queries, call.k_pool, call.v_pool)


def _gpu_ready(call: PagedCall) -> bool:
    return abi.supports(call.queries, call.k_pool, call.v_pool)


def _gpu_variant(kind: str) -> Callable[[PagedCall], tuple]:
    def key(call: PagedCall) -> tuple:
        return abi.variant_key(call.queries, call.k_pool, call.v_pool, call.block_tables, kind)
    return key


def _cpu_launch(*args, rotated=(False, False)) -> mx.array:
    fn = cpu.paged_decode if args[0].shape[2] == 1 else cpu.paged_prefill
    return fn(*args, rotated=rotated) if any(rotated) else fn(*args)


def _cpu_residual_ready(call: PagedCall) -> bool:
    return cpu.available() and cpu_residual.supports(call)


KERNEL_PATHS: dict[str, KernelPath] = {
    "cpu": KernelPath(_cpu_ready, _cpu_launch, cpu.variant_key, rotates=True),
    # a residual pool carries its own rotation (`ResidualBlocks.rotated`): rotated is (F, F)
    "cpu_residual": KernelPath(_cpu_residual_ready, cpu_residual.launch,
                               cpu_residual.variant_key, rotates=True),
    "one_pass": KernelPath(_gpu_ready, lambda *a: one_pass.paged_decode_attention(*a),
                           _gpu_variant("one_pass")),
    "two_pass": KernelPath(_gpu_ready, lambda *a: two_pass.paged_decode_two_pass(*a),
                           _gpu_variant("two_pass")),
    # the pool's own rotation is met inside the launch, as on the CPU
    "gpu_residual": KernelPath(gpu_residual.supports,
                               lambda *a, **kw: gpu_residual.launch(*a, **kw),
                               gpu_residual.variant_key, rotates=True),
}
"""Route path -> kernel; "reference" and "view_sdpa" are the reference itself."""


CHECK_ROWS = 32
"""Query rows of a prefill the first-launch check computes on the reference: the last ones,
which see every key. The reference materializes each row's scores: a whole 512-token
chunk's took ~45 MiB on a 1B model, the peak of its first prefill."""


def _check_reference(call: PagedCall) -> mx.array:
    L = call.queries.shape[2]
    if call.residual or L <= CHECK_ROWS:
        return _reference(call)
    # query i sits at context_len - L + i, so the last rows keep their positions
    return _reference(replace(call, queries=call.queries[:, :, L - CHECK_ROWS:]))


def _reference(call: PagedCall) -> mx.array:
    if call.residual:  # a query reads its own block exact, the earlier ones quantized
        return residual.residual_attention(call)
    return reference.paged_attention_ref(*call.args()[:5], call.spec, block_run=call.block_run)


def _kernel(call: PagedCall) -> tuple[str, str, KernelPath] | None:
    """(backend, path name, kernel) the route table picks for ``call``, where the kernels
    are on and that kernel takes it; None: the reference."""
    if GUARD.switch.tripped or not backend.kernels_enabled():
        return None
    where = backend.kernel_backend() or "cpu"  # MLX's CPU backend: the extension's rows
    name = routes.route(call, where).path
    path = KERNEL_PATHS.get(name)
    return (where, name, path) if path is not None and path.ready(call) else None


def validated_kernel(queries: mx.array, k_pool: Pool, v_pool: Pool, block_tables: mx.array,
                     context_lens: Sequence[int], spec: AttentionSpec) -> str | None:
    """The kernel path `paged_attention` launches for this call, if its variant has already
    passed the first-launch check (so a caller building the same launch itself, like
    `cpu_ext.layer_stack`, skips nothing the guard would do); else None."""
    call = PagedCall(queries, k_pool, v_pool, block_tables, tuple(map(int, context_lens)),
                     spec)
    chosen = _kernel(call)
    if chosen is None:
        return None
    where, name, path = chosen
    return name if GUARD.validated((where, *path.variant(call))) else None


def paged_attention(
    queries: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_tables: mx.array,
    context_lens: Sequence[int],
    scale: float | AttentionSpec,
    *,
    block_run: int | None = None,
    use_kernels: bool = True,
) -> mx.array:
    """Paged attention on the path `routes.ROUTES` picks for this backend (the contract is
    `engine.model.attention`'s docstring); the reference where kernels are off
    (``use_kernels=False``, ``KVCHAT_KERNELS=0``, an earlier failure) or decline.

    A quantized side stored rotated (`QuantSpec.rotation`) is met here, for every path:
    rotated keys take queries rotated alike, rotated values give outputs rotated back (the
    CPU extension does both inside its op; elsewhere they are ops around the call).
    """
    rotated = tuple(bool(isinstance(p, QuantizedBlocks) and p.quant.rotation)
                    for p in (k_pool, v_pool))
    call = PagedCall(queries, k_pool, v_pool, block_tables, tuple(map(int, context_lens)),
                     AttentionSpec.of(scale), block_run)

    def around(fn: Callable[[PagedCall], mx.array]) -> mx.array:
        """fn on the call with its queries rotated, its output rotated back, as needed."""
        c = replace(call, queries=rotation.rotate(queries)) if rotated[0] else call
        out = fn(c)
        return rotation.unrotate(out) if rotated[1] else out

    chosen = _kernel(call) if use_kernels else None
    if chosen is not None:
        where, name, path = chosen
        if path.rotates:
            def launch(*args):
                return path.launch(*args, rotated=rotated)

            args = call.args()
        else:
            def launch(*args):
                return around(lambda c: path.launch(*c.args()))

            args = ()
        out = GUARD.run(f"{name} attention on {where}", (where, *path.variant(call)),
                        launch, args, lambda: around(_check_reference), (k_pool, v_pool))
        if out is not None:
            return out
    return around(_reference)

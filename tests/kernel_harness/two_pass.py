"""The two-pass (split-K) decode kernels under the emulator: cases, sources, launches.

Pass 1 (`paged_decode_split`) and pass 2 (`paged_decode_reduce`) run as two
emulator launches, the partials passed between them as MLX would: fresh fp32
arrays whose unwritten partitions hold NaN (the driver's output fill), so a
pass 2 that reads a partition past a sequence's end shows as NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from engine.model.attention.gpu import abi, two_pass
from engine.model.attention.routes import TWO_PASS_MIN_TOKENS
from metal_kernels import kernel_header, read_source

from . import emulator
from .cases import Case
from .metal_source import traced_metal_source

SPLIT_BODY = read_source("paged_decode_split.metal")
REDUCE_BODY = read_source("paged_decode_reduce.metal")


@dataclass(frozen=True)
class TwoPassCase(Case):
    """A decode launch through the two-pass kernels, PS tokens per partition."""

    partition_tokens: int = 32
    qpg: int | None = None  # query heads per pass-1 threadgroup; None: the engine's choice

    @property
    def heads_per_group(self) -> int:
        return self.qpg or two_pass.heads_per_group(self.num_q_heads, self.num_kv_heads)

    @property
    def id(self) -> str:
        return f"{super().id}-ps{self.partition_tokens}-qpg{self.heads_per_group}"


@dataclass(frozen=True)
class TwoPassSources:
    split: emulator.KernelSource
    reduce: emulator.KernelSource


def _launches(case: TwoPassCase, inputs: dict) -> tuple[list[mx.array], dict, dict, list]:
    """(pass-1 inputs, pass-1 launch, pass-2 launch, pass-2 placeholder inputs)."""
    args = abi.kernel_inputs(**inputs)
    q = args[0]
    parts = two_pass.num_partitions(inputs["context_lens"], case.partition_tokens)
    split = two_pass.split_launch(q, parts, num_simdgroups=case.num_simdgroups,
                                 qpg=case.heads_per_group)
    split["template"] = two_pass.split_template(
        q, inputs["k_pool"], inputs["v_pool"], num_simdgroups=case.num_simdgroups,
        partition_tokens=case.partition_tokens, qpg=case.heads_per_group,
    )
    reduce = two_pass.reduce_launch(q, case.partition_tokens)
    partials = [mx.zeros(s, dtype=mx.float32) for s in split["output_shapes"]]
    return args, split, reduce, [*partials, *two_pass.reduce_extras(args)]


def sources(
    case: TwoPassCase,
    inputs: dict,
    backend: str = "metal",
    *,
    split_body: str | None = None,
    reduce_body: str | None = None,
    header: str | None = None,
    names: tuple[str, str] = (two_pass.SPLIT_NAME, two_pass.REDUCE_NAME),
) -> TwoPassSources:
    """The generated text of both passes for this case (Metal traced, CUDA rebuilt)."""
    args, split, reduce, reduce_args = _launches(case, inputs)
    split_body = SPLIT_BODY if split_body is None else split_body
    reduce_body = REDUCE_BODY if reduce_body is None else reduce_body
    if backend == "metal":
        k1, k2 = two_pass.make_two_pass_kernels(
            "metal", split_body=split_body, reduce_body=reduce_body, header=header, names=names
        )
        return TwoPassSources(
            emulator.parse_metal(traced_metal_source(k1, args, **split), abi.INPUT_NAMES,
                                 two_pass.SPLIT_OUTPUT_NAMES),
            emulator.parse_metal(traced_metal_source(k2, reduce_args, **reduce),
                                 two_pass.REDUCE_INPUT_NAMES, abi.OUTPUT_NAMES),
        )
    head = kernel_header("cuda") if header is None else header
    return TwoPassSources(
        emulator.cuda_generated_source(names[0], abi.INPUT_NAMES, args,
                                       two_pass.SPLIT_OUTPUT_NAMES, split["output_dtypes"],
                                       split_body, head, split["template"]),
        emulator.cuda_generated_source(names[1], two_pass.REDUCE_INPUT_NAMES, reduce_args,
                                       abi.OUTPUT_NAMES, reduce["output_dtypes"],
                                       reduce_body, head, reduce["template"]),
    )


def emulate(
    binary: Path,
    srcs: TwoPassSources,
    case: TwoPassCase,
    inputs: dict,
    work_dir: Path,
    **run_options: object,
) -> tuple[mx.array | None, emulator.RunResult]:
    """Both passes as the engine launches them; (output or None, the failing/last result)."""
    args, split, reduce, _ = _launches(case, inputs)
    names = two_pass.SPLIT_OUTPUT_NAMES
    first = emulator.run(
        binary, srcs.split, dict(zip(abi.INPUT_NAMES, args, strict=True)),
        {n: (s, mx.float32) for n, s in zip(names, split["output_shapes"], strict=True)},
        split["grid"], split["threadgroup"], work_dir, **run_options,
    )
    if not first.ok:
        return None, first
    partials = [emulator.to_array(data, shape, mx.float32)
                for data, shape in zip(first.outputs, split["output_shapes"], strict=True)]
    q = args[0]
    second = emulator.run(
        binary, srcs.reduce,
        dict(zip(two_pass.REDUCE_INPUT_NAMES, [*partials, *two_pass.reduce_extras(args)],
                 strict=True)),
        {"out": (q.shape, q.dtype)}, reduce["grid"], reduce["threadgroup"], work_dir,
        **run_options,
    )
    second.stderr = first.stderr + second.stderr
    if not second.ok:
        return None, second
    return emulator.to_array(second.outputs[0], q.shape, q.dtype), second


# >= 20 configurations: GQA 1:1 to 8:1 (and 16:2 split into two head groups
# of 4), partial last blocks and partitions, partitions not a multiple of the
# block size, ragged batches whose short sequences end before the last
# partition, a single token, all dtypes, quantized sides, and a long context
# launched as the engine launches it.
TWO_PASS_CASES = [
    TwoPassCase("float16", 64, 16, 4, 4, (37, 5, 16), partition_tokens=16),
    TwoPassCase("float16", 64, 8, 6, 3, (1, 23), partition_tokens=8),
    TwoPassCase("float16", 128, 16, 3, 1, (50,), partition_tokens=32),
    TwoPassCase("float16", 64, 16, 4, 1, (97, 33), partition_tokens=24),
    TwoPassCase("float16", 64, 32, 5, 1, (130,), partition_tokens=64, num_simdgroups=4),
    TwoPassCase("float16", 64, 8, 6, 1, (45, 12, 3), partition_tokens=16),
    TwoPassCase("float16", 32, 16, 7, 1, (60,), partition_tokens=16, num_simdgroups=1),
    TwoPassCase("float16", 64, 16, 8, 1, (77, 140), partition_tokens=32),
    TwoPassCase("float16", 64, 16, 16, 2, (41,), partition_tokens=16),  # ratio 8 -> 8
    TwoPassCase("float16", 64, 16, 8, 1, (41,), partition_tokens=16, qpg=4),  # 2 groups
    TwoPassCase("bfloat16", 64, 16, 4, 2, (37, 5, 16), partition_tokens=16),
    TwoPassCase("bfloat16", 128, 8, 8, 1, (66,), partition_tokens=32),
    TwoPassCase("bfloat16", 64, 32, 3, 3, (100, 1), partition_tokens=48),
    TwoPassCase("float32", 64, 16, 4, 4, (37, 5, 16), partition_tokens=16),
    TwoPassCase("float32", 64, 8, 6, 2, (1, 23), partition_tokens=8),
    TwoPassCase("float32", 128, 16, 8, 2, (81,), partition_tokens=32, num_simdgroups=4),
    TwoPassCase("float32", 96, 16, 5, 5, (29, 64), partition_tokens=16),
    TwoPassCase("float16", 64, 16, 4, 2, (25, 9), kv_dtype="float32", partition_tokens=16),
    TwoPassCase("float16", 64, 16, 4, 2, (37, 5), k_quant=(8, 32), v_quant=(4, 32),
                partition_tokens=16),
    TwoPassCase("float16", 96, 8, 6, 2, (29, 40), k_quant=(4, 32), v_quant=(8, 32),
                partition_tokens=16),
    TwoPassCase("float32", 128, 16, 8, 1, (50,), kv_dtype="float16", k_quant=(8, 64),
                partition_tokens=32),
    # As the engine launches long contexts: its partition size (512) and simdgroup
    # count (8), at the shortest context it routes to the two-pass kernels (4096
    # tokens: 8 partitions). Pass 1 runs the same threadgroup per partition and
    # pass 2 loops over ceil(len / PS) partitions with no tiling, so 32k tokens
    # (64 partitions; on a real GPU in test_kernels_metal.py) take no other path.
    TwoPassCase("float16", 32, 16, 2, 1, (TWO_PASS_MIN_TOKENS,),
                partition_tokens=two_pass.PARTITION_TOKENS, num_simdgroups=abi.NUM_SIMDGROUPS),
]

TWO_PASS_SANITIZER_CASES = [
    TwoPassCase("float16", 64, 8, 4, 2, (13, 4), partition_tokens=8),
    TwoPassCase("float32", 96, 16, 6, 2, (20,), k_quant=(4, 32), partition_tokens=8),
]

TWO_PASS_CUDA_CASES = [
    TwoPassCase("float16", 64, 16, 6, 2, (37, 5), partition_tokens=16),
    TwoPassCase("bfloat16", 128, 8, 8, 1, (50,), partition_tokens=24, num_simdgroups=4),
    TwoPassCase("float32", 96, 16, 4, 2, (29, 9), k_quant=(8, 32), v_quant=(4, 32),
                partition_tokens=16),
]

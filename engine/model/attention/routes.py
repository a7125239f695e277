"""The route table: which path computes an attention call, on every backend, and why.

Rows are tried in order; the first whose backend, kind and condition match wins. A
kernel path that is unavailable here (no extension, no GPU) or declines the shapes
falls to the reference, as does any failure (`guard`).

CPU figures (2-core x86_64 build VM, Hq 9, Hkv 3, D 64, blocks of 16; us per call,
best of 3; scripts/bench_cpu_ext.py --only attention):

  decode pools  context             reference               extension
  float16       1 x 128            183 (view of the run)     107
  float16       1 x 1024           764 (view of the run)     167
  float16       1 x 4096          2926 (view of the run)     706
  float32       1 x 128             64 (view of the run)      34
  float32       1 x 1024           262 (view of the run)     172
  float32       1 x 4096          1007 (view of the run)     472
  float16       4 ragged (50-1000) 2477 (gather + mask)      351
  float16       8 x 1024          6773 (gather + mask)      1186

  prefill (float32 queries, float16 pools, one run; ms, best of 5, 2 threads)
  512 x 512    62.4 -> 2.6     512 x 1024    127.1 -> 7.2     512 x 4096    546.2 -> 35.6
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.model.attention.spec import PagedCall

TWO_PASS_MIN_TOKENS = 4096
KINDS = ("decode", "prefill", "verify")
GPU = ("metal", "cuda")


@dataclass(frozen=True)
class Route:
    """One row: where it applies, the path it picks, and why."""

    backends: tuple[str, ...]  # "cpu", "metal", "cuda"
    kinds: tuple[str, ...]  # of KINDS
    when: str
    path: str  # "reference", "view_sdpa" (the reference over a view), "cpu", "cpu_residual",
    # "one_pass", "two_pass", "gpu_residual"
    reason: str
    applies: Callable[[PagedCall], bool] = field(default=lambda call: True, compare=False)


ROUTES = (
    Route(("cpu",), KINDS, "a residual KV format with keys per channel (-kivi)",
          "cpu_residual", "decode: one op that scores a block's per-channel key codes as "
          "(q * scales) @ codes + q @ biases, never a dequantized key row, and reads the "
          "newest block exact; a chunk: the flash prefill kernel over the chunk's blocks "
          "as batch rows (`attention/cpu_residual.py`)",
          lambda call: call.residual),
    Route(GPU, ("decode",), "a residual KV format with keys per channel (-kivi)",
          "gpu_residual", "one pass (a threadgroup per query head and sequence) that reads "
          "the per-channel key codes and per-token value codes in registers and the row's "
          "own block exact (`attention/gpu/residual.py`); no split-K variant for long "
          "contexts yet", lambda call: call.residual),
    Route(("cpu", *GPU), KINDS, "a residual KV format (full blocks quantized, the newest exact)",
          "reference", "no kernel reads the layout for these calls (a GPU's prefill chunks "
          "and verify rows, no extension on the CPU): the reference "
          "(`attention/residual.py`) dequantizes the blocks it reads and takes each query's "
          "own block exact", lambda call: call.residual),
    Route(("cpu",), KINDS, "one sequence whose pools are plain and of the queries' dtype",
          "reference", "exactly the computation mlx-lm does over its dense cache: "
          "`--weights float32` promises mlx-lm's greedy tokens (tests/test_engine_parity.py)",
          lambda call: call.batch == 1 and call.pools_in_query_dtype),
    Route(("cpu",), KINDS, "any other call (batches, float16 or quantized pools)", "cpu",
          "one op instead of the reference's ~15: no gather copy, no cast of a float16 pool, "
          "no padding of ragged batches; prefill tiles flash-style (the tables above)"),
    # Windows and sinks are in every kernel (the extension's; the GPU body's attn_window,
    # attn_sinks): each row takes windowed and sink layers as it takes plain ones.
    Route(GPU, ("decode",), "one sequence whose blocks are one contiguous run", "view_sdpa",
          "a view of the pool costs no copy and MLX's sdpa_vector picks its own one- or "
          "two-pass kernel; no Mac figure yet shows the paged kernels beating it",
          lambda call: call.batch == 1 and call.block_run is not None),
    Route(GPU, ("decode",), f"longest sequence >= {TWO_PASS_MIN_TOKENS} tokens", "two_pass",
          "the one-pass kernel has Hq x B threadgroups each walking the whole context; "
          "MLX's sdpa_vector goes two-pass at >= 4096 keys with GQA (>= 1024 on Max/Ultra "
          "chips, v0.32.1), so the same threshold until measured; pass 1 also reads each "
          "K/V row once per KV head instead of once per query head",
          lambda call: call.max_context >= TWO_PASS_MIN_TOKENS),
    Route(GPU, ("decode",), "any other decode (short batches, scattered blocks)", "one_pass",
          "the alternative gathers every K/V row into a fresh array each step "
          "(lablup/mlxcel measured that gather at +48% to +56% of attention time)"),
    Route(GPU, ("prefill", "verify"), "several queries per sequence", "reference",
          "no paged prefill kernel on the GPU yet: MLX's SDPA over the gathered blocks"),
)


def route(call: PagedCall, backend: str) -> Route:
    """The first ROUTES row that applies to ``call`` on ``backend``."""
    for row in ROUTES:
        if backend in row.backends and call.kind in row.kinds and row.applies(call):
            return row
    raise LookupError(f"no attention route for a {call.kind} call on {backend}")

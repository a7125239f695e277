"""Shape configurations and inputs shared by the kernel tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.kvcache.kv_cache import SCALE_DTYPE
from engine.kvcache.quant import QuantSpec
from engine.kvcache.quantized_blocks import QuantizedBlocks

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


@dataclass(frozen=True)
class Case:
    """One decode-attention launch: B = len(context_lens) sequences, L = 1."""

    dtype: str
    head_dim: int
    block_size: int
    num_q_heads: int
    num_kv_heads: int
    context_lens: tuple[int, ...]
    num_simdgroups: int = 2
    kv_dtype: str | None = None  # pool dtype when it differs from the queries'
    seed: int = 0
    k_quant: tuple[int, int] | None = None  # (bits, group size): K stored quantized
    v_quant: tuple[int, int] | None = None

    @property
    def id(self) -> str:
        kv = f"-kv{self.kv_dtype}" if self.kv_dtype else ""
        for side, quant in (("k", self.k_quant), ("v", self.v_quant)):
            kv += f"-{side}{quant[0]}g{quant[1]}" if quant else ""
        lens = "_".join(map(str, self.context_lens))
        return (
            f"{self.dtype}{kv}-D{self.head_dim}-bs{self.block_size}-"
            f"gqa{self.num_q_heads}x{self.num_kv_heads}-L{lens}-sg{self.num_simdgroups}"
        )


def quantize_pool(pool: mx.array, bits: int, group_size: int) -> QuantizedBlocks:
    """A (H, num_blocks, bs, D) pool stored as PagedKVCache stores a quantized side."""
    H, nb, bs, D = pool.shape
    data, scales, biases = mx.quantize(
        pool.reshape(H, nb * bs, D), group_size=group_size, bits=bits
    )
    parts = [a.reshape(H, nb, bs, a.shape[-1]) for a in (data, scales, biases)]
    parts[1:] = [a.astype(SCALE_DTYPE) for a in parts[1:]]
    return QuantizedBlocks(*parts, QuantSpec(bits, group_size), D)


def make_inputs(case: Case, *, spare_columns: int = 1, spare_blocks: int = 3) -> dict[str, object]:
    """Random queries and pools; each sequence's blocks scattered over the pool.

    Block tables carry `spare_columns` padding columns (valid ids, never read)
    and the pool has `spare_blocks` unowned blocks, so stray reads show as wrong
    numbers. Values are N(0, 0.5^2) so outputs stay below 1, where the fp16
    bound of 2e-3 is about 2 ulps (the reference itself rounds in fp16). A
    quantized side is `QuantizedBlocks` made from those values.
    """
    rng = np.random.default_rng(case.seed)
    bs, D = case.block_size, case.head_dim
    needed = [math.ceil(n / bs) for n in case.context_lens]
    max_blocks = max(needed) + spare_columns
    num_blocks = sum(needed) + spare_blocks
    ids = rng.permutation(num_blocks)
    table = rng.integers(0, num_blocks, size=(len(needed), max_blocks))
    start = 0
    for b, k in enumerate(needed):
        table[b, :k] = ids[start : start + k]
        start += k
    dtype = DTYPES[case.dtype]
    kv_dtype = DTYPES[case.kv_dtype or case.dtype]
    B = len(case.context_lens)

    def randn(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    def pool(std: float, quant: tuple[int, int] | None):
        values = std * randn(case.num_kv_heads, num_blocks, bs, D)
        return quantize_pool(values, *quant) if quant else values.astype(kv_dtype)

    return {
        "queries": randn(B, case.num_q_heads, 1, D).astype(dtype),
        "k_pool": pool(1.0, case.k_quant),
        "v_pool": pool(0.5, case.v_quant),
        "block_tables": mx.array(table.astype(np.int32)),
        "context_lens": list(case.context_lens),
        "scale": 1.0 / math.sqrt(D),
    }


# >= 20 configurations: ragged lengths, partial last blocks, exact multiples,
# length 1, GQA 1:1 / 3:1 / 8:1, block sizes 8/16/32, D 64/128, all dtypes.
EMULATED_CASES = [
    Case("float16", 64, 16, 4, 4, (37, 5, 16)),
    Case("float16", 64, 8, 6, 2, (1, 23)),
    Case("float16", 128, 16, 8, 1, (50,)),
    Case("float16", 128, 32, 3, 1, (64, 33, 7)),
    Case("float16", 64, 32, 8, 8, (31, 2), num_simdgroups=4),
    Case("float16", 128, 8, 16, 2, (17, 40), num_simdgroups=1),
    Case("float16", 64, 16, 2, 2, (3,), num_simdgroups=4),
    Case("float16", 128, 16, 6, 2, (97,)),
    Case("bfloat16", 64, 16, 4, 4, (37, 5, 16)),
    Case("bfloat16", 64, 8, 6, 2, (1, 23)),
    Case("bfloat16", 128, 16, 8, 1, (50,)),
    Case("bfloat16", 128, 32, 3, 1, (64, 33, 7)),
    Case("bfloat16", 64, 32, 8, 8, (31, 2), num_simdgroups=4),
    Case("bfloat16", 128, 8, 16, 2, (17, 40), num_simdgroups=1),
    Case("float32", 64, 16, 4, 4, (37, 5, 16)),
    Case("float32", 64, 8, 6, 2, (1, 23)),
    Case("float32", 128, 16, 8, 1, (50,)),
    Case("float32", 128, 32, 3, 1, (64, 33, 7)),
    Case("float32", 64, 32, 8, 8, (31, 2), num_simdgroups=4),
    Case("float32", 128, 8, 16, 2, (17, 40), num_simdgroups=1),
    Case("float32", 64, 16, 2, 2, (3,), num_simdgroups=4),
    Case("float16", 64, 16, 4, 2, (25, 9), kv_dtype="float32"),
    Case("float32", 64, 16, 3, 1, (129,), num_simdgroups=8),
]

# Small cases for the sanitizer builds (TSan is ~10x slower).
SANITIZER_CASES = [
    Case("float16", 64, 8, 3, 1, (13, 4)),
    Case("bfloat16", 128, 16, 2, 2, (20,)),
    Case("float32", 64, 32, 2, 1, (33, 1), num_simdgroups=4),
]

CUDA_CASES = [
    Case("float16", 64, 16, 6, 2, (37, 5)),
    Case("bfloat16", 128, 32, 8, 1, (50,)),
    Case("float32", 64, 8, 4, 4, (1, 23, 16), num_simdgroups=4),
    Case("float32", 128, 16, 3, 1, (40,), num_simdgroups=1),
]

# Quantized pools (mx.quantize layout, float16 scales): 8 and 4 bits, groups
# 32/64/128, K and V chosen apart (one side plain, of another dtype), GQA,
# ragged lengths over several scattered blocks. D = 96 gives EPL = 3, so some
# lanes' dims straddle a packed word and a group.
QUANT_CASES = [
    Case("float16", 64, 16, 4, 2, (37, 5, 16), k_quant=(8, 32), v_quant=(4, 32)),
    Case("float16", 128, 8, 6, 2, (1, 23, 40), k_quant=(4, 64), v_quant=(4, 64)),
    Case("float16", 128, 16, 4, 4, (97,), k_quant=(8, 128), v_quant=(8, 128), num_simdgroups=4),
    Case("float16", 96, 16, 4, 2, (29, 40), k_quant=(8, 32), v_quant=(4, 32)),
    Case("float32", 64, 8, 4, 2, (17, 9), k_quant=(4, 32), v_quant=(8, 64)),
    Case("float32", 128, 16, 8, 1, (50,), kv_dtype="float16", k_quant=(8, 64)),
    Case("bfloat16", 64, 32, 3, 1, (64, 33, 7), v_quant=(8, 32)),
    Case("bfloat16", 96, 8, 6, 3, (20, 3), k_quant=(4, 32), v_quant=(8, 32), num_simdgroups=1),
]

QUANT_SANITIZER_CASES = [
    Case("float16", 64, 8, 3, 1, (13, 4), k_quant=(8, 32), v_quant=(4, 32)),
    Case("float32", 96, 16, 2, 2, (20,), k_quant=(4, 32)),
]

QUANT_CUDA_CASES = [
    Case("float16", 96, 16, 6, 2, (37, 5), k_quant=(8, 32), v_quant=(4, 32)),
    Case("bfloat16", 128, 8, 4, 1, (30,), k_quant=(4, 64), num_simdgroups=4),
]

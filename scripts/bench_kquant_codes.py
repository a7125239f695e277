"""The tiled matmul with GGUF K-quant codes and steps against float16 scales, in one run.

    .venv/bin/python scripts/bench_kquant_codes.py [--rounds 30]

One random Q4_K layer per shape (1B Llama: 8192 x 2048 and 2048 x 8192), converted as the
GGUF loader converts it, tiled twice: with float16 scales and biases, and with codes and
steps (`engine.model.cpu_ext.kquant`). Interleaved rounds of 10 calls each; median and p10
microseconds a call, and the ratio codes / float16. Both give the same bits (checked here).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.dev import gguf_writer  # noqa: E402
from engine.model import gguf_quants  # noqa: E402
from engine.model.cpu_ext import linear  # noqa: E402


def layers(rows: int, cols: int):
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32) * 0.05
    blocks = gguf_writer.encode(x, "Q4_K")
    w, s, b, bits = gguf_quants.to_affine("Q4_K", blocks, (rows, cols))
    layer = nn.QuantizedLinear(cols, rows, bias=False, group_size=32, bits=bits)
    layer.weight, layer.scales, layer.biases = mx.array(w), mx.array(s), mx.array(b)
    d, m = gguf_quants.k_steps("Q4_K", blocks, (rows, cols))
    return (linear.CpuTiledLinear.from_quantized(layer),
            linear.CpuTiledLinear.from_quantized(layer, (mx.array(d), mx.array(m))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    for rows, cols, m in ((8192, 2048, 1), (2048, 8192, 1), (8192, 2048, 4), (8192, 2048, 64)):
        plain, codes = layers(rows, cols)
        assert codes["scales"].dtype == mx.uint8
        x = mx.random.normal((m, cols), key=mx.random.key(1))
        assert mx.array_equal(plain(x), codes(x)).item()
        times = {"float16": [], "codes": []}
        for _ in range(args.rounds):
            for name, layer in (("float16", plain), ("codes", codes)):
                t = time.perf_counter()
                for _ in range(10):
                    mx.eval(layer(x))
                times[name].append((time.perf_counter() - t) / 10 * 1e6)
        f, c = (np.median(times[k]) for k in ("float16", "codes"))
        p10 = [np.percentile(times[k], 10) for k in ("float16", "codes")]
        print(f"{rows} x {cols}, M={m}: float16 {f:.0f} us, codes {c:.0f} us, "
              f"codes / float16 {c / f:.3f} (p10 {p10[0]:.0f} / {p10[1]:.0f})")


if __name__ == "__main__":
    main()

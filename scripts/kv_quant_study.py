"""Fake-quantized K/V inside mlx-lm's forward: which KV quantization scheme keeps quality.

Each scheme quantizes and dequantizes the keys and values of every layer (after RoPE, as
the pool stores them) and attends with them; the logits of every position are compared
with the float16 run: perplexity change, KL(f16 || scheme) over the whole vocabulary, and
next-token top-1 agreement. Modifiers mirror what a paged pool could keep unquantized:
``resid`` the newest (partly filled) block of a query's sequence, i.e. every key of the
query's own block; ``sink`` the first block. ``perchan`` quantizes keys per channel over
the block's tokens (KIVI); a block is quantized with its full statistics (what a pool
that quantizes a block once it fills would store; with ``resid`` that is exact).

    python scripts/kv_quant_study.py --text /usr/share/common-licenses/GPL-3 \
        --text /usr/share/common-licenses/GFDL-1.3 --tokens 2048
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from engine import load_model  # first: importing engine preloads OpenBLAS

# isort: split
import mlx.core as mx
import mlx_lm.models.llama as llama_mod

from engine.kvcache import rotation

BLOCK = 16
N_LAYERS = 30


def _f16(x):
    return x.astype(mx.float16).astype(mx.float32)


def affine(x, bits):
    """Affine over the last axis (min/max; scale and bias rounded to float16)."""
    nb = (1 << bits) - 1
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    scale = _f16(mx.maximum((hi - lo) / nb, 1e-7))
    bias = _f16(lo)
    q = mx.clip(mx.round((x - bias) / scale), 0, nb)
    return q * scale + bias


def mlx_affine(x, bits, group):
    """Exactly the pool's step: `mx.quantize`, scales and biases stored as float16."""
    w, s, b = mx.quantize(x, group_size=group, bits=bits)
    return mx.dequantize(w, _f16(s), _f16(b), group_size=group, bits=bits)


def symmetric(x, bits):
    """llama.cpp q4_0/q8_0-like absmax over the last axis: d = m / -2^(b-1), with m the
    element of largest magnitude (so it maps to the lowest level exactly)."""
    half, top = 1 << (bits - 1), (1 << bits) - 1
    idx = mx.argmax(mx.abs(x), axis=-1, keepdims=True)
    m = mx.take_along_axis(x, idx, axis=-1)
    d = _f16(m / -half)
    d = mx.where(d == 0, 1.0, d)
    q = mx.clip(mx.round(x / d) + half, 0, top)
    return (q - half) * d


def per_token(fn, x, bits, group):
    shape = x.shape
    return fn(x.reshape(*shape[:-1], shape[-1] // group, group), bits).reshape(shape)


def per_channel(fn, x, bits):
    """(B, H, L, D): each channel's group is a block's tokens."""
    B, H, L, D = x.shape
    pad = (-L) % BLOCK
    xp = mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)], mode="edge") if pad else x
    nb = xp.shape[2] // BLOCK
    g = xp.reshape(B, H, nb, BLOCK, D).transpose(0, 1, 2, 4, 3)
    out = fn(g, bits).transpose(0, 1, 2, 4, 3).reshape(B, H, nb * BLOCK, D)
    return out[:, :, :L]


def per_channel_appended(x, bits):
    """`per_channel` as a pool without a float residual would have to store it: rows come one
    at a time and each append re-quantizes the block's rows present, the older ones from their
    dequantized values (a widened range re-rounds them); what a full block ends as."""
    B, H, L, D = x.shape
    pad = (-L) % BLOCK
    xp = mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)], mode="edge") if pad else x
    nb = xp.shape[2] // BLOCK
    g = xp.reshape(B, H, nb, BLOCK, D)
    rows = g[:, :, :, :1]
    for r in range(BLOCK):
        rows = g[:, :, :, :1] if r == 0 else mx.concatenate([rows, g[:, :, :, r:r + 1]], axis=3)
        rows = affine(rows.swapaxes(-1, -2), bits).swapaxes(-1, -2)
    return rows.reshape(B, H, nb * BLOCK, D)[:, :, :L]


def fake(x, side: dict):
    """One side's scheme: {'bits', 'kind': affine|mlx|sym|chan|chansym, 'group', 'rot'}."""
    if side is None:
        return _f16(x)
    bits, kind, rot = side["bits"], side["kind"], side.get("rot", True)
    if rot:
        x = x @ rotation.matrix(x.shape[-1])
    if kind == "mlx":
        y = mlx_affine(x, bits, side.get("group", 64))
    elif kind == "chanappend":
        y = per_channel_appended(x, bits)
    elif kind in ("affine", "sym"):
        y = per_token(affine if kind == "affine" else symmetric, x, bits, side.get("group", 64))
    else:
        y = per_channel(affine if kind == "chan" else symmetric, x, bits)
    if rot:
        y = y @ rotation.matrix(x.shape[-1]).T
    return y


class Scheme:
    current: dict | None = None
    layer = 0  # the attention call's layer in this forward
    calib: list | None = None  # while calibrating: per layer, [(mean key, std)] per forward
    mu: list | None = None  # per layer (1, Hk, 1, D): the calibrated mean key
    sigma: list | None = None  # ... and each channel's standard deviation


def attention(queries, keys, values, cache=None, scale=1.0, mask=None, **kw):
    s = Scheme.current
    B, Hq, L, D = queries.shape
    Hk = keys.shape[1]
    rep = Hq // Hk
    layer = Scheme.layer
    Scheme.layer = (layer + 1) % N_LAYERS
    keys = keys.astype(mx.float32)
    if Scheme.calib is not None:
        Scheme.calib[layer].append((keys.mean(axis=2, keepdims=True),
                                    keys.std(axis=2, keepdims=True)))
    if s and s.get("center"):  # softmax is invariant to one vector added to every key
        keys = keys - Scheme.mu[layer]
    kf, vf = _f16(keys), _f16(values.astype(mx.float32))
    if s is None:
        kq, vq = kf, vf
    else:
        vq = fake(values.astype(mx.float32), s["v"])
        if s.get("smooth"):  # channels divided by their calibrated spread, queries times it
            sigma = Scheme.sigma[layer]
            kq = fake(keys / sigma, s["k"]) * sigma
        else:
            kq = fake(keys, s["k"])
    q = queries.astype(mx.float32).reshape(B, Hk, rep, L, D) * scale
    kf, vf, kq, vq = (a[:, :, None] for a in (kf, vf, kq, vq))
    resid, sink = bool(s and s.get("resid")), bool(s and s.get("sink"))
    outs = []
    step = 512
    for a in range(0, L, step):
        e = min(L, a + step)
        qi = mx.arange(a, e)[:, None]
        kj = mx.arange(e)[None]
        sc = q[:, :, :, a:e] @ kq[:, :, :, :e].swapaxes(-1, -2)
        exact = mx.zeros((e - a, e), dtype=mx.bool_)
        if resid:
            exact = exact | (qi // BLOCK == kj // BLOCK)
        if sink:
            exact = exact | (kj < BLOCK)
        if resid or sink:
            sf = q[:, :, :, a:e] @ kf[:, :, :, :e].swapaxes(-1, -2)
            sc = mx.where(exact, sf, sc)
        sc = mx.where(kj <= qi, sc, -mx.inf)
        p = mx.softmax(sc, axis=-1)
        if resid or sink:
            o = (p * exact) @ vf[:, :, :, :e] + (p * ~exact) @ vq[:, :, :, :e]
        else:
            o = p @ vq[:, :, :, :e]
        outs.append(o)
        mx.eval(outs[-1])
    out = mx.concatenate(outs, axis=3).reshape(B, Hq, L, D)
    return out.astype(queries.dtype)


def run_docs(model, docs):
    """[(logp f16 of every position, nll, top1)] per doc."""
    out = []
    for ids in docs:
        logits = model(mx.array(ids)[None])[0, :-1].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tgt = mx.array(ids[1:])
        nll = -mx.take_along_axis(logp, tgt[:, None], axis=-1)[:, 0]
        top1 = mx.argmax(logp, axis=-1)
        mx.eval(logp, nll, top1)
        out.append((logp, nll, top1))
    return out


def compare(ref, runs):
    nll = mx.concatenate([r[1] for r in runs])
    n = nll.size
    ppl = math.exp(nll.sum().item() / n)
    agree = sum((r[2] == f[2]).sum().item() for r, f in zip(runs, ref, strict=True)) / n
    kl = sum((mx.exp(f[0]) * (f[0] - r[0])).sum().item()
             for r, f in zip(runs, ref, strict=True)) / n
    return ppl, agree, kl


def side(bits, kind, group=64, rot=True):
    return {"bits": bits, "kind": kind, "group": group, "rot": rot}


def schemes(bits_k: int, bits_v: int) -> dict:
    kinds = {
        "affine g64 rot (current)": (side(bits_k, "mlx"), side(bits_v, "mlx")),
        "affine g32 rot": (side(bits_k, "mlx", 32), side(bits_v, "mlx", 32)),
        "sym g64 rot": (side(bits_k, "sym"), side(bits_v, "sym")),
        "sym g32 rot": (side(bits_k, "sym", 32), side(bits_v, "sym", 32)),
        "K affine g64, V sym g32 rot": (side(bits_k, "mlx"), side(bits_v, "sym", 32)),
        "K sym g64, V sym g32 rot": (side(bits_k, "sym"), side(bits_v, "sym", 32)),
        "K affine g64 plain, V affine g64 rot": (side(bits_k, "mlx", rot=False),
                                                 side(bits_v, "mlx")),
        "K chan plain, V affine g64 rot": (side(bits_k, "chan", rot=False), side(bits_v, "mlx")),
        "K chan rot, V affine g64 rot": (side(bits_k, "chan"), side(bits_v, "mlx")),
        "K chan plain, V sym g32 rot": (side(bits_k, "chan", rot=False), side(bits_v, "sym", 32)),
        "K chan appended plain, V affine g64 rot": (side(bits_k, "chanappend", rot=False),
                                                    side(bits_v, "mlx")),
        "K chan appended rot, V affine g64 rot": (side(bits_k, "chanappend"), side(bits_v, "mlx")),
    }
    out = {}
    for name, (k, v) in kinds.items():
        for mod in ("", "resid", "sink", "resid+sink", "center", "center+resid+sink",
                    "center+smooth", "smooth", "center+smooth+resid+sink"):
            out[f"{name}{' + ' + mod if mod else ''}"] = {
                "k": k, "v": v, "resid": "resid" in mod, "sink": "sink" in mod,
                "center": "center" in mod, "smooth": "smooth" in mod}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", action="append", required=True)
    p.add_argument("--tokens", type=int, default=2048, help="tokens of each text")
    p.add_argument("--calib", default=None, help="text whose mean key per layer and head "
                   "the 'center' schemes subtract (not a held-out text)")
    p.add_argument("--calib-tokens", type=int, default=512)
    p.add_argument("--bits", default="4/4,8/4", help="K/V bit pairs, comma-separated")
    p.add_argument("--only", default=None,
                   help="';'-separated scheme names to run, in this order (default: all)")
    args = p.parse_args(argv)
    loaded = load_model(None)
    model, tok = loaded.model, loaded.tokenizer
    llama_mod.scaled_dot_product_attention = attention
    docs = [tok.encode(Path(t).read_text(encoding="utf-8"))[: args.tokens] for t in args.text]
    Scheme.current = None
    if args.calib:
        global N_LAYERS
        N_LAYERS = len(model.layers)
        Scheme.calib = [[] for _ in range(N_LAYERS)]
        run_docs(model, [tok.encode(Path(args.calib).read_text(encoding="utf-8"))
                         [: args.calib_tokens]])
        Scheme.mu = [c[0][0] for c in Scheme.calib]
        Scheme.sigma = [mx.maximum(c[0][1], 1e-3) for c in Scheme.calib]
        Scheme.calib = None
    t0 = time.time()
    ref = run_docs(model, docs)
    nll = mx.concatenate([r[1] for r in ref])
    print(f"f16: ppl {math.exp(nll.sum().item() / nll.size):.4f} over {nll.size} tokens "
          f"({time.time() - t0:.0f} s)", flush=True)
    print("| K/V bits | scheme | perplexity | vs f16 | top-1 | mean KL |")
    print("|---|---|---:|---:|---:|---:|")
    base = math.exp(nll.sum().item() / nll.size)
    for pair in args.bits.split(","):
        bk, bv = (int(b) for b in pair.split("/"))
        table = schemes(bk, bv)
        for name in args.only.split(";") if args.only else table:
            Scheme.current = table[name.strip()]
            if Scheme.mu is None and (Scheme.current["center"] or Scheme.current["smooth"]):
                print(f"| K{bk}/V{bv} | {name} | needs --calib |", flush=True)
                continue
            ppl, agree, kl = compare(ref, run_docs(model, docs))
            print(f"| K{bk}/V{bv} | {name} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f} % | "
                  f"{100 * agree:.2f} % | {kl:.5f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The KV evaluation's outputs: a Markdown table (formats as columns) and a PNG plot."""

from __future__ import annotations

from pathlib import Path


def publish(table: str, result: dict, out: str | Path, name: str,
            json_path: str | None = None) -> None:
    """Write the Markdown ``table`` as ``out/name.md`` (``out`` made if missing) and, with
    ``json_path``, every figure of ``result`` as JSON there; then print the table."""
    import json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(table + "\n")
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    print(table)


def ctx(n: int | str) -> str:
    """1024 -> "1k", 7168 -> "7k", 512 -> "512"."""
    n = int(n)
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def frac(hit: int, total: int) -> str:
    return f"{hit}/{total} ({100 * hit / total:.0f} %)" if total else "-"


def wilson(hit: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % at z 1.96): unlike the normal
    approximation it stays inside [0, 1] and is honest at 0/n and n/n with few probes."""
    if not total:
        return 0.0, 1.0
    p = hit / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * ((p * (1 - p) + z * z / (4 * total)) / total) ** 0.5 / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def frac_ci(hit: int, total: int) -> str:
    """``frac`` with its 95 % interval: "8/10 (80 %, 49-94)"."""
    if not total:
        return "-"
    lo, hi = wilson(hit, total)
    return f"{hit}/{total} ({100 * hit / total:.0f} %, {100 * lo:.0f}-{100 * hi:.0f})"


def rows(result: dict) -> list[tuple[str, list[str]]]:
    """(metric, one cell per format) in table order."""
    fs, plan = result["formats"], result["plan"]
    ref = result["reference"]
    budget = fs[0]["kv"]["budget_bytes"]
    out: list[tuple[str, list[str]]] = []

    def row(metric: str, cell) -> None:
        out.append((metric, [cell(f) for f in fs]))

    def vs_ref(f: dict, value: str, ratio: float, digits: int) -> str:
        return value if f["label"] == ref else f"{value} ({ratio:.{digits}f}x)"

    row("KV bytes / token", lambda f: vs_ref(f, f"{f['kv']['bytes_per_token']:,}",
                                             f["kv"]["bytes_ratio"], 2))
    row(f"max {ctx(fs[0]['kv']['capacity_tokens'])}-token sequences in "
        f"{budget / 2**30:g} GiB", lambda f: str(f["kv"]["max_sequences"]))
    docs = "doc" if plan["ppl_docs"] == 1 else "docs"
    source = "" if plan.get("ppl_source") != "user texts" else ", your texts"
    row(f"perplexity ({plan['ppl_docs']} {docs} x {plan['ppl_tokens']:,} tokens{source})",
        lambda f: vs_ref(f, f"{f['perplexity']['value']:.4f}", f["perplexity"]["ratio"], 4))
    row(f"next-token top-1 agreement vs {ref} (same docs)",
        lambda f: f"{100 * f['perplexity']['top1_agreement']:.2f} %")
    row(f"mean KL divergence from {ref}'s next-token distribution (nats)",
        lambda f: f"{f['perplexity'].get('kl_mean', 0.0):.5f}")
    row(f"mean abs. change of token log-likelihood vs {ref}",
        lambda f: f"{_mean_nll_diff(f):.5f}")
    row(f"greedy agreement vs {ref} ({plan['agreement_prompts']} prompts x "
        f"{plan['agreement_tokens']} tokens)", lambda f: pct(f["agreement"]["mean"]))
    row("greedy exact match (whole answer)", lambda f: pct(f["agreement"]["exact"]))
    for n in fs[0]["needle"]["by_context"]:
        c = fs[0]["needle"]["by_context"][n]
        row(f"needle recall @{ctx(n)} ({c['probes']} probes; 95 % interval)",
            lambda f, n=n: frac_ci(f["needle"]["by_context"][n]["recalled"],
                                   f["needle"]["by_context"][n]["probes"]))
    row(f"needle recall, all ({fs[0]['needle']['probes']} probes; 95 % interval)",
        lambda f: frac_ci(round(f["needle"]["recall"] * f["needle"]["probes"]),
                          f["needle"]["probes"]))
    row(f"needle answers identical to {ref}", lambda f: pct(f["needle"]["same_as_reference"]))
    row(f"valid JSON ({plan['json_prompts']} prompts)",
        lambda f: frac(round(f["json"]["valid"] * f["json"]["prompts"]), f["json"]["prompts"]))
    row("JSON object with the asked keys",
        lambda f: frac(round(f["json"]["with_keys"] * f["json"]["prompts"]),
                       f["json"]["prompts"]))
    for n in fs[0]["speed"]:
        row(f"prefill tok/s @{ctx(n)} (cold)", lambda f, n=n: f"{f['speed'][n]['prefill_tps']:.0f}")
    for n in fs[0]["speed"]:
        row(f"decode tok/s @{ctx(n)}", lambda f, n=n: f"{f['speed'][n]['decode_tps']:.1f}")
    return out


def _mean_nll_diff(f: dict) -> float:
    docs = f["perplexity"]["docs"]
    return sum(d["mean_abs_nll_diff"] * d["tokens"] for d in docs) / sum(d["tokens"] for d in docs)


def markdown(result: dict) -> str:
    """The table, a caption above it and the method notes below."""
    fs = result["formats"]
    lines = [f"KV cache formats on {result['model']} ({result['weight_format']} weights); "
             f"reference: {result['reference']}" + (" (quick run)" if result["quick"] else ""),
             "",
             "| metric | " + " | ".join(f["label"] for f in fs) + " |",
             "|---|" + "---:|" * len(fs)]
    lines += [f"| {metric} | " + " | ".join(cells) + " |" for metric, cells in rows(result)]
    lines += [""] + [f"- {note}" for note in result["notes"]]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Six panels: bytes, perplexity ratio, agreement, needle recall, JSON, decode speed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fs = result["formats"]
    names = [f["label"] for f in fs]
    x = range(len(fs))
    fig, ax = plt.subplots(2, 3, figsize=(15, 8.5))
    fig.suptitle(f"KV cache formats on {result['model']} "
                 f"(reference {result['reference']})" + (" - quick run" if result["quick"] else ""))

    a = ax[0][0]
    a.bar(x, [f["kv"]["bytes_per_token"] / 1024 for f in fs], color="tab:blue")
    a.set(title="KV KiB per token (lower is better)", xticks=list(x), xticklabels=names)

    a = ax[0][1]
    change = [(f["perplexity"]["ratio"] - 1) * 100 for f in fs]
    bars = a.bar(x, change, color="tab:orange")
    a.bar_label(bars, labels=[f"{c:+.4f} %" for c in change], padding=3)
    a.axhline(0.0, color="grey", lw=0.8)
    span = max(max(abs(c) for c in change) * 1.3, 0.05)
    a.set(title="perplexity change vs reference (%)", xticks=list(x), xticklabels=names,
          ylim=(-span, span))

    _grouped(ax[0][2], names, {
        "next-token top-1": [f["perplexity"]["top1_agreement"] * 100 for f in fs],
        "greedy agreement": [f["agreement"]["mean"] * 100 for f in fs],
        "greedy exact": [f["agreement"]["exact"] * 100 for f in fs],
    }, "agreement with reference (%)", ylim=(0, 125))

    a = ax[1][0]
    contexts = list(fs[0]["needle"]["by_context"])
    for i, f in enumerate(fs):  # later formats drawn smaller, so equal points stay visible
        a.plot([int(c) for c in contexts],
               [f["needle"]["by_context"][c]["recall"] * 100 for c in contexts],
               marker="os^Dv"[i % 5], markersize=max(10 - 2 * i, 3), label=f["label"])
    a.set(title="needle recall (%) by context", xlabel="context tokens", ylim=(-5, 105))
    a.legend()

    _grouped(ax[1][1], names, {
        "valid JSON": [f["json"]["valid"] * 100 for f in fs],
        "with asked keys": [f["json"]["with_keys"] * 100 for f in fs],
    }, "structured output (%)", ylim=(0, 125))

    _grouped(ax[1][2], names, {f"@{ctx(n)}": [f["speed"][n]["decode_tps"] for f in fs]
                               for n in fs[0]["speed"]}, "decode tok/s (prefill excluded)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _grouped(a, names: list[str], series: dict[str, list[float]], title: str, *,
             ylim=None) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        a.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(names))], values,
              width, label=label)
    a.set(title=title, xticks=list(range(len(names))), xticklabels=names)
    top = max((v for vs in series.values() for v in vs), default=0.0)
    a.set_ylim(*(ylim or (0, top * 1.3 or 1.0)))
    a.legend(fontsize=8, ncol=len(series), loc="upper center")

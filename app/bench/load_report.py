"""The report of `kvchat bench load`: two tables, the top-vs-base ratio and a PNG."""

from __future__ import annotations

from pathlib import Path

SPEED_COLUMNS = [
    ("conc", "{conc}"), ("done/canc/rej/fail", "{completed}/{cancelled}/{rejected}/{failed}"),
    ("wall s", "{wall_s:.1f}"), ("gen tok/s", "{gen_tps:.1f}{gen_tps_x}"),
    ("decode-step tok/s", "{decode_step_tps:.1f}{decode_step_tps_x}"),
    ("mean decode batch", "{decode_batch_mean:.1f}"),
    ("req/s", "{requests_per_s:.2f}"),
    ("TTFT p50/95/99 s", "{ttft_s_p50:.2f}/{ttft_s_p95:.2f}/{ttft_s_p99:.2f}"),
    ("ITL p50/95/99 ms", "{itl_ms_p50:.0f}/{itl_ms_p95:.0f}/{itl_ms_p99:.0f}"),
    ("prefill tok/s p50", "{prefill_tps_p50:.0f}"), ("decode tok/s p50", "{decode_tps_p50:.1f}"),
]
MEMORY_COLUMNS = [
    ("conc", "{conc}"), ("peak/pool MiB", "{peak_mib:.1f}/{budget_mib:.0f} ({peak_pct:.0f}%)"),
    ("peak/all blocks", "{peak_blocks}/{blocks_total}"), ("leaked", "{blocks_leaked}"),
    ("waiting max", "{waiting_max}"), ("queue p95 s", "{queue_s_p95:.2f}"),
    ("preempted (reqs)", "{preemptions} ({preempted_requests})"), ("rejected", "{rejections}"),
    ("cancel release p50/95/max ms (n)", "{cancel_release_ms_p50:.0f}/{cancel_release_ms_p95:.0f}"
     "/{cancel_release_ms_max:.0f} ({cancel_release_ms_count})"),
]


def _cells(r: dict) -> dict:
    """One run flattened for the column formats above."""
    v = {**r, **r["cache"], **r["pressure"], "decode_step_tps": r["decode_step_tps"] or 0.0,
         "conc": f"{r['concurrency']}{'*' if r['capacity'] else ''}"}
    for k in ("ttft_s", "itl_ms", "prefill_tps", "decode_tps", "queue_s", "cancel_release_ms"):
        v |= {f"{k}_{q}": x for q, x in r[k].items()}
    return v | {f"{k}_x": "" if x is None else f" ({x:.2f}x)" for k, x in r["vs_base"].items()}


def print_report(report: dict) -> None:
    """Print the header, the speed table, the memory/pressure table and the top-vs-1 ratio."""
    m, st, ck = report["machine"], report["settings"], report["check"]
    runs = [_cells(r) for r in report["levels"] + [report["capacity"]] if r]
    print(f"kvchat bench load: model {report['model']['name']} ({report['model']['weight_format']}"
          f"), {m['cpu']}, {m['cpu_count']} cpus, {m['backend']}\n{st['requests']} requests per "
          f"level, seed {st['seed']}, cancel rate {st['cancel_rate']}; (x) = vs concurrency "
          f"{st['base_concurrency']}; * = capacity run (small KV pool)")
    for columns in (SPEED_COLUMNS, MEMORY_COLUMNS):
        rows = [[h for h, _ in columns]] + [[f.format(**r) for _, f in columns] for r in runs]
        widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
        print()
        for j, row in enumerate(rows):
            print(" | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
            if j == 0:
                print("-+-".join("-" * w for w in widths))
    fmt = {k: "-" if v is None else f"{v:.2f}x" for k, v in ck.items() if k.endswith("ratio")}
    print(f"\naggregate decode tok/s, {ck['top_concurrency']} vs {st['base_concurrency']} "
          f"concurrent: decode-step {fmt['decode_step_tps_ratio']}, generated/wall "
          f"{fmt['gen_tps_ratio']} (target {ck['target_ratio']:.0f}x: reported, not asserted)")


def write_plot(report: dict, path: Path) -> None:
    """A PNG of aggregate tok/s, TTFT P95/P99 and ITL P95/P99 against concurrency."""
    import matplotlib
    matplotlib.use("Agg")  # headless, and no GUI backend touched outside the main thread
    import matplotlib.pyplot as plt

    lv, cap, cs = report["levels"], report["capacity"], [r["concurrency"] for r in report["levels"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = {"aggregate tok/s": [("decode-step", "decode_step_tps", None),
                                  ("generated / wall", "gen_tps", None)],
              "TTFT (s)": [("P95", "ttft_s", "p95"), ("P99", "ttft_s", "p99")],
              "inter-token latency (ms)": [("P95", "itl_ms", "p95"), ("P99", "itl_ms", "p99")]}
    for ax, (title, series) in zip(axes, panels.items(), strict=True):
        for label, key, q in series:
            ys = [(r[key][q] if q else r[key]) or 0.0 for r in lv + [cap] * bool(cap)]
            line, = ax.plot(cs, ys[:len(cs)], "o-", label=label)
            if cap:  # the small-pool run, at the top concurrency
                ax.plot(cs[-1:], ys[-1:], "x", c=line.get_color(), label=f"{label}, small pool")
        ax.set(title=title, xlabel="concurrent requests", xticks=cs)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"kvchat bench load: model {report['model']['name']}, {report['machine']['cpu']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)

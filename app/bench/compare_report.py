"""The text report of `kvchat bench` (kvchat vs mlx-lm): header, table, notes."""

from __future__ import annotations


def skip_note(slow: list[int], limit: int, mlx_results: dict[int, dict], machine: dict) -> str:
    """Why mlx-lm was not run at ``slow`` lengths, with a time estimate when one is known."""
    lengths = ", ".join(str(n) for n in slow)
    note = f"mlx-lm skipped for length(s) {lengths}: longer than --mlx-lm-max-prompt {limit}"
    if mlx_results:
        n = max(mlx_results)
        rate = mlx_results[n]["prefill_tps"]
        note += (f"; mlx-lm as shipped prefilled {rate:.1f} tok/s here at {n} tokens, so "
                 f"{max(slow)} tokens would take ~{max(slow) / rate / 60:.0f} min")
    elif machine["backend"] == "cpu":
        note += ("; mlx-lm as shipped (quantized weights, MLX's reference BLAS) prefills "
                 "slowly on CPU: ~5-10 tok/s for the 135M default model, so 1000+ tokens "
                 "take minutes")
    return note + " (raise --mlx-lm-max-prompt to run them anyway)"


def _fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def print_report(report: dict) -> None:
    """Print the header, the table and the notes to stdout."""
    m, kv, ml = report["machine"], report["kvchat"], report["mlx_lm"]
    st = report["settings"]
    print(f"kvchat bench: model {report['model']['name']} ({report['model']['model_type']}, "
          f"{report['model']['path']})")
    print(f"machine: {m['cpu']}, {m['cpu_count']} cpus, {m['machine']}, backend {m['backend']}, "
          f"python {m['python']}, mlx {m['mlx']}, mlx-lm {m['mlx_lm']}")
    shim = "on" if kv["gemv_shim"] else "off"
    print(f"kvchat: {kv['weight_format']} weights on {kv['device']}, "
          f"BLAS {kv['blas'] or 'none preloaded (MLX linked BLAS)'} (GEMV shim {shim}), "
          f"in-process, paged KV (block {kv['block_size']}), prefill chunk {kv['prefill_chunk']}")
    if ml:
        libs = ", ".join(ml["blas_libraries"]) or "?"
        print(f"mlx-lm {ml['mlx_lm_version']}: {ml['weight_format']} weights as shipped on "
              f"{ml['device']}, no BLAS preload (MLX links {libs}), separate process, "
              f"generate_step")
    else:
        print("mlx-lm: not run")
    print(f"runs: greedy, EOS ignored, {st['gen_tokens']} decode tokens, "
          f"median of {st['repeats']} run(s); prefill tok/s = prompt / TTFT, "
          f"decode tok/s = (gen - 1) / (last - first token); ratio = kvchat / mlx-lm; "
          f"ITL percentiles nearest rank")
    print()
    header = ["length", "kvchat prefill", "mlx-lm prefill", "ratio", "kvchat decode",
              "mlx-lm decode", "ratio", "kvchat ITL p50/p95 ms", "mlx-lm ITL p50/p95 ms",
              "agree"]
    rows = [header, ["", "tok/s", "tok/s", "", "tok/s", "tok/s", "", "", "", "tokens"]]
    for r in report["results"]:
        k, x = r["kvchat"], r["mlx_lm"]
        skipped = None if x is not None else (
            "failed" if r["mlx_lm_skipped"] == "mlx-lm failed" else "skipped")
        rows.append([
            str(r["length"]),
            _fmt(k["prefill_tps"]),
            skipped or _fmt(x["prefill_tps"]),
            _fmt(r["prefill_ratio"], ".2f", "x"),
            _fmt(k["decode_tps"]),
            skipped or _fmt(x["decode_tps"]),
            _fmt(r["decode_ratio"], ".2f", "x"),
            f"{k['itl_p50_ms']:.1f} / {k['itl_p95_ms']:.1f}",
            skipped or f"{x['itl_p50_ms']:.1f} / {x['itl_p95_ms']:.1f}",
            "-" if r["greedy_agree_tokens"] is None
            else f"{r['greedy_agree_tokens']}/{k['generated_tokens']}",
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for j, row in enumerate(rows):
        print(" | ".join(c.rjust(w) if j > 1 or i else c.ljust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        if j == 1:
            print("-+-".join("-" * w for w in widths))
    print()
    print("notes:")
    for note in report["notes"]:
        print(f"  - {note}")
    print("  - agree = leading greedy tokens identical on both sides (weights differ in format)")

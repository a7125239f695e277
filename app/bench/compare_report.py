"""The report of `kvchat bench`: per-length rows with ratios to each peer, the coldness
check, and the text tables (prefill, decode, per-token latency).

Every ratio reads "how many times faster kvchat is": tok/s kvchat / tok/s peer for
prefill and decode, and peer ms / kvchat ms for the ITL P95 (so > 1 is kvchat ahead).
llama-bench (`app.bench.llama_bench`) times whole tests on its own random prompts: it has
no per-token latency, no tokens and no prompt cache, so its ITL and agreement are "n/a"
and its runs are left out of the coldness check (there is no cache to count).
"""

from __future__ import annotations

PEERS = (("llama_cpp", "llama.cpp"), ("llama_bench", "llama-bench"),
         ("mlx_lm", "mlx-lm"))  # JSON key, display name
NO_PROMPT_CACHE = ("llama_bench",)  # sides with no cache to count cached tokens from
SIDES = (("kvchat", "kvchat"),) + PEERS


def agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _div(a: float, b: float) -> float | None:
    return a / b if b else None


def ratios(kv: dict, peer: dict | None) -> dict | None:
    """kvchat's speed over a peer's: prefill, decode and ITL P95 (> 1: kvchat faster)."""
    if peer is None:
        return None
    return {"prefill": _div(kv["prefill_tps"], peer["prefill_tps"]),
            "decode": _div(kv["decode_tps"], peer["decode_tps"]),
            "itl_p95": (None if peer["itl_p95_ms"] is None  # llama-bench has none
                        else _div(peer["itl_p95_ms"], kv["itl_p95_ms"]))}


def _public(summary: dict | None) -> dict | None:
    # Token ids are kept only as the agreement count; they would bloat the JSON.
    if summary is None:
        return None
    return {k: v for k, v in summary.items() if k != "tokens"}


def _skip_reason(key: str, n: int, args, peers: list[str]) -> str:
    if key == "mlx_lm":
        if args.no_mlx_lm:
            return "--no-mlx-lm"
        if n > args.mlx_lm_max_prompt:
            return f"longer than --mlx-lm-max-prompt {args.mlx_lm_max_prompt}"
        return "mlx-lm failed"
    name = dict(PEERS)[key]
    return f"{name} failed" if name in peers else f"not requested (--peer {name})"


def build_results(lengths: list[int], sides: dict[str, dict[int, dict]], args,
                  peers: list[str], notes: list[str]) -> list[dict]:
    """One row per length: every side's summary, ratios and greedy agreement per peer.

    The flat ``prefill_ratio``/``decode_ratio``/``greedy_agree_tokens`` (vs mlx-lm) are
    kept for older readers of the JSON; ``ratios`` and ``greedy_agree`` hold every peer.
    """
    results = []
    for n in lengths:
        kv = sides["kvchat"][n]
        got = {key: sides.get(key, {}).get(n) for key, _ in PEERS}  # a side never run: none
        for (key, name) in SIDES:
            s = kv if key == "kvchat" else got[key]
            if s is not None and s["generated_tokens"] != args.gen_tokens:
                notes.append(f"length {n}: {name} decoded {s['generated_tokens']} tokens, "
                             f"not {args.gen_tokens}")
        row = {"length": n, "kvchat": _public(kv)}
        for key, _ in PEERS:
            row[key] = _public(got[key])
            row[f"{key}_skipped"] = None if got[key] else _skip_reason(key, n, args, peers)
        ml = got["mlx_lm"]
        row |= {
            "prefill_ratio": _div(kv["prefill_tps"], ml["prefill_tps"]) if ml else None,
            "decode_ratio": _div(kv["decode_tps"], ml["decode_tps"]) if ml else None,
            "greedy_agree_tokens": agree(kv["tokens"], ml["tokens"]) if ml else None,
            "ratios": {key: ratios(kv, got[key]) for key, _ in PEERS},
            "greedy_agree": {key: agree(kv["tokens"], got[key]["tokens"])
                             if got[key] and "tokens" in got[key] else None
                             for key, _ in PEERS},
        }
        results.append(row)
    return results


def warm_runs(sides: dict[str, dict[int, dict]]) -> list[dict]:
    """Every run whose engine reported cached prompt tokens, or did not report them."""
    warm = []
    for side, by_length in sides.items():
        if side in NO_PROMPT_CACHE:
            continue
        for n, summary in by_length.items():
            for i, run in enumerate(summary["runs"]):
                if run["cached_tokens"] != 0:
                    warm.append({"side": side, "length": n, "repeat": i,
                                 "cached_tokens": run["cached_tokens"]})
    return warm


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


def _table(title: str, header: list[str], units: list[str], rows: list[list[str]]) -> None:
    rows = [header, units] + rows
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print(title)
    for j, row in enumerate(rows):
        print(" | ".join(c.rjust(w) if j > 1 or i else c.ljust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        if j == 1:
            print("-+-".join("-" * w for w in widths))
    print()


def _header(report: dict) -> None:
    m, kv = report["machine"], report["kvchat"]
    ram = f"{m['ram_bytes'] / 2**30:.0f} GiB RAM" if m.get("ram_bytes") else "RAM ?"
    print(f"kvchat bench: model {report['model']['name']} ({report['model']['model_type']}, "
          f"{report['model']['path']})")
    load = f", load {m.get('load_avg')} -> {m.get('load_avg_end')}" if m.get("load_avg") else ""
    print(f"machine: {m['cpu']}, {m['cpu_count']} cpus{load}, {ram}, {m['machine']}, backend "
          f"{m['backend']}, python {m['python']}, mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, "
          f"llama-cpp-python {m.get('llama_cpp_python') or 'not installed'}")
    shim = "on" if kv["gemv_shim"] else "off"
    print(f"kvchat: {kv['weight_format']} weights on {kv['device']} "
          f"(matmuls: {kv.get('matmul', 'mlx')}), "
          f"BLAS {kv['blas'] or 'none preloaded (MLX linked BLAS)'} (GEMV shim {shim}), "
          f"in-process, paged KV (block {kv['block_size']}), prefill chunk "
          f"{kv['prefill_chunk']}, decode steps "
          f"{'launched ahead' if kv.get('pipelined') else 'one at a time'}, "
          f"a fresh prefix-cache tenant per run")
    lc, ml = report.get("llama_cpp"), report["mlx_lm"]
    if lc:
        print(f"llama.cpp (llama-cpp-python {lc['llama_cpp_python_version']}): "
              f"{lc['weight_format']} GGUF as shipped ({lc['gguf']}), {lc['n_threads']} "
              f"thread(s), n_batch {lc['n_batch']}, separate process, Llama.reset per run; "
              f"{lc['system_info']}")
    lb = report.get("llama_bench")
    if lb:
        b = lb["build"] or {}
        print(f"llama-bench {lb['binary']} (build {b.get('build_commit')} "
              f"({b.get('build_number')}), backends {b.get('backends')}, cpu "
              f"{b.get('cpu_info')}): {b.get('model_type') or lb['weight_format']} GGUF "
              f"({lb['gguf']}), {lb['threads']} thread(s), -r {lb['repetitions']}, pp N on an "
              f"empty context, tg at depth N, its own random prompts, no prompt cache")
    if ml:
        libs = ", ".join(ml["blas_libraries"]) or "?"
        print(f"mlx-lm {ml['mlx_lm_version']}: {ml['weight_format']} weights as shipped on "
              f"{ml['device']}, no BLAS preload (MLX links {libs}), separate process, "
              f"generate_step, a new prompt cache per run")
    st = report["settings"]
    print(f"runs: greedy, EOS ignored, {st['gen_tokens']} decode tokens, median of "
          f"{st['repeats']} cold run(s), each on its own prompt, after an untimed one of that "
          f"length; prefill tok/s = prompt / "
          f"TTFT, decode tok/s = (gen - 1) / (last - first token); vs X = kvchat / X "
          f"(> 1: kvchat faster; for ITL P95: X ms / kvchat ms); ITL nearest rank")
    print()


def print_report(report: dict) -> None:
    """Print the header, the prefill, decode and ITL tables, and the notes to stdout."""
    _header(report)
    cold = report["cold"]
    if not cold["all_cold"]:
        print(f"!!! NOT COLD: {len(cold['warm_runs'])} run(s) reported cached prompt tokens "
              "(see notes); their prefill figures measure a cache, not prefill !!!")
        print()
    shown = [(key, name) for key, name in PEERS if name in report["settings"]["peers"]]
    sides = [("kvchat", "kvchat")] + shown

    def cell(r: dict, key: str, text) -> str:
        s = r[key]
        if s is not None:
            return text(s)
        return "failed" if "failed" in r[f"{key}_skipped"] else "skipped"

    def ratio(r: dict, key: str, what: str) -> str:
        if what == "itl_p95" and r[key] and r[key]["itl_p95_ms"] is None:
            return "n/a"
        return _fmt((r["ratios"][key] or {}).get(what), ".2f", "x")

    def agreed(r: dict, key: str) -> str:
        if r[key] and r["greedy_agree"][key] is None:
            return "n/a"  # a side without tokens (llama-bench)
        return _fmt(r["greedy_agree"][key], "d", f"/{r['kvchat']['generated_tokens']}")

    def itl(s: dict) -> str:
        if s["itl_p95_ms"] is None:
            return "n/a"
        return f"{s['itl_p50_ms']:.1f} / {s['itl_p95_ms']:.1f}"

    def cached(r: dict) -> str:
        counts = [run["cached_tokens"] for key, _ in sides if r[key] and key not in NO_PROMPT_CACHE
                  for run in r[key]["runs"]]
        bad = [c for c in counts if c != 0]
        if not bad:
            return "0"
        return "? !" if None in bad else f"{sum(bad)} !"  # None: a run that did not say

    rows = [[str(r["length"])]
            + [cell(r, k, lambda s: _fmt(s["prefill_tps"])) for k, _ in sides]
            + [ratio(r, k, "prefill") for k, _ in shown] + [cached(r)]
            for r in report["results"]]
    _table("prefill (cold)", ["length"] + [n for _, n in sides] + [f"vs {n}" for _, n in shown]
           + ["cached"], ["tokens"] + ["tok/s"] * len(sides) + [""] * len(shown) + ["tokens"],
           rows)
    rows = [[str(r["length"])]
            + [cell(r, k, lambda s: _fmt(s["decode_tps"])) for k, _ in sides]
            + [ratio(r, k, "decode") for k, _ in shown]
            + [agreed(r, k) for k, _ in shown]
            for r in report["results"]]
    _table("decode", ["length"] + [n for _, n in sides] + [f"vs {n}" for _, n in shown]
           + [f"agree {n}" for _, n in shown],
           ["tokens"] + ["tok/s"] * len(sides) + [""] * len(shown) + ["tokens"] * len(shown),
           rows)
    rows = [[str(r["length"])]
            + [cell(r, k, itl) for k, _ in sides]
            + [ratio(r, k, "itl_p95") for k, _ in shown]
            for r in report["results"]]
    _table("inter-token latency", ["length"] + [n for _, n in sides]
           + [f"P95 vs {n}" for _, n in shown],
           ["tokens"] + ["P50 / P95 ms"] * len(sides) + [""] * len(shown), rows)
    print("notes:")
    for note in report["notes"]:
        print(f"  - {note}")
    print("  - agree = leading greedy tokens identical to kvchat's (weight formats differ)")
    print("  - cached = prompt tokens the engines reported served from a cache, all runs; "
          "0 = every prefill cold")

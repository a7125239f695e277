"""`kvchat eval weights`: the figures' arithmetic, then a quick run on the real default model
(kvchat's quantized CPU path and float32 against mlx-lm as shipped, in its own process)."""

from __future__ import annotations

import json
import math

import pytest

from app.eval import weights


def test_greedy_counts_first_divergence_and_equal_positions():
    assert weights.first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert weights.first_divergence([1, 2, 3], [7, 2, 3]) == 0
    assert weights.greedy_row([1, 2, 3, 4], [1, 5, 3, 4]) == {
        "first_divergence": 1, "equal": 3, "total": 4}
    assert weights.greedy_row([1, 2], [1]) == {"first_divergence": 1, "equal": 1, "total": 2}


def test_summary_pools_the_texts_and_takes_the_delta_from_the_perplexities():
    texts = [{"name": "a", "ids": [0] * 3, "gen_tokens": 2},
             {"name": "b", "ids": [0] * 4, "gen_tokens": 0}]
    ref = {"scores": [{"nll": [1.0, 1.0], "top1": [5, 6]},
                      {"nll": [2.0, 2.0, 2.0], "top1": [1, 2, 3]}], "greedy": [[9, 8], []]}
    ours = {"scores": [{"nll": [1.0, 2.0], "top1": [5, 0]},
                       {"nll": [2.0, 2.0, 2.0], "top1": [1, 2, 3]}], "greedy": [[9, 7], []]}
    s = weights.summarize(texts, {"kvchat": ours, "mlx_lm": ref})
    assert s["tokens_scored"] == 5
    assert s["perplexity"]["mlx_lm"] == pytest.approx(math.exp(8 / 5))
    assert s["perplexity"]["kvchat"] == pytest.approx(math.exp(9 / 5))
    assert s["delta_pct"]["kvchat"] == pytest.approx(100 * (math.exp(1 / 5) - 1))
    assert s["top1_agreement_vs_mlx_lm"]["kvchat"] == pytest.approx(4 / 5)
    assert [t["perplexity"]["kvchat"] for t in s["texts"]] == pytest.approx(
        [math.exp(1.5), math.exp(2.0)])
    assert len(s["greedy"]) == 1  # the document is scored, not decoded
    assert s["greedy"][0]["kvchat_vs_mlx_lm"] == {"first_divergence": 1, "equal": 1, "total": 2}


@pytest.mark.slow
@pytest.mark.subprocess  # mlx-lm runs in its worker process
def test_quick_run_on_the_default_model(default_model_ext, default_model, monkeypatch, tmp_path):
    import engine
    from app.cli import main

    # The CLI loads the models the session already has (quantized on the extension, float32).
    monkeypatch.setattr(engine, "load_model", lambda model=None, weights="auto":
                        default_model if weights == "float32" else default_model_ext)
    out = tmp_path / "w" / "weights.json"
    assert main(["eval", "weights", "--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())

    assert r["weights"]["kvchat_cpu_ext"] is True
    assert r["weights"]["kvchat"] == r["weights"]["mlx_lm"] != "float32"  # the same Q4/Q8
    assert r["weights"]["float32"] == "float32" and r["notes"] == []
    n = weights.QUICK["lengths"][0]
    assert r["tokens_scored"] == n - 1 and [t["tokens"] for t in r["texts"]] == [n - 1]
    ppl = r["perplexity"]
    for side in weights.SIDES:
        assert math.isfinite(ppl[side]) and ppl[side] > 1
        assert r["texts"][0]["perplexity"][side] == pytest.approx(ppl[side])  # one text
    for side in ("kvchat", "float32"):
        assert r["delta_pct"][side] == pytest.approx(100 * (ppl[side] / ppl["mlx_lm"] - 1))
        # the same weights: a few tenths of a percent apart at most, not another model
        assert abs(r["delta_pct"][side]) < 2
        assert 0.9 <= r["top1_agreement_vs_mlx_lm"][side] <= 1

    (g,) = r["greedy"]
    gen = weights.QUICK["gen_tokens"]
    assert g["prompt_tokens"] == n
    for side in weights.SIDES:
        assert len(g["tokens"][side]) == gen
    for side in ("kvchat", "float32"):
        row = g[f"{side}_vs_mlx_lm"]
        assert row["total"] == gen
        assert 1 <= row["first_divergence"] <= row["equal"] <= gen  # the first token agrees
        assert row == weights.greedy_row(g["tokens"]["mlx_lm"], g["tokens"][side])


def test_llama_cpp_peer_needs_its_tools_and_a_gguf(kvchat_cli, tmp_path):
    """``--peer llama.cpp`` says in one line what it lacks, before loading anything."""
    from engine.model.loader import default_gguf_path

    text = tmp_path / "text.txt"
    text.write_text("Some held-out text. " * 200)
    status, out, err = kvchat_cli("eval", "weights", "--peer", "llama.cpp", "--model",
                                  str(default_gguf_path()), "--llama-cpp-bin", str(tmp_path),
                                  "--text", str(text))
    assert status == 2 and out == "" and "llama-tokenize not found" in err
    assert err.strip().count("\n") == 0
    status, _, err = kvchat_cli("eval", "weights", "--peer", "llama.cpp")
    assert status == 2 and "--model FILE.gguf" in err


def test_llama_perplexity_output_is_read_with_or_without_its_final_line():
    from app.eval.llama_peer import final_perplexity

    runs = "perplexity: calculating\n[1]12.5000,[2]11.2500,[3]10.7500,[4]10.1250,\n"
    assert final_perplexity(runs + "Final estimate: PPL = 10.1250 +/- 0.5\n", 4) == 10.125
    # the final line missing (llama.cpp logs an error instead, or the capture was cut):
    # the running estimate after the last chunk is the same figure
    assert final_perplexity(runs + "Unexpected negative standard deviation\n", 4) == 10.125
    assert final_perplexity("[1]4083123.2944,[2]3.1e+07,", 2) == 3.1e7
    # a run that stopped before its last chunk gives nothing, not an earlier chunk's figure
    assert final_perplexity(runs, 5) is None
    assert final_perplexity("", 1) is None


def test_the_peer_report_shows_int8_activations_beside_llama_cpp():
    from app.eval.llama_peer import report

    base = {"model": "/m/F.gguf", "text": "/t/GPL-3", "chunks": 14, "ctx": 512,
            "scored_tokens": 3570, "kvchat_weights": "q4", "kvchat_matmul": "cpu-ext tiled "
            "int16-x", "kvchat_ppl": 18.2971, "llama_cpp_ppl": 18.3914, "diff_pct": -0.513}
    text = report({**base, "kvchat_int8_ppl": 18.3798, "int8_diff_pct": -0.063})
    assert "kvchat --activations int8           perplexity 18.3798" in text
    assert text.endswith("-0.513 % (int8 activations: -0.063 %)")
    plain = report({**base, "kvchat_int8_ppl": None, "int8_diff_pct": None})
    assert "int8" not in plain.replace("int16-x", "") and plain.endswith("-0.513 %")

"""`kvchat eval shift` (app/eval/shift.py): the three policies over one stream."""

from __future__ import annotations

import json
import math

import pytest

from app.eval.shift import evaluate, score_stream
from engine import Engine, EngineConfig

CONTEXT = 64


@pytest.fixture(scope="module")
def engine(quick_model):
    return Engine(quick_model, EngineConfig(kv_budget_bytes=16 << 20, prefix_cache=False))


@pytest.fixture(scope="module")
def stream(engine):
    from app.eval.docs import document

    return engine.tokenizer.encode(document(41, 3 * CONTEXT + 1, engine.count_tokens))[
        :3 * CONTEXT + 1]


def test_shift_and_fresh_agree_until_the_first_shift(engine, stream):
    runs = {p: score_stream(engine, stream, p, context=CONTEXT, sink_tokens=4)
            for p in ("shift", "fresh", "full")}
    (shift, at), (fresh, at_fresh), (full, none) = runs["shift"], runs["fresh"], runs["full"]
    # 4 blocks of 16: each shift drops 1 of the 3 after the sink, every 16 tokens
    assert at == at_fresh == list(range(CONTEXT, 3 * CONTEXT, 16)) and none == []
    assert shift.num_tokens == fresh.num_tokens == full.num_tokens == 3 * CONTEXT
    first = at[0]
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in
               zip(shift.nll[:first], full.nll[:first], strict=True))
    assert shift.nll[:first] == fresh.nll[:first]  # the same forwards, bit for bit
    assert shift.nll[first:] != fresh.nll[first:]  # kept K/V computed over more, or not
    assert engine.blocks.num_used_blocks == 0
    engine.blocks.check_invariants()


def test_evaluate_reports_every_policy(engine, stream):
    r = evaluate(engine, stream, context=CONTEXT, sink_tokens=4)
    assert r["shifts"] == 8 and r["first_shift"] == CONTEXT
    for p in ("shift", "fresh", "full"):
        assert r["ppl_after_first_shift"][p] > 1 and r["ppl_all"][p] > 1
    assert 0 < r["top1_agreement_shift_vs_fresh"] <= 1


def test_cli_writes_the_table_and_json(tmp_path, kvchat_cli):
    out = tmp_path / "out"
    code, stdout, err = kvchat_cli("eval", "shift", "--context", "64", "--streams", "1",
                                   "--out", str(out), "--json", str(tmp_path / "r.json"))
    assert code == 0, err
    assert "| seed 41 | 193 | 8 |" in stdout and (out / "shift_eval.md").exists()
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["context"] == 64 and len(result["streams"]) == 1


def test_kivi_needs_bits(capsys):
    from app.cli import main

    with pytest.raises(SystemExit, match="--kv-kivi needs --kv-bits"):
        main(["eval", "shift", "--kv-kivi"])

"""`kvchat eval kv`: probe construction and scoring without a model, then a quick run."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from app.eval import docs, kv, measure, probes
from app.eval.measure import QUICK, Plan


def words(text: str) -> int:
    """A stand-in tokenizer: one token per word."""
    return len(text.split())


# -- documents ---------------------------------------------------------------------------

def test_documents_are_deterministic_long_and_distinct():
    a = docs.document(3, 800, words)
    assert a == docs.document(3, 800, words)
    assert words(a) >= 800
    assert a != docs.document(4, 800, words)
    # facts are restated later in the text: the long-range part the KV cache must keep
    region = docs.Region(3)
    town = region.towns[0]
    long_doc = docs.document(3, 4000, words)
    assert long_doc.count(town.name) >= 2


# -- needles -----------------------------------------------------------------------------

def test_depths_are_centred_slices():
    assert probes.depths(2) == [0.25, 0.75]
    assert probes.depths(5) == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9])


def test_place_puts_each_item_at_its_depth():
    filler = [f"Filler sentence number {i} is here." for i in range(200)]  # 6 words each
    items = [(0.1, "NEEDLE-A is 1."), (0.5, "NEEDLE-B is 2."), (0.9, "NEEDLE-C is 3.")]
    text, placed = probes.place(filler, items, words)
    total = words(text)
    for (depth, sentence), at in zip(items, placed, strict=True):
        before = words(text[: text.index(sentence)])
        assert at == pytest.approx(before / total)
        assert abs(at - depth) < 0.01  # one filler sentence is 0.5 % of the text
    assert total == 200 * 6 + 3 * 3  # nothing lost, nothing doubled


def test_place_keeps_order_for_equal_depths_and_the_edges():
    filler = ["a b c."] * 10
    text, placed = probes.place(filler, [(0.0, "first x."), (0.0, "second y."), (1.0, "last z.")],
                                words)
    assert text.startswith("first x. second y. a b c.")
    assert text.endswith("a b c. last z.")
    assert placed[0] == 0.0 and placed[0] < placed[1] < placed[2]


def test_haystack_fits_the_target_and_holds_every_needle():
    needles = probes.pick_needles(7, 5)
    text, placed = probes.haystack(7, needles, 1000, words, overhead=40)
    assert 900 < words(text) <= 960
    for needle, depth, at in zip(needles, probes.depths(5), placed, strict=True):
        assert text.count(needle.fact) == 1
        assert abs(at - depth) < 0.03


def test_needle_values_are_unique_and_only_in_their_needle():
    plan = ((600, 2, 4), (1200, 1, 8))
    ps = probes.needle_probes(plan, words, overhead=30, seed=11)
    assert len(ps) == 2 * 4 + 8
    assert [p.context_tokens for p in ps] == [600] * 8 + [1200] * 8
    assert len({p.haystack for p in ps}) == 3
    for p in ps:
        doc = p.prompt.split("\n\nQuestion:")[0]
        assert doc.count(p.needle.value) == 1  # the filler never contains a needle's value
        assert p.prompt.rstrip().endswith("Answer with the number from the text above.")
        assert p.needle.question in p.prompt
    hay0 = [p for p in ps if p.haystack == 0]
    assert len({p.needle.key for p in hay0}) == 4 and len({p.needle.value for p in hay0}) == 4
    assert ps[0].recalled(f"The {ps[0].needle.key} is {ps[0].needle.value}.")
    assert not ps[0].recalled("I do not know.")


# -- JSON --------------------------------------------------------------------------------

@pytest.mark.parametrize("answer, value", [
    ('{"a": 1}', {"a": 1}),
    ('  [1, 2]  ', [1, 2]),
    ('```json\n{"a": [1, 2]}\n```', {"a": [1, 2]}),
    ('Sure! Here it is: {"name": "Alice", "age": 30} Hope it helps.', {"name": "Alice", "age": 30}),
    ('{"s": "a } brace", "t": "quote \\" and {"} tail', {"s": "a } brace", "t": 'quote " and {'}),
    ('{"outer": {"inner": true}} and {"second": 1}', {"outer": {"inner": True}}),
    ('{bad} then {"ok": null}', {"ok": None}),
])
def test_extract_json_finds_the_value(answer, value):
    assert probes.extract_json(answer) == value


@pytest.mark.parametrize("answer", [
    '{"population": 1,\n}',  # trailing comma: not JSON
    '{"a": 1',
    "no json here",
    "",
    "```python\nreturn {\n 'a': 1}\n```",
])
def test_extract_json_rejects_invalid(answer):
    assert probes.extract_json(answer) is None


def test_json_score_checks_keys():
    assert probes.json_score('{"name": "A", "age": 3}', ("name", "age")) == (True, True)
    assert probes.json_score('{"name": "A"}', ("name", "age")) == (True, False)
    assert probes.json_score("[1]", ("name",)) == (True, False)
    assert probes.json_score("{", ("name",)) == (False, False)
    assert len(probes.JSON_PROMPTS) >= 10 and len(probes.AGREEMENT_PROMPTS) >= 30


# -- agreement ---------------------------------------------------------------------------

def test_agreement_counts_up_to_the_first_divergence():
    ref = [1, 2, 3, 4]
    assert probes.agreement(ref, ref) == 1.0
    assert probes.agreement(ref, [1, 2, 9, 4]) == 0.5  # later matches do not count
    assert probes.agreement(ref, [9, 2, 3, 4]) == 0.0
    assert probes.agreement(ref, [1, 2]) == 0.5  # stopped early
    assert probes.agreement(ref, [1, 2, 3, 4, 5, 6, 7, 8]) == 0.5  # ran on
    assert probes.agreement([], []) == 1.0 and probes.agreement([], [1]) == 0.0


# -- command line ------------------------------------------------------------------------

class RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def parse(*argv: str) -> argparse.Namespace:
    from app.eval import add_parser

    p = RaisingParser(prog="kvchat")
    add_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["eval", "kv", *argv])


def test_formats_and_bits_flags():
    assert parse().formats is None and parse().bits_formats is None
    assert parse("--formats", "f16, f32").formats == ["f16", "f32"]
    assert parse("--bits", "16,32").bits_formats == ["f16", "f32"]
    assert parse("--quick", "--json", "x.json").quick
    assert parse("--bits", "16,8,4").bits_formats == ["f16", "q8", "q4"]
    with pytest.raises(ValueError, match=r"2-bit KV is not available; this build supports"):
        parse("--bits", "16,2")
    with pytest.raises(ValueError, match="unknown format q3"):
        parse("--formats", "f32,q3")
    with pytest.raises(ValueError, match="integers"):
        parse("--bits", "sixteen")
    with pytest.raises(ValueError, match="not allowed"):
        parse("--bits", "16", "--formats", "f32")
    assert kv.labels(["f32", "f16", "f32", "f32"]) == ["f32", "f16", "f32#2", "f32#3"]
    assert set(kv.BITS.values()) <= set(kv.FORMATS)


def test_every_format_is_a_valid_engine_config():
    from engine import EngineConfig

    for name, kwargs in kv.FORMATS.items():
        assert EngineConfig(**kwargs), name


def test_plan_fits_a_shorter_context():
    from app.eval.measure import FULL

    assert FULL.fit(8192) == FULL and FULL.num_needle_probes >= 40
    short = FULL.fit(4096)
    assert short.ppl_tokens == 4096 and short.speed_contexts == (1024,)
    assert [r[0] for r in short.needle] == [1024, 2048]


# -- with the model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_engine(default_model):
    from engine import Engine, EngineConfig

    eng = Engine(default_model, EngineConfig(kv_budget_bytes=64 << 20, prefix_cache=False))
    yield eng
    eng.shutdown()


@pytest.mark.slow
def test_scores_through_the_pool_match_the_runner_and_ignore_chunking(small_engine):
    import mlx.core as mx

    from app.eval.perplexity import SEQ_ID, all_logits, score_text
    from engine.executor import build_batch

    eng = small_engine
    ids = eng.encode_prompt(docs.document(5, 300, words), raw=True)[:300]
    whole = score_text(eng, ids, chunk=512)
    chunked = score_text(eng, ids, chunk=96)  # boundaries inside blocks and across them
    assert whole.num_tokens == chunked.num_tokens == 299
    assert whole.nll == pytest.approx(chunked.nll, abs=2e-3)
    assert sum(a != b for a, b in zip(whole.top1, chunked.top1, strict=True)) <= 2
    assert math.isclose(whole.perplexity, chunked.perplexity, rel_tol=1e-3)
    assert 1 < whole.perplexity < 100
    assert eng.blocks.block_tables == {}  # the sequence gave its blocks back
    # the last position of all_logits is what the engine's own forward returns
    piece = ids[:40]
    rows = []
    forwards = (lambda b: all_logits(eng.runner, b, eng.kv)[:, -1],
                lambda b: eng.runner(b, eng.kv))
    for forward in forwards:
        plan = eng.blocks.allocate(SEQ_ID, len(piece))
        batch = build_batch(eng.blocks, [SEQ_ID], mx.array([piece], dtype=mx.int32), [plan.slots])
        rows.append(forward(batch))
        mx.eval(rows[-1])
        eng.blocks.free(SEQ_ID)
    assert mx.allclose(rows[0], rows[1], atol=1e-4).item()


# `--quick` on a plan smaller still: the pipeline end to end (CLI, engines per phase,
# summary, table, plot, JSON), not figures worth reading. QUICK itself is checked above.
TINY = Plan(ppl_docs=1, ppl_tokens=192, agreement_prompts=2, agreement_tokens=8,
            needle=((256, 1, 2),), json_prompts=2, json_tokens=16, speed_contexts=(64,),
            speed_tokens=4)


def test_quick_plan_is_small_and_fits_the_default_context():
    assert QUICK.fit(8192) == QUICK and QUICK.num_needle_probes == 4
    assert (QUICK.ppl_docs, QUICK.ppl_tokens, QUICK.agreement_prompts, QUICK.json_prompts) == (
        1, 1024, 4, 3)
    assert TINY.fit(8192) == TINY


@pytest.mark.slow
def test_quick_run_end_to_end(session_models, monkeypatch, tmp_path, capsys):
    from app.cli import main

    monkeypatch.setattr(kv, "QUICK", TINY)
    monkeypatch.setattr(measure, "NEEDLE_MAX_TOKENS", 8)  # answers compared, recall not read
    # f32 twice: the second run is a fresh engine, so "ratio 1.0 and 100 % agreement"
    # is a real determinism check, not the reference compared with its own numbers
    assert main(["eval", "kv", "--quick", "--formats", "f32,f16,f32", "--out",
                 str(tmp_path / "out"), "--json", str(tmp_path / "kv.json")]) == 0
    table = capsys.readouterr().out
    saved = json.loads((tmp_path / "kv.json").read_text())
    assert saved["reference"] == "f32" and saved["quick"] is True
    assert [f["label"] for f in saved["formats"]] == ["f32", "f16", "f32#2"]
    assert (tmp_path / "out" / "kv_eval.md").read_text().strip() == table.strip()
    assert (tmp_path / "out" / "kv_eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    ref, f16, again = saved["formats"]
    for f in (ref, again):
        assert f["perplexity"]["ratio"] == 1.0
        assert f["perplexity"]["top1_agreement"] == 1.0
        assert f["agreement"]["mean"] == 1.0 and f["agreement"]["exact"] == 1.0
        assert f["needle"]["same_as_reference"] == 1.0
        assert f["kv"]["bytes_per_token"] == 46_080 and f["kv"]["bytes_ratio"] == 1.0
    assert again["json"]["answers"] == ref["json"]["answers"]
    assert again["needle"]["recall"] == ref["needle"]["recall"]

    assert f16["kv"]["bytes_per_token"] == 23_040 and f16["kv"]["bytes_ratio"] == 0.5
    assert f16["kv"]["max_sequences"] == 11 and ref["kv"]["max_sequences"] == 5  # 1 GiB, 4k
    assert abs(f16["perplexity"]["ratio"] - 1) < 0.01  # f16 K/V barely moves perplexity
    assert 0 <= f16["agreement"]["mean"] <= 1
    plan = saved["plan"]
    assert plan["ppl_tokens"] == 192 and plan["needle_probes"] == 2
    assert plan["agreement_prompts"] == 2 and plan["json_prompts"] == 2
    for f in saved["formats"]:
        assert f["perplexity"]["tokens"] == 191 and 1 < f["perplexity"]["value"] < 100
        assert f["needle"]["by_context"]["256"]["probes"] == 2
        assert len(f["needle"]["rows"]) == 2 and len(f["json"]["answers"]) == 2
        assert 0 <= f["json"]["valid"] <= 1
        speed = f["speed"]["64"]
        assert speed["decode_tps"] > 0 and speed["prefill_tps"] > 0
        assert speed["decoded_tokens"] == TINY.speed_tokens
    assert table.count("\n|") >= 14
    for needle in ("| KV bytes / token | 46,080 | 23,040 (0.50x) | 46,080 (1.00x) |",
                   "| max 4k-token sequences in 1 GiB | 5 | 11 | 5 |",
                   "needle recall @256 (2 probes; 95 % interval)", "decode tok/s @64",
                   "valid JSON (2 prompts)"):
        assert needle in table


def test_an_unreadable_text_is_one_line_and_exit_2(tmp_path, capsys):
    args = argparse.Namespace(formats=None, bits_formats=None, text=[str(tmp_path / "none.txt")],
                              quick=True, model=None, out=str(tmp_path / "out"), json=None)
    assert kv.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read --text" in err[0]
    assert not (tmp_path / "out").exists()  # nothing was run or written


def test_needle_intervals_are_wilson_95():
    from app.eval.report import frac_ci, wilson

    lo, hi = wilson(8, 10)
    assert (round(lo, 3), round(hi, 3)) == (0.490, 0.943)  # the textbook Wilson interval
    assert wilson(0, 10)[0] == 0.0 and 0.27 < wilson(0, 10)[1] < 0.28
    assert wilson(10, 10)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)
    assert frac_ci(33, 40) == "33/40 (82 %, 68-91)" and frac_ci(0, 0) == "-"

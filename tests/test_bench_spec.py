"""`kvchat bench spec` end to end on the default model (this session's load): both modes
run the same prompts and give the same greedy tokens (its exit status says so); timings are
never asserted."""

# Unsorted on purpose: engine goes first, as it preloads OpenBLAS before mlx.core loads.
from __future__ import annotations  # noqa: I001

import engine  # noqa: F401
import json

from app.bench import speculate
from app.cli import make_parser


def test_bench_spec_compares_both_modes(kvchat_cli):
    assert make_parser().parse_args(["bench", "spec"]).func is speculate.run
    rc, stdout, _ = kvchat_cli("bench", "spec", "--kv-budget", "32M", "--quick", "--rounds",
                               "1", "--gen", "12", "--streams", "2", "--json")
    out = json.loads(stdout)
    assert rc == 0 and out["same_tokens"] == {"alone": True, "streams": True}
    assert set(out["modes"]) == {"plain", "lookup"} and out["answers"] == 2
    plain, lookup = out["modes"]["plain"], out["modes"]["lookup"]
    # the quoted fact is copied from the document: lookup verifies and keeps drafts
    assert plain["proposed"] == 0 and 0 < lookup["accepted"] <= lookup["proposed"]
    assert plain["alone_tokens"] == lookup["alone_tokens"] > 0
    assert out["ratio_alone"] > 0 and out["ratio_streams"] > 0


def test_generate_speculates_on_request_and_says_so(kvchat_cli):
    """`--speculate` on the command line: same tokens as plain, drafts counted in --json;
    a bad value or a draft model that is missing is one clear line, exit 2."""
    prompt = ("Copy this list exactly: red, green, blue, yellow, purple, orange, red, green, "
              "blue, yellow, purple, orange, red, green, blue, yellow, purple, orange")
    outs = {}
    for mode in ("off", "lookup", "draft:default"):
        rc, stdout, _ = kvchat_cli("generate", "--prompt", prompt, "--max-tokens", "24",
                                   "--speculate", mode, "--no-disk-cache", "--json")
        assert rc == 0
        outs[mode] = json.loads(stdout)
    assert outs["lookup"]["tokens"] == outs["off"]["tokens"] == outs["draft:default"]["tokens"]
    assert outs["off"]["speculation"] == {"proposed": 0, "accepted": 0}
    for mode in ("lookup", "draft:default"):  # how many: measured, so machine-dependent
        spec = outs[mode]["speculation"]
        assert 0 <= spec["accepted"] <= spec["proposed"]
    rc, _, err = kvchat_cli("generate", "--prompt", "hi", "--speculate", "sometimes")
    assert rc == 2 and "must be off, lookup or draft:MODEL" in err
    rc, _, err = kvchat_cli("generate", "--prompt", "hi", "--speculate", "draft:/nowhere/x")
    assert rc == 2 and "not found" in err and "Traceback" not in err

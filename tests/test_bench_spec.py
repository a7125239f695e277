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

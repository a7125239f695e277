"""`kvchat bench prefix` end to end on a short shared prefix (a smoke test, no timing asserts).

The command runs in this process on the session's model; its warm-disk run is its own
fresh child process, as for a user.
"""

from __future__ import annotations

import json

import pytest


@pytest.mark.subprocess
def test_bench_prefix_runs_and_agrees(tmp_path, kvchat_cli):
    out = tmp_path / "prefix.json"
    code, _, err = kvchat_cli("bench", "prefix", "--prefix-tokens", "200", "--gen-tokens", "4",
                              "--json", str(out))
    assert code == 0, err
    r = json.loads(out.read_text())
    assert r["tokens_identical"] is True
    assert r["cache_source_ram"] == "memory" and r["cache_source_disk"] == "disk"
    assert r["shared_prefix_tokens"] >= 192 and r["prompt_tokens"] > r["shared_prefix_tokens"]

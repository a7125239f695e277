"""`kvchat bench prefix` end to end on a short shared prefix (a smoke test, no timing asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_prefix_runs_and_agrees(tmp_path):
    out = tmp_path / "prefix.json"
    proc = subprocess.run(
        [sys.executable, "-m", "app", "bench", "prefix", "--prefix-tokens", "200",
         "--gen-tokens", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["tokens_identical"] is True
    assert r["cache_source_ram"] == "memory" and r["cache_source_disk"] == "disk"
    assert r["shared_prefix_tokens"] >= 192 and r["prompt_tokens"] > r["shared_prefix_tokens"]

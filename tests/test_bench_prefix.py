"""`kvchat bench prefix` end to end on a short shared prefix (a smoke test, no timing asserts).

The command runs in this process on the session's model. Its warm-disk run, a fresh
process for a user (`app.fresh_process`, proven a new process by `kvchat cache verify` in
test_cache_cli.py), is `kvchat generate` on a fresh engine here: the disk is its only
warm source all the same.
"""

from __future__ import annotations

import contextlib
import io
import json


def test_bench_prefix_runs_and_agrees(tmp_path, kvchat_cli, monkeypatch):
    from app.bench import prefix
    from app.cli import main

    runs = []

    def generate_on_a_fresh_engine(prompt, model, max_tokens, cache_dir) -> dict:
        runs.append(cache_dir)
        file = tmp_path / "prompt.txt"
        file.write_text(prompt)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["generate", "--json", "--prompt-file", str(file), "--model",
                         model or "default", "--max-tokens", str(max_tokens),
                         "--cache-dir", cache_dir]) == 0
        return json.loads(out.getvalue())

    monkeypatch.setattr(prefix, "generate_in_fresh_process", generate_on_a_fresh_engine)
    out = tmp_path / "prefix.json"
    code, _, err = kvchat_cli("bench", "prefix", "--prefix-tokens", "200", "--gen-tokens", "4",
                              "--json", str(out))
    assert code == 0, err
    assert len(runs) == 1
    r = json.loads(out.read_text())
    assert r["tokens_identical"] is True
    assert r["cache_source_ram"] == "memory" and r["cache_source_disk"] == "disk"
    assert r["shared_prefix_tokens"] >= 192 and r["prompt_tokens"] > r["shared_prefix_tokens"]

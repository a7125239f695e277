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

    def generate_on_a_fresh_engine(prompt, model, max_tokens, cache_dir, *,
                                   disk_cache=True) -> dict:
        runs.append(disk_cache)
        file = tmp_path / "prompt.txt"
        file.write_text(prompt)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["generate", "--json", "--prompt-file", str(file), "--model",
                         model or "default", "--max-tokens", str(max_tokens),
                         "--cache-dir", cache_dir,
                         *([] if disk_cache else ["--no-disk-cache"])]) == 0
        return json.loads(out.getvalue())

    monkeypatch.setattr(prefix, "generate_in_fresh_process", generate_on_a_fresh_engine)
    out = tmp_path / "prefix.json"
    code, _, err = kvchat_cli("bench", "prefix", "--prefix-tokens", "200", "--gen-tokens", "4",
                              "--json", str(out))
    assert code == 0, err
    assert runs == [False, True]  # cold, then warm from disk
    r = json.loads(out.read_text())
    assert r["tokens_identical"] is True
    assert r["cache_source_ram"] == "memory" and r["cache_source_disk"] == "disk"
    assert r["cache_source_cold_new_process"] == "none"
    assert r["disk_restored_tokens"] >= 192 and r["ratio_disk_new_process"] > 0
    assert r["shared_prefix_tokens"] >= 192 and r["prompt_tokens"] > r["shared_prefix_tokens"]

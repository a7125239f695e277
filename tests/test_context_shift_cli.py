"""`--context-shift` as a user meets it: generate's JSON and summary line, the server's
``kvchat`` extras, the chat's line under an answer, and the one-line refusal."""

from __future__ import annotations

import json

import pytest

from engine.generation import RequestStats

PROMPT = "Tell me a long story about a lighthouse keeper."


def test_generate_runs_past_the_context_and_says_so(kvchat_cli):
    code, out, err = kvchat_cli("generate", "--prompt", PROMPT, "--json", "--max-tokens", "384",
                                "--max-context", "128", "--context-shift", "--no-disk-cache",
                                "--temp", "0")
    assert code == 0, err
    out = json.loads(out)
    shift = out["context_shift"]
    assert out["finish_reason"] == "length" and out["generation_tokens"] == 384
    assert shift["shifts"] >= 5 and shift["dropped_tokens"] >= 384 + out["prompt_tokens"] - 128
    assert out["kv"]["blocks_used"] <= 128 // 16  # bounded by the context, not the answer
    code, out, err = kvchat_cli("generate", "--prompt", PROMPT, "--max-tokens", "384",
                                "--max-context", "128", "--no-disk-cache")
    assert code == 0, err
    assert "max_tokens reduced from 384" in err and "context shifted" not in err
    assert err.rstrip().endswith("| length]")


def test_a_model_that_cannot_shift_refuses_in_one_line(tmp_path, default_model, kvchat_cli):
    from arch_zoo import build

    path = build(tmp_path / "smollm3", "smollm3", default_model.path, eos=2, seed=7)
    code, _, err = kvchat_cli("generate", "--model", str(path), "--prompt", "hi",
                              "--context-shift", "--weights", "float32", "--no-disk-cache")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "plain RoPE" in lines[0], err


def test_server_and_chat_report_the_shift():
    from app.server.responses import Reply
    from app.tui.generation import stats_line

    stats = RequestStats(prompt_tokens=10, generation_tokens=384, context_shifts=6,
                         shifted_tokens=288)
    extras = Reply("chat", "m", "fp", 384).extras(stats)
    assert extras["context_shifts"] == 6 and extras["shifted_tokens"] == 288
    assert "context shifted: 288 tokens dropped" in stats_line("length", stats)
    assert "context shifted" not in stats_line("length", RequestStats(generation_tokens=3))


@pytest.mark.subprocess
def test_serve_answers_past_the_context_and_says_so(tmp_path):
    import httpx
    from test_server_process import ServerProcess

    srv = ServerProcess(tmp_path, "--no-disk-cache", "--kv-budget", "64M", "--max-context",
                        "128", "--context-shift").start(timeout=600)
    try:
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=600, json={
            "model": "kvchat", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 300, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 300
        assert body["choices"][0]["finish_reason"] == "length"
        kvchat = body["kvchat"]
        assert kvchat["context_shifts"] >= 3 and kvchat["shifted_tokens"] >= 3 * 48
        assert kvchat["blocks_used"] <= 128 // 16
    finally:
        assert srv.stop() == 0, srv.log()
    assert "stopped: 0 blocks in use" in srv.log()

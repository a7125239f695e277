"""`kvchat generate` / `estimate` as a user runs them, on the real model.

The commands run in this process (`app.cli.main`, the session's model, stderr as a real
process would show it: see conftest's `kvchat_cli`); one error runs in a real process, to
prove the contract (exit status 2, one line, no traceback) holds from a cold interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = dict(os.environ)


def kvchat_process(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


@pytest.fixture
def kvchat(kvchat_cli):
    """`kvchat ARGS` in this process: (exit status, stdout, stderr)."""
    return kvchat_cli


def assert_one_line_error(code: int, err: str, needle: str):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvchat: error:"), err
    assert needle in lines[0]
    assert "Traceback" not in err


def test_generate_json_fields(kvchat):
    code, out, err = kvchat("generate", "--prompt", "What is the capital of France?", "--json",
                            "--max-tokens", "100000")  # more than fits: granted fewer, a note
    assert code == 0, err
    assert "kvchat: note: max_tokens reduced from 100000 to " in err
    out = json.loads(out)
    for key in ("text", "tokens", "prompt_tokens", "generation_tokens", "finish_reason",
                "ttft_s", "prefill_tps", "decode_tps", "kv"):
        assert key in out
    assert out["text"] == "The capital of France is Paris."
    assert out["generation_tokens"] == len(out["tokens"])
    kv = out["kv"]
    # float16 K/V next to the Q4/Q8 weights on the CPU extension, else float32 (float weights)
    assert kv["bytes_per_token"] == 30 * 2 * 3 * 64 * (2 if out["model"]["cpu_ext"] else 4)
    assert kv["blocks_used"] == -(-(out["prompt_tokens"] + out["generation_tokens"]) // 16)
    assert kv["bytes_used"] == kv["blocks_used"] * 16 * kv["bytes_per_token"]


def test_generate_streams_text_and_stats(tmp_path, kvchat):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Count from one to five.")
    code, out, err = kvchat("generate", "--prompt-file", str(prompt), "--max-tokens", "8",
                            "--raw")
    assert code == 0, err
    assert out.strip()
    assert "tok/s decode" in err


TOO_LONG_TENANT = "t" * 129
# (argv, a piece of the one error line). All fail before a model loads: run in-process.
BAD_INPUTS = [
    (["generate", "--seed", "-1"], "--seed"),
    (["generate", "--seed", str(2**64)], "--seed"),
    (["generate", "--seed", "2**70"], "--seed"),
    (["generate", "--seed", "1.5"], "--seed"),
    (["generate", "--temp", "nan"], "--temp"),
    (["generate", "--temp", "inf"], "--temp"),
    (["generate", "--temp", "-inf"], "--temp"),
    (["generate", "--temp", "-0.1"], "--temp"),
    (["generate", "--temp", "warm"], "--temp"),
    (["generate", "--top-p", "2"], "--top-p"),
    (["generate", "--top-p", "-1"], "--top-p"),
    (["generate", "--top-p", "nan"], "--top-p"),
    (["generate", "--top-k", "-1"], "--top-k"),
    (["generate", "--top-k", "1.5"], "--top-k"),
    (["generate", "--min-p", "1.5"], "--min-p"),
    (["generate", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "--max-tokens", "-5"], "--max-tokens"),
    (["generate", "--max-tokens", "1e3"], "--max-tokens"),
    (["generate", "--kv-budget", "infG"], "--kv-budget"),
    (["generate", "--kv-budget", "1e400G"], "--kv-budget"),
    (["generate", "--kv-budget", "0"], "--kv-budget"),
    (["generate", "--kv-budget", "-1G"], "--kv-budget"),
    (["generate", "--kv-budget", "nan"], "--kv-budget"),
    (["generate", "--kv-budget", "G"], "--kv-budget"),
    (["generate", "--kv-budget", "2000T"], "--kv-budget"),
    (["generate", "--kv-budget", "1000T"], "exceeds"),  # a valid size, beyond memory
    (["generate", "--block-size", "0"], "--block-size"),
    (["generate", "--block-size", "1025"], "--block-size"),
    (["generate", "--block-size", "-16"], "--block-size"),
    (["generate", "--permission-version", "-1"], "--permission-version"),
    (["generate", "--permission-version", "v2"], "--permission-version"),
    (["generate", "--tenant", ""], "--tenant"),
    (["generate", "--tenant", TOO_LONG_TENANT], "--tenant"),
    (["generate", "--tenant", "a\nb"], "--tenant"),
    (["generate", "--stop", ""], "--stop"),
    (["generate", "--weights", "int3"], "--weights"),
    (["generate", "--prompt-file", "/dev/zero"], "not a regular file"),
    (["generate", "--prompt-file", "/dev/null"], "not a regular file"),
    (["generate", "--prompt-file", "{dir}"], "not a regular file"),
    (["generate", "--prompt-file", "{fifo}"], "not a regular file"),
    (["generate", "--prompt-file", "{missing}"], "--prompt-file: cannot read"),
    (["generate", "--prompt", "a", "--prompt-file", "{file}"], "not allowed with"),
    (["generate", "--prompt", "   "], "the prompt is empty"),
    (["generate", "--prompt", "hi", "--model", "/no/such/model"], "model not found"),
    (["generate", "--prompt", "hi", "--model", "nobody/not-a-cached-repo"], "local Hugging Face"),
    (["generate", "--no-such-flag"], "unrecognized arguments"),
    (["estimate", "--tokens", "0"], "--tokens"),
    (["estimate", "--tokens", "-1"], "--tokens"),
    (["estimate", "--tokens", str(2**41)], "--tokens"),
    (["estimate", "--tokens", "8", "--batch", "0"], "--batch"),
    (["estimate", "--tokens", "8", "--block-size", "0"], "--block-size"),
    (["estimate", "--tokens", "8", "--kv-bits", "3"], "--kv-bits"),
    (["estimate", "--tokens", "8", "--kv-budget", "infG"], "--kv-budget"),
    (["estimate"], "--tokens"),
    (["estimate", "--tokens", "8", "--model", "/no/such/model"], "model not found"),
    (["bench", "--lengths", "0"], "--lengths"),
    (["bench", "--lengths", "a,b"], "--lengths"),
    (["bench", "--gen-tokens", "1"], "--gen-tokens"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--mlx-lm-max-prompt", "0"], "--mlx-lm-max-prompt"),
    (["bench", "load", "--requests", "0"], "--requests"),
    (["bench", "load", "--cancel-rate", "1.5"], "--cancel-rate"),
    (["bench", "load", "--concurrency", "0"], "--concurrency"),
    (["bench", "load", "--oversized", "-1"], "--oversized"),
    (["bench", "load", "--capacity-budget", "infG"], "--capacity-budget"),
    (["bench", "prefix", "--prefix-tokens", "0"], "--prefix-tokens"),
    (["bench", "prefix", "--gen-tokens", "-3"], "--gen-tokens"),
    (["bench", "decode", "--batch", "1"], "--batch"),
    (["bench", "kernel", "--iters", "0"], "--iters"),
    (["chat", "--temp", "nan"], "--temp"),
    (["chat", "--max-tokens", "0"], "--max-tokens"),
    (["--temp", "inf"], "--temp"),  # the default command is chat
    (["cache", "purge"], "purge needs"),
    (["frobnicate"], "invalid choice"),
    # bytes of the command line that are not UTF-8 reach Python as lone surrogates
    (["generate", "--prompt", "caf\udce9"], "not valid UTF-8"),
    (["generate", "--system", "\udcff", "--prompt", "hi"], "not valid UTF-8"),
    (["ask", "--doc", "{file}", "why\udcff"], "not valid UTF-8"),
    (["generate", "--stop", "\udcff"], "not valid UTF-8"),
]


@pytest.fixture
def paths(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "prompt.txt").write_text("hello")
    return {"dir": str(tmp_path), "fifo": str(fifo), "file": str(tmp_path / "prompt.txt"),
            "missing": str(tmp_path / "missing.txt")}


@pytest.mark.parametrize("argv,needle", BAD_INPUTS,
                         ids=[" ".join(a)[:60] for a, _ in BAD_INPUTS])
def test_bad_values_give_one_line_and_exit_2(argv, needle, paths, capsys):
    from app.cli import main

    argv = [a.format(**paths) if a.startswith("{") else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvchat: error: "), err
    assert needle in lines[0] and "Traceback" not in err


def test_bad_input_count():
    assert len(BAD_INPUTS) >= 40


@pytest.mark.parametrize("text,expected", [
    ("512M", 512 << 20), ("2G", 2 << 30), ("1.5GiB", 3 << 29), ("1048576", 1 << 20),
    ("64kb", 64 << 10), ("1T", 1 << 40),
])
def test_sizes(text, expected):
    from app.arg_types import size

    assert size(text) == expected


def test_good_values_parse():
    from app.cli import make_parser

    args = make_parser().parse_args([
        "generate", "--seed", str(2**64 - 1), "--temp", "0.7", "--top-p", "1", "--top-k", "0",
        "--tenant", "t" * 128, "--permission-version", "3", "--kv-budget", "256M",
        "--block-size", "1024", "--stop", "END"])
    assert (args.seed, args.temp, args.top_p, args.tenant) == (2**64 - 1, 0.7, 1.0, "t" * 128)
    assert (args.kv_budget, args.block_size, args.stop) == (256 << 20, 1024, ["END"])


def test_prompt_file_is_bounded_by_the_context(tmp_path):
    from app.arg_types import read_text_file

    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * 1001)
    with pytest.raises(ValueError, match="larger than 1,000 bytes"):
        read_text_file(str(big), 1000)
    assert read_text_file(str(big), 1001) == "a" * 1001
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_text_file(str(bad), 1000)


@pytest.mark.subprocess
def test_corrupt_model_directory(tmp_path):
    # the one real process: its whole stderr (imports, the failed load) is the one line
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    proc = kvchat_process("generate", "--prompt", "hi", "--model", str(tmp_path))
    assert_one_line_error(proc.returncode, proc.stderr, "cannot load model")


@pytest.mark.parametrize("header", [
    b"GGUF" + os.urandom(20),  # caught by the header check
    pytest.param(b"GGUF" + (3).to_bytes(4, "little") + bytes(16),  # the reader, in kvchat's
                 marks=pytest.mark.subprocess),  # own child process
], ids=["header", "reader"])
def test_corrupt_gguf(tmp_path, header, kvchat):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(header + os.urandom(200))
    assert_one_line_error(*kvchat("generate", "--prompt", "hi", "--model", str(bad))[::2],
                          "GGUF")
    models = Path(ENV["KVCHAT_HOME"]) / "models"
    assert not any("broken" in p.name for p in models.glob("*"))  # nothing half-written


def test_prompt_longer_than_context(tmp_path, kvchat):
    prompt = tmp_path / "long.txt"
    prompt.write_text("lorem ipsum dolor sit amet " * 2000)  # > 8192 tokens
    assert_one_line_error(*kvchat("generate", "--prompt-file", str(prompt))[::2],
                          "context holds 8192")


def test_estimate_matches_formula(kvchat):
    code, out, err = kvchat("estimate", "--tokens", "8192", "--batch", "2", "--json")
    assert code == 0, err
    out = json.loads(out)
    assert out["bytes_per_token"] == 30 * 2 * 3 * 64 * 2 == 23_040
    assert out["total_bytes"] == 23_040 * 8192 * 2
    assert out["blocks"] == 2 * 8192 // 16
    assert out["engine_memory_limit_bytes"] > 0
    assert out["kv_budget_blocks"] == (1 << 30) // (16 * 23_040)
    assert out["fits_kv_budget"] is True  # 360 MiB of blocks in a 1 GiB pool
    q8 = json.loads(kvchat("estimate", "--tokens", "100", "--kv-bits", "8", "--json")[1])
    assert q8["bytes_per_token"] == pytest.approx(30 * 2 * 3 * 64 * (1 + 4 / 64))


def test_hub_repo_id_from_local_cache(tmp_path, default_model, kvchat, monkeypatch):
    """A repo id resolves through the Hugging Face cache layout, offline."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = dict(model_type="qwen3", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                  rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=True,
                  vocab_size=default_model.config["vocab_size"], eos_token_id=2)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    repo = tmp_path / "hub" / "models--kvchat-test--tiny-qwen3"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    mx.save_safetensors(str(snap / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (snap / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model.path / name, snap / name)
    # as a process started with HF_HUB_CACHE and HF_HUB_OFFLINE=1 sees them (huggingface_hub
    # reads both at import)
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, out, err = kvchat("generate", "--model", "kvchat-test/tiny-qwen3", "--prompt", "hello",
                            "--raw", "--json", "--max-tokens", "3")
    assert code == 0, err
    out = json.loads(out)
    assert out["model"]["path"] == str(snap)
    assert out["kv"]["bytes_per_token"] == 1 * 2 * 1 * 16 * 4


def test_unusable_cache_dir_still_answers_with_one_warning(tmp_path, kvchat):
    # a world-writable cache dir could hold planted entries: the store is off, the answer comes
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    code, out, err = kvchat("generate", "--prompt", "Hi", "--max-tokens", "2",
                            "--cache-dir", str(shared), "--kv-budget", "64M", "--json")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "disk prefix cache" in warnings[0], err
    data = json.loads(out)
    assert data["generation_tokens"] == 2 and data["disk_cache"]["warning"]
    assert (shared.stat().st_mode & 0o777) == 0o777  # a foreign dir keeps its mode
    assert not any(shared.iterdir())  # and nothing was written into it


def test_error_lines_escape_control_characters_in_names(tmp_path, capsys):
    from app.cli import main

    hostile = str(tmp_path / "report\x1b[2J\x1b]0;pwned\x07.txt")
    assert main(["generate", "--prompt-file", hostile]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err  # nothing reaches the terminal raw
    assert "report\\x1b[2J\\x1b]0;pwned\\x07.txt" in err and err.count("\n") == 1

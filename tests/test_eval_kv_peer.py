"""`kvchat eval kv --peer llama.cpp`: the formats' mapping to llama.cpp's cache types, the
options each llama-perplexity run gets, and the side-by-side deltas.

The peer's binaries are stand-ins here (shell scripts recording their arguments), as CI
has no llama.cpp; kvchat's side scores the real model through real pools. The measured
table against the real `llama-perplexity` is in the README.
"""

from __future__ import annotations

import shlex

import pytest

from app.eval import kv, kv_peer


def test_every_peer_format_is_a_kv_format_and_bits_match():
    assert set(kv_peer.LLAMA_TYPES) <= set(kv.FORMATS)
    assert set(kv_peer.DEFAULT_FORMATS) <= set(kv_peer.LLAMA_TYPES)
    bits = {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8, "q4_0": 4}
    for name, (ctk, ctv) in kv_peer.LLAMA_TYPES.items():
        cfg = kv.FORMATS[name]
        k = cfg.get("k_bits", cfg.get("kv_bits", 16 if "kv_dtype" in cfg else None))
        v = cfg.get("v_bits", cfg.get("kv_bits", 16 if "kv_dtype" in cfg else None))
        if cfg.get("kv_dtype") == "float32":
            k = v = 32
        assert (bits[ctk], bits[ctv]) == (k, v), name


def fake_tools(tmp_path, ids: list[int], ppl: dict[str, float]):
    """llama-tokenize printing ``ids``; llama-perplexity printing ``ppl[ctk/ctv]`` and
    appending its arguments to calls.txt."""
    calls = tmp_path / "calls.txt"
    (tmp_path / "llama-tokenize").write_text(f"#!/bin/sh\necho '{ids}'\n")
    cases = "".join(f"  *'-ctk {k.split('/')[0]} -ctv {k.split('/')[1]}'*) p={v};;\n"
                    for k, v in ppl.items())
    (tmp_path / "llama-perplexity").write_text(
        f"#!/bin/sh\necho \"$*\" >> {shlex.quote(str(calls))}\n"
        f"case \"$*\" in\n{cases}  *) exit 1;;\nesac\n"
        "echo \"Final estimate: PPL = $p +/- 0.1\" >&2\n")
    for name in ("llama-tokenize", "llama-perplexity"):
        (tmp_path / name).chmod(0o755)
    return calls


@pytest.mark.slow
def test_peer_runs_each_format_in_both_engines(kvchat_cli, default_model, tmp_path):
    text = tmp_path / "held-out.txt"
    text.write_text("The lighthouse keeper counted the ships that passed at night. " * 40)
    ids = default_model.tokenizer.encode(text.read_text())
    calls = fake_tools(tmp_path, ids, {"f16/f16": 20.0, "q4_0/q4_0": 21.0})
    out_json = tmp_path / "peer.json"
    status, out, err = kvchat_cli("eval", "kv", "--peer", "llama.cpp", "--llama-cpp-bin",
                                  str(tmp_path), "--text", str(text), "--ctx", "64",
                                  "--chunks", "1", "--formats", "f16,q4",
                                  "--json", str(out_json))
    assert status == 0, err
    runs = calls.read_text().splitlines()
    assert len(runs) == 2
    for run, pair in zip(runs, ["f16 -ctv f16", "q4_0 -ctv q4_0"], strict=True):
        assert "-c 64 -b 64 --chunks 1" in run and f"-fa on -ctk {pair}" in run
    import json

    r = json.loads(out_json.read_text())
    assert r["chunks"] == 1 and r["scored_tokens"] == 31 and r["reference"] == "f16"
    rows = {row["format"]: row for row in r["formats"]}
    assert rows["q4"]["llama_cpp_delta_pct"] == pytest.approx(5.0)
    assert rows["f16"]["kvchat_delta_pct"] == 0
    # kvchat's side really scored through each pool: the formats' perplexities differ
    assert rows["q4"]["kvchat_ppl"] != rows["f16"]["kvchat_ppl"] > 1
    assert "| q4 | " in out and "| q4_0/q4_0 | 21.0000 | +5.00 % |" in out


def test_peer_refuses_formats_llama_cpp_lacks_and_missing_tools(kvchat_cli, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("text " * 50)
    status, out, err = kvchat_cli("eval", "kv", "--peer", "llama.cpp", "--llama-cpp-bin",
                                  str(tmp_path), "--text", str(text))
    assert status == 2 and out == "" and "llama-tokenize not found" in err
    assert err.strip().count("\n") == 0
    status, _, err = kvchat_cli("eval", "kv", "--peer", "llama.cpp", "--formats", "f16,q8",
                                "--model", str(tmp_path))
    assert status == 2 and "needs a GGUF model" in err

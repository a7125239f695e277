"""`kvchat ask`: document Q&A end to end with the real default model.

The pinned document prefix is served from RAM to the second question and from disk after
a restart (a new process: the one child process here); a document over the budget takes
the retrieval path and says what it left out; bad files fail alone with one line, before
the model loads. Everything but the restart runs `app.cli.main` in this process, on the
session's loaded model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pdf_maker import make_pdf

from app.eval.probes import haystack, pick_needles

QUESTION_SUFFIX = " Answer with the number from the text."


def kvchat_process(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`kvchat ARGS` as a user starts it: a new process, nothing shared with this one."""
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "NO_COLOR": "1"})


@pytest.fixture
def kvchat(kvchat_cli):
    """`kvchat ARGS` in this process: (exit status, stdout, stderr)."""
    return kvchat_cli


@pytest.fixture(scope="module")
def needle_doc(tmp_path_factory, default_model):
    """A ~1.5k-token generated document with three facts, and their needles."""
    def count(text: str) -> int:
        return len(default_model.tokenizer._tokenizer.encode(text, add_special_tokens=False))

    needles = pick_needles(42, 3)
    text, _ = haystack(42, needles, 1500, count)
    path = tmp_path_factory.mktemp("docs") / "history.txt"
    path.write_text(text)
    return path, needles


@pytest.mark.subprocess
def test_follow_up_hits_ram_and_a_restart_hits_disk(needle_doc, tmp_path, kvchat):
    path, needles = needle_doc
    store = str(tmp_path / "store")
    common = ["--doc", str(path), "--json", "--cache-dir", store, "--max-tokens", "24"]
    code, out, err = kvchat("ask", *common, "--session", "hist",
                            stdin="".join(n.question + QUESTION_SUFFIX + "\n"
                                          for n in needles[:2]))
    assert code == 0, err
    a, b = (json.loads(line) for line in out.splitlines())
    assert a["placement"]["mode"] == "whole" and a["cached_tokens"] == 0
    assert a["session"] == "hist" and a["prefix_tokens"] > 1400
    # the second question reuses every full block of the document (RAM)
    block = 16
    assert b["cache_source"] == "memory"
    assert b["cached_tokens"] >= a["prefix_tokens"] // block * block
    assert "nothing left out" in a["left_out"]
    assert needles[0].value in a["answer"]

    # a restart: a new process, whose only source of the document's blocks is the disk
    again = kvchat_process("ask", *common, "--session", "hist",
                           needles[2].question + QUESTION_SUFFIX)
    assert again.returncode == 0, again.stderr
    c = json.loads(again.stdout)
    assert c["cache_source"] == "disk"
    assert c["cached_tokens"] >= a["prefix_tokens"] // block * block

    code, out, _ = kvchat("cache", "ls", "--cache-dir", store)
    assert code == 0 and "hist" in out and "history.txt" in out
    code, out, _ = kvchat("cache", "purge", "--session", "hist", "--cache-dir", store)
    assert code == 0 and "hist" in out
    code, out, err = kvchat("ask", *common, "--session", "hist",
                            needles[2].question + QUESTION_SUFFIX)
    assert code == 0, err
    assert json.loads(out)["cached_tokens"] == 0  # its blocks went with it (a fresh engine)


def test_a_changed_document_is_a_new_session(needle_doc, tmp_path, kvchat):
    path, needles = needle_doc
    store = str(tmp_path / "store")
    doc = tmp_path / "d.txt"
    doc.write_text(path.read_text())
    common = ["--doc", str(doc), "--json", "--cache-dir", store, "--max-tokens", "4",
              "--session", "d"]
    first = json.loads(kvchat("ask", *common, "q?")[1])
    doc.write_text("An entirely different opening. " + path.read_text())
    out = json.loads(kvchat("ask", *common, "q?")[1])
    # only the blocks of the system text before the document match; none of the document's
    assert out["cached_tokens"] < 64 < first["prefix_tokens"]
    assert "new session" in out["notice"]


def test_over_budget_document_takes_retrieval_and_reports_it(needle_doc, kvchat):
    path, needles = needle_doc
    # a 40 MiB float32 pool holds ~900 tokens: the 1.5k-token document cannot fit whole
    code, out, err = kvchat("ask", "--doc", str(path), "--json", "--no-disk-cache",
                            "--kv-budget", "40M", "--weights", "float32", "--max-tokens", "24",
                            needles[1].question + QUESTION_SUFFIX)
    assert code == 0, err
    r = json.loads(out)
    assert r["placement"]["mode"] == "retrieval"
    assert r["placement"]["left_out"] and r["placement"]["left_out_tokens"] > 0
    assert "left out history.txt:" in r["left_out"]
    assert r["prompt_tokens"] + 24 <= r["budget"]["total"]
    assert r["session"] is None  # nothing pinned on the retrieval path


@pytest.mark.parametrize("name,data,needle", [
    ("blob.bin", bytes(range(256)) * 4, "binary"),
    ("empty.txt", b"", "is empty"),
    ("scan.pdf", make_pdf(["", ""]), "no text layer"),
    ("missing.txt", None, "cannot read"),
], ids=["binary", "empty", "scan", "missing"])
def test_bad_documents_fail_alone_with_one_line(tmp_path, name, data, needle, kvchat,
                                                monkeypatch):
    import engine

    path = tmp_path / name
    if data is not None:
        path.write_bytes(data)
    monkeypatch.setattr(engine, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    code, _, err = kvchat("ask", "--doc", str(path), "question?")
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err

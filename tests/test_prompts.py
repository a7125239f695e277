"""Pinned prompts: the document's ids are the same for every question and history, so its
blocks are reusable; the engine names them and writes them with a session's TTL."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.errors import RequestError
from engine.prompts import SPLIT_MARK, chat_ids, pinned_ids, plain_ids

DOC = "The lighthouse keeper logged every ship. " * 40


def test_the_prefix_is_the_same_for_every_question(default_model):
    tok = default_model.tokenizer
    a, na = pinned_ids(tok, DOC, "Who logged ships?", system="Answer briefly.")
    b, nb = pinned_ids(tok, DOC, "Another question entirely", system="Answer briefly.",
                       history=[{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "hello"}])
    assert na == nb and a[:na] == b[:nb] and len(a) > na and len(b) > nb
    assert na >= len(plain_ids(tok, DOC))
    # the ids decode to what the chat template renders, document before the question
    text = tok._tokenizer.decode(a)
    assert text.index("lighthouse") < text.index("Who logged ships?")
    assert text.startswith("<|im_start|>system") and text.endswith("assistant\n")
    other, n_other = pinned_ids(tok, DOC + " One more line.", "Who?", system="Answer briefly.")
    assert other[:n_other] != a[:na]


def test_bad_questions_and_marker_are_refused(default_model):
    tok = default_model.tokenizer
    with pytest.raises(RequestError, match="empty"):
        pinned_ids(tok, DOC, "   ", system="s")
    with pytest.raises(RequestError, match="marker"):
        pinned_ids(tok, DOC + SPLIT_MARK, "q", system="s")
    with pytest.raises(RequestError, match="empty"):
        chat_ids(tok, "")


def test_prefix_hashes_and_session_ttl_reach_the_disk(default_model, tmp_path):
    from engine import Engine, EngineConfig

    eng = Engine(default_model, EngineConfig(kv_budget_bytes=64 << 20, disk_cache=True,
                                             disk_cache_dir=str(tmp_path)))
    try:
        ids, n = eng.encode_pinned(DOC, "Who logged ships?", system="Answer briefly.")
        hashes = eng.prefix_hashes(ids[:n])
        assert len(hashes) == n // 16
        assert hashes != eng.prefix_hashes(ids[:n], tenant="bob")  # tenants never share
        with pytest.raises(RequestError, match="cache_ttl_s"):
            eng.submit(ids, SamplingParams(max_tokens=1), cache_ttl_s=-1)
        eng.generate_text(ids, SamplingParams(max_tokens=1), cache_ttl_s=7 * 86400)
    finally:
        eng.shutdown()
    store = eng.prefix.store
    entries = {bytes.fromhex(e.hash): e for e in store.entries()}
    assert set(hashes) <= set(entries)
    for h in hashes:  # written with the session's week, not the default day
        assert entries[h].expires - entries[h].created == pytest.approx(7 * 86400, abs=5)
    assert store.remove(hashes) == len(hashes) and store.remove(hashes) == 0

"""KL divergence in `kvchat eval kv`: exact where the reference's top tokens hold all the
mass, a lower bound otherwise, zero for the same run, and user texts as the documents."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from app.eval import measure
from app.eval.perplexity import KL_TOP, kl_divergence, score_text, top_logprobs
from engine import Engine, EngineConfig


def log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def full_kl(p: mx.array, q: mx.array) -> np.ndarray:
    return np.array((mx.exp(p) * (p - q)).sum(axis=-1))


def test_equals_the_full_kl_when_the_top_holds_the_vocabulary():
    p, q = (log_softmax(mx.random.normal((5, KL_TOP)) * 3) for _ in range(2))
    np.testing.assert_allclose(np.array(kl_divergence(top_logprobs(p), q)), full_kl(p, q),
                               rtol=1e-4, atol=1e-6)


def test_is_a_tight_lower_bound_over_a_large_vocabulary():
    p = log_softmax(mx.random.normal((4, 4096)) * 4)  # peaked: the top 256 hold most mass
    q = log_softmax(p + mx.random.normal(p.shape) * 0.3)
    got, want = np.array(kl_divergence(top_logprobs(p), q)), full_kl(p, q)
    assert (got <= want + 1e-6).all() and (got >= 0.8 * want).all(), (got, want)


def test_identical_distributions_have_none():
    p = log_softmax(mx.random.normal((3, 1000)))
    assert np.abs(np.array(kl_divergence(top_logprobs(p), p))).max() < 1e-6


@pytest.fixture(scope="module")
def texts_engines(default_model_ext):
    cfg = dict(kv_budget_bytes=32 << 20, prefix_cache=False)
    engines = [Engine(default_model_ext, EngineConfig(kv_dtype="float16", **cfg)),
               Engine(default_model_ext, EngineConfig(kv_bits=4, **cfg))]
    yield engines
    for e in engines:
        e.shutdown()


def test_scoring_against_a_reference_run(texts_engines):
    f16, q4 = texts_engines
    gpl = Path("/usr/share/common-licenses/GPL-3")
    text = gpl.read_text() if gpl.exists() else "the quick brown fox jumps " * 200
    plan = measure.Plan(ppl_docs=1, ppl_tokens=300, agreement_prompts=0, agreement_tokens=0,
                        needle=(), json_prompts=0, json_tokens=0, speed_contexts=(),
                        speed_tokens=0)
    inputs = measure.build_inputs(f16, plan, [text])
    ids = inputs.ppl_docs[0]
    assert len(ids) == 300 and ids == f16.encode_prompt(text, raw=True)[:300]
    ref = score_text(f16, ids, chunk=128, keep=True)
    again = score_text(f16, ids, chunk=128, reference=ref)
    quant = score_text(q4, ids, chunk=128, reference=ref)
    assert len(ref.logprobs) == 3 and not ref.kl  # kept, not compared
    assert max(abs(k) for k in again.kl) < 1e-4  # the same run: nothing diverges
    assert len(quant.kl) == 299 and sum(quant.kl) / 299 > 1e-4  # 4-bit K/V: it does

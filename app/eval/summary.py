"""Figures of one KV format against the reference run: what the table and JSON show.

Imported at evaluation time only (`perplexity` loads MLX).
"""

from __future__ import annotations

import math

from app.eval import probes
from app.eval.measure import Inputs
from app.eval.perplexity import TokenScores, compare


def summarize(raw: dict, ref: dict, inputs: Inputs) -> dict:
    """One format's figures, compared with the reference run ``ref`` (maybe itself)."""
    kv = dict(raw["kv"], bytes_ratio=raw["kv"]["bytes_per_token"] / ref["kv"]["bytes_per_token"])
    agree = [probes.agreement(r, c) for r, c in zip(ref["agreement_tokens"],
                                                    raw["agreement_tokens"], strict=True)]
    json_rows = [probes.json_score(a, keys) for a, (_, keys) in zip(raw["json_answers"],
                                                                     inputs.json, strict=True)]
    return {
        "kv": kv,
        "perplexity": _perplexity(raw["ppl_scores"], ref["ppl_scores"]),
        "agreement": {"prompts": len(agree), "mean": sum(agree) / len(agree),
                      "exact": sum(a == 1.0 for a in agree) / len(agree), "per_prompt": agree},
        "needle": dict(_needles(inputs, raw["needle_answers"], ref["needle_answers"]),
                       prefix_cached_tokens=raw["needle_cached_tokens"]),
        "json": {"prompts": len(json_rows), "valid": sum(v for v, _ in json_rows) / len(json_rows),
                 "with_keys": sum(k for _, k in json_rows) / len(json_rows),
                 "answers": raw["json_answers"]},
        "speed": {str(k): v for k, v in raw["speed"].items()},
        "seconds": raw["seconds"],
    }


def _perplexity(scores: list[TokenScores], ref_scores: list[TokenScores]) -> dict:
    """Perplexity over all documents, its ratio to the reference, per-document figures."""
    nll = sum(sum(s.nll) for s in scores)
    n = sum(s.num_tokens for s in scores)
    ppl = math.exp(nll / n)
    ref_ppl = math.exp(sum(sum(s.nll) for s in ref_scores) / n)
    tf = [compare(r, s) for r, s in zip(ref_scores, scores, strict=True)]
    kl = sum(sum(s.kl) for s in scores) / n if all(s.kl for s in scores) else 0.0
    return {
        "value": ppl, "ratio": ppl / ref_ppl, "tokens": n, "kl_mean": kl,
        "docs": [{"tokens": s.num_tokens, "perplexity": s.perplexity, **t}
                 for s, t in zip(scores, tf, strict=True)],
        "top1_agreement": sum(t["top1_agreement"] * s.num_tokens
                              for s, t in zip(scores, tf, strict=True)) / n,
    }


def _needles(inputs: Inputs, answers: list[str], ref_answers: list[str]) -> dict:
    """Recall overall and by context length, and every probe's answer."""
    rows, by_context = [], {}
    for (probe, _), answer, ref_answer in zip(inputs.needle, answers, ref_answers, strict=True):
        ok = probe.recalled(answer)
        rows.append({"context": probe.context_tokens, "haystack": probe.haystack,
                     "depth": round(probe.depth, 3), "placed_depth": round(probe.placed_depth, 3),
                     "key": probe.needle.key, "value": probe.needle.value, "answer": answer,
                     "recalled": ok, "same_as_reference": answer == ref_answer})
        c = by_context.setdefault(str(probe.context_tokens), {"probes": 0, "recalled": 0})
        c["probes"] += 1
        c["recalled"] += ok
    for c in by_context.values():
        c["recall"] = c["recalled"] / c["probes"]
    return {"probes": len(rows), "recall": sum(r["recalled"] for r in rows) / len(rows),
            "same_as_reference": sum(r["same_as_reference"] for r in rows) / len(rows),
            "by_context": by_context, "rows": rows}

"""What `kvchat eval kv` measures on one KV format: one engine per phase, raw figures.

Comparisons with the reference format happen later (`app.eval.kv.summarize`); here
each format is run alone, on inputs built once (`Inputs`) so every format sees the
same token ids. Everything is greedy and deterministic: the same format run twice
gives the same figures (bar the timings).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from app.eval import docs, probes

if TYPE_CHECKING:
    from engine import Engine, LoadedModel

BUDGET_BYTES = 1 << 30  # the pool of every eval engine, and the budget of the capacity figure
CAPACITY_TOKENS = 4096  # "max concurrent sequences of this many tokens"
NEEDLE_MAX_TOKENS = 24  # "The combination of the harbour master's safe is 1234." fits
DOC_SEED, SPEED_SEED, NEEDLE_SEED = 1, 500, 1000


@dataclass(frozen=True, slots=True)
class Plan:
    """How much of each measurement to run."""

    ppl_docs: int
    ppl_tokens: int
    agreement_prompts: int
    agreement_tokens: int
    needle: tuple[tuple[int, int, int], ...]  # (context tokens, haystacks, needles each)
    json_prompts: int
    json_tokens: int
    speed_contexts: tuple[int, ...]
    speed_tokens: int  # decoded per speed run; the first is prefill's, the rest are timed

    @property
    def num_needle_probes(self) -> int:
        return sum(h * n for _, h, n in self.needle)

    def fit(self, max_context: int) -> Plan:
        """The plan cut to a model's context: longer texts and probes are left out."""
        return replace(
            self, ppl_tokens=min(self.ppl_tokens, max_context),
            needle=tuple(r for r in self.needle if r[0] + NEEDLE_MAX_TOKENS <= max_context),
            speed_contexts=tuple(n for n in self.speed_contexts
                                 if n + self.speed_tokens <= max_context))


FULL = Plan(ppl_docs=3, ppl_tokens=4096, agreement_prompts=32, agreement_tokens=64,
            needle=((1024, 2, 5), (2048, 1, 10), (4096, 1, 10), (7168, 1, 10)),
            json_prompts=12, json_tokens=96, speed_contexts=(1024, 4096), speed_tokens=33)
QUICK = Plan(ppl_docs=1, ppl_tokens=1024, agreement_prompts=4, agreement_tokens=16,
             needle=((1024, 1, 4),), json_prompts=3, json_tokens=48, speed_contexts=(512,),
             speed_tokens=9)


@dataclass(slots=True)
class Inputs:
    """Token ids of every prompt and text, shared by all formats."""

    ppl_docs: list[list[int]]
    agreement: list[list[int]]
    needle: list[tuple[probes.NeedleProbe, list[int]]]
    json: list[tuple[list[int], tuple[str, ...]]]
    speed: dict[int, list[int]]


def build_inputs(engine: Engine, plan: Plan, texts: list[str] = ()) -> Inputs:
    """Token ids for ``plan`` (already `Plan.fit` to the engine's context); ``texts`` (the
    user's held-out files) replace the generated documents of the perplexity phase, each
    cut to ``plan.ppl_tokens`` tokens."""
    tok = engine.tokenizer

    def count(text: str) -> int:
        return len(tok.encode(text))

    def raw_doc(seed: int, n: int) -> list[int]:
        return engine.encode_prompt(docs.document(seed, n, count), raw=True)[:n]

    longest = probes.Needle(max(probes.NEEDLE_KEYS, key=len), "0000")
    overhead = len(engine.encode_prompt(probes.needle_prompt("", longest))) + 2
    needle = probes.needle_probes(plan.needle, count, overhead=overhead, seed=NEEDLE_SEED)
    return Inputs(
        ppl_docs=([engine.encode_prompt(t, raw=True)[: plan.ppl_tokens] for t in texts]
                  or [raw_doc(DOC_SEED + i, plan.ppl_tokens) for i in range(plan.ppl_docs)]),
        agreement=[engine.encode_prompt(p)
                   for p in probes.AGREEMENT_PROMPTS[: plan.agreement_prompts]],
        needle=[(p, engine.encode_prompt(p.prompt)) for p in needle],
        json=[(engine.encode_prompt(p), keys)
              for p, keys in probes.JSON_PROMPTS[: plan.json_prompts]],
        speed={n: raw_doc(SPEED_SEED + n, n) for n in plan.speed_contexts},
    )


def with_engine(loaded: LoadedModel, engine_kwargs: dict, fn: Callable[[Engine], None], *,
                prefix_cache: bool) -> None:
    """Run ``fn`` on a fresh engine of the format, then shut it down and free its pool."""
    import mlx.core as mx

    from engine import Engine, EngineConfig

    config = EngineConfig(kv_budget_bytes=BUDGET_BYTES, prefix_cache=prefix_cache,
                          disk_cache=False, **engine_kwargs)
    engine = Engine(loaded, config)
    try:
        fn(engine)
    finally:
        engine.shutdown()
        leaked = len(engine.blocks.block_tables)
        del engine  # the only reference: the pool goes before the next engine's
        gc.collect()
        mx.clear_cache()
    assert leaked == 0, f"{leaked} sequences kept their blocks"


def run_batch(engine: Engine, prompts: list[list[int]], max_tokens: int, *,
              ignore_eos: bool) -> list:
    """Greedy results of ``prompts`` submitted together (continuous batching)."""
    from engine import SamplingParams
    from engine.generation import collect

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    handles = [engine.submit(p, params) for p in prompts]
    return [collect(h) for h in handles]  # no engine thread: reading one drives all


def measure_format(loaded: LoadedModel, engine_kwargs: dict, inputs: Inputs, plan: Plan,
                   log: Callable[[str], None], reference: dict | None = None) -> dict:
    """Raw figures of one format: KV size, scores, answers, speeds, seconds per phase.
    Without ``reference`` this run is the reference (its next-token distributions are
    kept); with it, the KL divergence from the reference's is scored too."""
    from app.eval.perplexity import score_text
    from engine import SamplingParams

    out: dict = {"seconds": {}}
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        out["seconds"][phase] = round(now - clock, 1)
        clock = now

    def main_phases(engine: Engine) -> None:
        layout, bs = engine.layout, engine.layout.block_size
        out["kv"] = {
            "dtype": str(layout.dtype).removeprefix("mlx.core."),
            "bytes_per_token": layout.bytes_per_token,
            "block_size": bs,
            "budget_bytes": BUDGET_BYTES,
            "num_blocks": engine.blocks.num_blocks,
            "capacity_tokens": CAPACITY_TOKENS,
            "max_sequences": engine.blocks.num_blocks // -(-CAPACITY_TOKENS // bs),
        }
        # perplexity (teacher-forced through the pool)
        out["ppl_scores"] = []
        for i, ids in enumerate(inputs.ppl_docs):
            log(f"perplexity: document {i + 1}/{len(inputs.ppl_docs)} ({len(ids)} tokens)")
            ref = reference["ppl_scores"][i] if reference else None
            out["ppl_scores"].append(score_text(engine, ids, keep=ref is None, reference=ref))
        lap("perplexity")
        # greedy agreement: fixed length (EOS ignored) so every run decodes the same steps
        log(f"agreement: {len(inputs.agreement)} prompts x {plan.agreement_tokens} tokens")
        results = run_batch(engine, inputs.agreement, plan.agreement_tokens, ignore_eos=True)
        out["agreement_tokens"] = [r.tokens for r in results]
        lap("agreement")
        log(f"structured output: {len(inputs.json)} JSON prompts")
        results = run_batch(engine, [p for p, _ in inputs.json], plan.json_tokens,
                            ignore_eos=False)
        out["json_answers"] = [r.text for r in results]
        lap("json")
        # speed: cold prompts (prefix cache off); prefill and decode timed apart
        out["speed"] = {}
        for n, ids in inputs.speed.items():
            log(f"speed: {n}-token context, {plan.speed_tokens} tokens")
            params = SamplingParams(max_tokens=plan.speed_tokens, ignore_eos=True)
            s = engine.generate_text(ids, params).stats
            itl = statistics.median(s.inter_token_s) * 1e3 if s.inter_token_s else 0.0
            out["speed"][n] = {"prefill_tps": s.prefill_tps, "decode_tps": s.decode_tps,
                               "itl_p50_ms": itl, "decoded_tokens": s.generation_tokens}
        lap("speed")

    def needle_phase(engine: Engine) -> None:
        out["needle_answers"] = []
        for i, (probe, ids) in enumerate(inputs.needle):
            if i % 5 == 0:
                log(f"needle: probe {i + 1}/{len(inputs.needle)} "
                    f"({probe.context_tokens}-token context)")
            r = engine.generate_text(ids, SamplingParams(max_tokens=NEEDLE_MAX_TOKENS))
            out["needle_answers"].append(r.text)
        out["needle_cached_tokens"] = engine.metrics().cached_tokens_total
        lap("needle")

    with_engine(loaded, engine_kwargs, main_phases, prefix_cache=False)
    # needles with the prefix cache on: the probes of one haystack share its K/V
    # (computed once, in this same format), so only each question is prefilled
    with_engine(loaded, engine_kwargs, needle_phase, prefix_cache=True)
    return out

"""Runs one planned step on the model: prefill chunks, one batched decode, sampling.

It is handed the model runner and the KV pool, and returns one `Outcome` per
planned request (tokens computed, a sampled token, or an error); the engine
applies them. Everything that can fail for one request alone (its inputs, its
sampler and logits processors) runs inside that request's own ``try``, so an
error fails that request and no other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.kv_cache import PagedKVCache
from engine.metrics import MetricsRecorder
from engine.model.model_runner import PagedModel, StepBatch
from engine.model.paged_attention import contiguous_run
from engine.request import Request
from engine.scheduler import StepPlan

FaultHook = Callable[[Request, str], None]


@dataclass(slots=True)
class Outcome:
    """What a step did for one request: K/V computed, a token sampled, or an error."""

    request: Request
    computed: int = 0  # tokens whose K/V this step wrote
    token: int | None = None  # the sampled next token (decode steps)
    error: str | None = None


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def build_batch(blocks: BlockManager, seq_ids: list[int], input_ids: mx.array,
                slots: list[list[int]]) -> StepBatch:
    """The forward's inputs for sequences whose new tokens already have ``slots``."""
    tables = [blocks.block_tables[i] for i in seq_ids]
    lens = [blocks.num_tokens[i] for i in seq_ids]
    L = input_ids.shape[1]
    width = max(len(t) for t in tables)
    return StepBatch(
        input_ids=input_ids,
        offsets=mx.array([n - L for n in lens], dtype=mx.int32),
        slots=mx.array([s for ss in slots for s in ss], dtype=mx.int32),
        block_tables=mx.array([t + [t[0]] * (width - len(t)) for t in tables], dtype=mx.int32),
        context_lens=lens,
        block_run=contiguous_run(tables[0]) if len(seq_ids) == 1 else None,
    )


class StepExecutor:
    """Executes `StepPlan`s on a model runner over a paged KV pool."""

    def __init__(self, runner: PagedModel, kv: PagedKVCache, blocks: BlockManager,
                 recorder: MetricsRecorder):
        self.runner, self.kv, self.blocks, self.recorder = runner, kv, blocks, recorder
        self.fault_hook: FaultHook | None = None  # tests: may raise for (request, phase)

    def fault(self, req: Request, phase: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(req, phase)

    def run(self, plan: StepPlan) -> list[Outcome]:
        out = [self._prefill(req, n, slots) for req, n, slots in plan.prefills]
        if plan.decodes:
            out += self._decode(plan.decodes)
        return out

    def _prefill(self, req: Request, n: int, slots) -> Outcome:
        try:
            self.fault(req, "prefill")
            self.kv.copy_blocks(slots.copies)
            start = req.num_computed
            ids = mx.array(req.all_ids[start:start + n], dtype=mx.int32)
            batch = build_batch(self.blocks, [req.request_id], ids[None], [slots.slots])
            t = time.perf_counter()
            self.runner(batch, self.kv, logits=False)
            mx.eval(self.kv.keys, self.kv.values)
            self.recorder.time_forward("prefill", n, time.perf_counter() - t)
            return Outcome(req, computed=n)
        except Exception as e:  # noqa: BLE001 - one request's failure stays its own
            return Outcome(req, error=_error(e))

    def _decode(self, decodes) -> list[Outcome]:
        out, ok = [], []
        for req, slots in decodes:
            try:
                self.fault(req, "decode")
                self.kv.copy_blocks(slots.copies)
                ok.append((req, slots))
            except Exception as e:  # noqa: BLE001
                out.append(Outcome(req, error=_error(e)))
        if not ok:
            return out
        reqs = [r for r, _ in ok]
        ids = mx.array([[r.all_ids[-1]] for r in reqs], dtype=mx.int32)
        t = time.perf_counter()
        try:
            batch = build_batch(self.blocks, [r.request_id for r in reqs], ids,
                                [s.slots for _, s in ok])
            logits = self.runner(batch, self.kv)
            if all(r.decoder.greedy for r in reqs):
                # argmax of the log-probs, as mlx-lm's greedy sampler takes it (same ties)
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                tokens = mx.argmax(logprobs, axis=-1)
                mx.eval(tokens, self.kv.keys, self.kv.values)
                picked = [Outcome(r, 1, int(tok)) for r, tok in zip(reqs, tokens.tolist(),
                                                                     strict=True)]
            else:
                picked = [self._sample(r, logits[i:i + 1]) for i, r in enumerate(reqs)]
        except Exception as e:  # noqa: BLE001 - the batch forward failed: all of it
            return out + [Outcome(r, error=_error(e)) for r in reqs]
        self.recorder.time_forward("decode", len(reqs), time.perf_counter() - t)
        return out + picked

    def _sample(self, req: Request, row: mx.array) -> Outcome:
        """Per-request samplers and logits processors (temperature, top-p, penalties)."""
        try:
            return Outcome(req, 1, req.decoder.sample(row, req.all_ids))
        except Exception as e:  # noqa: BLE001
            # the forward wrote this row's K/V; the request ends, so it does not matter
            return Outcome(req, error=_error(e))

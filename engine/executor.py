"""Runs one planned step on the model: prefill chunks, one batched decode, sampling.

Everything that can fail for one request alone (its inputs, its sampler and
logits processors, detokenizing, stop strings) runs inside that request's own
``try``, so an error fails that request and no other.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import mlx.core as mx

from engine.generation import GenerationEvent
from engine.model.model_runner import StepBatch
from engine.model.paged_attention import contiguous_run
from engine.request import Request
from engine.scheduler import StepPlan

if TYPE_CHECKING:
    from engine.engine import Engine


class StepExecutor:
    """Executes `StepPlan`s for an engine (which owns the pool and the requests)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.fault_hook = None  # tests: callable(request, phase) that may raise

    def _fault(self, req: Request, phase: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(req, phase)

    def run(self, plan: StepPlan) -> None:
        eng = self.engine
        for req, n, slots in plan.prefills:
            try:
                self._fault(req, "prefill")
                eng.kv.copy_blocks(slots.copies)
                start = req.num_computed
                ids = mx.array(req.all_ids[start:start + n], dtype=mx.int32)
                batch = self.batch([req.request_id], ids[None], [slots.slots])
                t = time.perf_counter()
                eng.runner(batch, eng.kv, logits=False)
                mx.eval(eng.kv.keys, eng.kv.values)
                eng.recorder.time_forward("prefill", n, time.perf_counter() - t)
                req.num_computed += n
                eng.prefix.on_computed(req)
                if req.stats.preemptions == 0:
                    done = req.num_computed
                    req.events.put(GenerationEvent(req.request_id, None, "",
                                                   prefill=(done, len(req.prompt_ids))))
            except Exception as e:  # noqa: BLE001 - one request's failure stays its own
                eng._finish(req, "error", error=f"{type(e).__name__}: {e}")
        if plan.decodes:
            self._decode([(r, s) for r, s in plan.decodes if not r.finished])

    def batch(self, seq_ids: list[int], input_ids: mx.array, slots: list[list[int]]) -> StepBatch:
        """The forward's inputs for sequences whose new tokens already have ``slots``."""
        blocks = self.engine.blocks
        tables = [blocks.block_tables[i] for i in seq_ids]
        lens = [blocks.num_tokens[i] for i in seq_ids]
        L = input_ids.shape[1]
        width = max(len(t) for t in tables)
        return StepBatch(
            input_ids=input_ids,
            offsets=mx.array([n - L for n in lens], dtype=mx.int32),
            slots=mx.array([s for ss in slots for s in ss], dtype=mx.int32),
            block_tables=mx.array([t + [t[0]] * (width - len(t)) for t in tables],
                                  dtype=mx.int32),
            context_lens=lens,
            block_run=contiguous_run(tables[0]) if len(seq_ids) == 1 else None,
        )

    def _decode(self, decodes) -> None:
        eng = self.engine
        ok = []
        for req, slots in decodes:
            try:
                self._fault(req, "decode")
                eng.kv.copy_blocks(slots.copies)
                ok.append((req, slots))
            except Exception as e:  # noqa: BLE001
                eng._finish(req, "error", error=f"{type(e).__name__}: {e}")
        if not ok:
            return
        reqs = [r for r, _ in ok]
        ids = mx.array([[r.all_ids[-1]] for r in reqs], dtype=mx.int32)
        t = time.perf_counter()
        try:
            batch = self.batch([r.request_id for r in reqs], ids, [s.slots for _, s in ok])
            logits = eng.runner(batch, eng.kv)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            greedy = all(r.params.temperature == 0 and not r.processors for r in reqs)
            if greedy:
                tokens = mx.argmax(logprobs, axis=-1)
                mx.eval(tokens, eng.kv.keys, eng.kv.values)
                picked = tokens.tolist()
            else:
                picked = self._sample_rows(reqs, logits)
        except Exception as e:  # noqa: BLE001 - the batch forward failed: all of it
            for r in reqs:
                eng._finish(r, "error", error=f"{type(e).__name__}: {e}")
            return
        now = time.perf_counter()
        eng.recorder.time_forward("decode", len(reqs), now - t)
        for req, token in zip(reqs, picked, strict=True):
            if req.finished or token is None:
                continue
            req.num_computed += 1
            try:
                self._fault(req, "token")
                eng.prefix.on_computed(req)
                self.accept_token(req, int(token), now)
            except Exception as e:  # noqa: BLE001
                eng._finish(req, "error", error=f"{type(e).__name__}: {e}")

    def _sample_rows(self, reqs: list[Request], logits: mx.array) -> list[int | None]:
        """Per-request samplers and logits processors (temperature, top-p, penalties)."""
        eng = self.engine
        out: list[int | None] = []
        for i, req in enumerate(reqs):
            try:
                row = logits[i:i + 1]
                if req.processors:
                    history = mx.array(req.all_ids, dtype=mx.int32)
                    for proc in req.processors:
                        row = proc(history, row)
                row = row - mx.logsumexp(row, axis=-1, keepdims=True)
                out.append(int(req.sampler(row).item()))
            except Exception as e:  # noqa: BLE001
                eng._finish(req, "error", error=f"{type(e).__name__}: {e}")
                out.append(None)
        return out

    def accept_token(self, req: Request, token: int, now: float) -> None:
        """Record a sampled token; emit it, or finish the request."""
        eng = self.engine
        s = req.stats
        req.output_ids.append(token)
        if s.generation_tokens == 0:
            s.ttft_s = now - req.arrival
            s.prefill_s = s.ttft_s - s.queue_s
            eng.recorder.observe("ttft_s", s.ttft_s)
            eng.recorder.observe("prefill_tps", s.prefill_tps)
        else:
            itl = now - req.last_token_at
            s.inter_token_s.append(itl)
            s.decode_s = now - req.arrival - s.ttft_s
            eng.recorder.observe("itl_s", itl)
        req.last_token_at = now
        s.generation_tokens += 1
        s.blocks_used = max(s.blocks_used, len(eng.blocks.block_tables[req.request_id]))
        eos = () if req.params.ignore_eos else eng.tokenizer.eos_token_ids
        finish = None
        if token in eos:
            finish, text = "stop", ""
        else:
            req.detok.add_token(token)
            text, hit = req.stop.feed(req.detok.last_segment)
            if hit:
                finish = "stop"
            elif s.generation_tokens >= req.max_new:
                finish = "length"
        if finish is None:
            req.events.put(GenerationEvent(req.request_id, token, text))
            return
        req.detok.finalize()
        if finish == "length" or token in eos:
            # bytes the detokenizer held back may still complete a stop string
            more, hit = req.stop.feed(req.detok.last_segment)
            text += more if hit else more + req.stop.flush()
            finish = "stop" if hit else finish
        eng._finish(req, finish, token=token, text=text)

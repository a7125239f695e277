"""Runs one planned step on the model: prefill chunks and decodes, then sampling.

A step with prefill chunks of several requests, or a chunk and decodes, runs as
one packed forward (`engine.model.packed_batch`): the weights are read once and
decodes never wait behind a separate prefill forward. A lone prefill chunk or a
decode-only batch keeps its own forward (the lone chunk is exactly mlx-lm's
computation). It returns one `Outcome` per planned request (tokens computed, a
sampled token, or an error); the engine applies them. Everything that can fail
for one request alone (its inputs, its sampler and logits processors) runs inside
that request's own ``try``, so an error fails that request and no other. A
forward whose requests were all cancelled meanwhile stops between layer groups
and returns no outcome for them (the engine's cancel releases them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from itertools import accumulate

import mlx.core as mx

from engine import ahead, greedy, logprobs, verify
from engine.constraint import mask_rows
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.kv_cache import PagedKVCache
from engine.metrics import MetricsRecorder
from engine.model.memory import prefill_scratch_on_cpu
from engine.model.model_runner import PagedModel, StepInterrupted
from engine.model.packed_batch import pack
from engine.outcome import Flight, Outcome, error_text, same_requests
from engine.pacing import StepPacer
from engine.request import Request
from engine.scheduler import StepPlan
from engine.step_inputs import build_batch

FaultHook = Callable[[Request, str], None]
Unwanted = Callable[[list[Request]], bool]


class StepExecutor:
    """Executes `StepPlan`s on a model runner over a paged KV pool."""

    def __init__(self, runner: PagedModel, kv: PagedKVCache, blocks: BlockManager,
                 recorder: MetricsRecorder, pacer: StepPacer | None = None, *,
                 pipeline: bool = False, fast_greedy: bool = False,
                 unwanted: Unwanted | None = None):
        self.runner, self.kv, self.blocks, self.recorder = runner, kv, blocks, recorder
        self.pacer = pacer or StepPacer(len(runner.layers))
        self.fault_hook: FaultHook | None = None  # tests: may raise for (request, phase)
        # True when none of these requests is wanted any more: their forward may stop
        self.unwanted = unwanted  # between layer groups (None: forwards run to the end)
        self.pipeline = pipeline  # launch greedy decodes ahead (see `run`)
        self.fast_greedy = fast_greedy  # the CPU extension's greedy pick (`engine.greedy`)
        self.flight: Flight | None = None
        # chained steps feed the extension's picks unread (one it declines rebuilds the step),
        self.fast_chain = fast_greedy and kv.snapshot() is not None  # else mlx-lm's argmax:
        self.chain_rows = 1 if fast_greedy and not self.fast_chain else None  # 0.6 ms a row
        self._repicked: list[int] | None = None  # the last resolve's tokens, if it settled any
        self._last: dict[int, int] = {}  # tokens read from a flight, not yet applied
        self.ahead: ahead.Ahead | None = None  # a speculating engine's next step, built early

    in_flight = property(lambda self: self.flight is not None)

    def resolve(self, build_ahead: bool = False) -> list[Outcome]:
        """Read the launched step's tokens (waits for it) and return its outcomes; with
        ``build_ahead``, build the next draft-free step on them first (`engine.ahead`)."""
        self.ahead = ahead.build(self, build_ahead)
        flight, self.flight, self._repicked = self.flight, None, None
        if flight is None:
            return []
        try:
            tokens = flight.tokens.tolist()
            if min(tokens) < 0:  # rows the pick declined: a chained step fed them as 0
                tokens = self._repicked = greedy.settle(tokens, flight.logits)
        except Exception as e:  # noqa: BLE001 - the batch forward failed: all of it
            return [Outcome(r, error=error_text(e)) for r in flight.requests]
        self._timed("decode", len(flight.requests), time.perf_counter() - flight.started)
        self._last.update((r.request_id, t) for r, t in zip(flight.requests, tokens,
                                                            strict=True))
        return [Outcome(r, 1, t) for r, t in zip(flight.requests, tokens, strict=True)]

    def _last_token(self, req: Request) -> int:
        """The token a decode feeds: read from a flight this step, or the request's last."""
        return self._last.get(req.request_id, req.last_id)

    def _can_chain(self, plan: StepPlan) -> bool:
        """The plan decodes exactly the flight's requests: feed its tokens unread."""
        f = self.flight
        return (f is not None and not plan.prefills
                and not any(s.copies or r.draft for r, s in plan.decodes)
                and len(plan.decodes) == len(f.requests)
                and all(r is q for (r, _), q in zip(plan.decodes, f.requests, strict=True)))

    def fault(self, req: Request, phase: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(req, phase)

    def run(self, plan: StepPlan) -> list[Outcome]:
        """Run ``plan``; the outcomes of an earlier launched step come first.

        Greedy decode-only steps are pipelined the way mlx-lm pipelines tokens: the step
        is launched with `mx.async_eval` and its tokens are returned by the next `run`
        (or `resolve`), which builds and launches its own graph first, feeding the
        unread tokens straight in. The engine resolves before any plan that could
        preempt; a request that finished meanwhile just drops its extra token.
        """
        try:
            if self.ahead is not None and ahead.launch(self, plan, self._repicked is None):
                return []
            if self._can_chain(plan):
                return self._decode(plan.decodes)
            out = self.resolve()
            if (plan.prefills and len(plan.prefills) + len(plan.decodes) > 1
                    or any(r.draft for r, _ in plan.decodes)):
                return out + self._mixed(plan)
            out += [self._prefill(req, n, slots) for req, n, slots in plan.prefills]
            if plan.decodes:
                out += self._decode(plan.decodes)
            return [o for o in out if o is not None]
        finally:
            self._last.clear()

    def _interrupt(self, reqs: list[Request]):
        if self.unwanted is None:
            return None

        def check() -> bool:
            if self.unwanted(reqs):
                self.recorder.interrupted_forwards += 1
                return True
            return False

        return check

    def _timed(self, kind: str, tokens: int, seconds: float) -> None:
        self.recorder.time_forward(kind, tokens, seconds)
        self.pacer.observe(tokens, seconds, decode_only=kind == "decode")

    def _prepare(self, req: Request, phase: str, copies, out: list[Outcome]) -> bool:
        """The request's own checks and copy-on-write; an error ends it alone."""
        try:
            self.fault(req, phase)
            self.kv.copy_blocks(copies)
            return True
        except Exception as e:  # noqa: BLE001 - one request's failure stays its own
            out.append(Outcome(req, error=error_text(e)))
            return False

    def _prefill(self, req: Request, n: int, slots) -> Outcome | None:
        out: list[Outcome] = []
        if not self._prepare(req, "prefill", slots.copies, out):
            return out[0]
        try:
            start = req.num_computed
            ids = mx.array(req.kv_ids[start:start + n], dtype=mx.int32)
            batch = build_batch(self.blocks, [req.request_id], ids[None], [slots.slots])
            t = time.perf_counter()
            with prefill_scratch_on_cpu():  # a chunk's scratch: see there
                self.runner(batch, self.kv, logits=False, interrupt=self._interrupt([req]),
                            group=self.pacer.layer_group(n))
                mx.eval(*self.kv.arrays)
            self._timed("prefill", n, time.perf_counter() - t)
            return Outcome(req, computed=n)
        except StepInterrupted:
            return None
        except Exception as e:  # noqa: BLE001 - one request's failure stays its own
            return Outcome(req, error=error_text(e))

    def _mixed(self, plan: StepPlan) -> list[Outcome]:
        """Prefill chunks and decodes (with any drafts they verify) as one packed forward."""
        out: list[Outcome] = []
        pre = [(r, n, s) for r, n, s in plan.prefills
               if self._prepare(r, "prefill", s.copies, out)]
        dec = [(r, s) for r, s in plan.decodes if self._prepare(r, "decode", s.copies, out)]
        if not pre and not dec:
            return out
        tables, lens = self.blocks.block_tables, self.blocks.num_tokens
        batch = pack(
            [(r.kv_ids[r.num_computed:r.num_computed + n], s.slots, tables[r.request_id],
              lens[r.request_id]) for r, n, s in pre],
            [row for r, s in dec for row in verify.rows(
                self._last_token(r), r.draft, s.slots, tables[r.request_id],
                lens[r.request_id])])
        reqs = [r for r, _, _ in pre] + [r for r, _ in dec]
        t = time.perf_counter()
        try:
            with prefill_scratch_on_cpu() if pre else nullcontext():  # decodes keep the cache
                logits = self.runner.forward_packed(
                    batch, self.kv, interrupt=self._interrupt(reqs),
                    group=self.pacer.layer_group(batch.num_tokens))
                picked = self._verify([r for r, _ in dec], logits) if dec else []
                mx.eval(*self.kv.arrays)
        except StepInterrupted:
            return out
        except Exception as e:  # noqa: BLE001 - the packed forward failed: all of it
            return out + [Outcome(r, error=error_text(e)) for r in reqs]
        seconds, drafts = time.perf_counter() - t, sum(len(r.draft) for r, _ in dec)
        if pre or not drafts:
            self._timed("mixed" if pre else "decode", batch.num_tokens, seconds)
        else:  # the draft tokens are kept out of the pacer's measures
            self.recorder.time_forward("decode", batch.num_tokens, seconds)
        return out + [Outcome(r, computed=n) for r, n, _ in pre] + picked

    def _decode(self, decodes) -> list[Outcome]:
        out: list[Outcome] = []
        ok = [(r, s) for r, s in decodes if self._prepare(r, "decode", s.copies, out)]
        if not ok:
            return out + self.resolve()
        reqs = [r for r, _ in ok]
        if self.flight is not None and not same_requests(reqs, self.flight.requests):
            out += self.resolve()  # one failed its own checks: feed the tokens read back
        chained = self.flight is not None  # `_can_chain`: feed the flight's unread tokens
        t = time.perf_counter()
        ids_of, slots = [r.request_id for r in reqs], [s.slots for _, s in ok]
        try:
            snap = self.kv.snapshot() if chained and self.fast_chain else None
            ids = (mx.maximum(self.flight.tokens, 0)[:, None] if chained  # -1: rebuilt below
                   else mx.array([[self._last_token(r)] for r in reqs])).astype(mx.int32)
            logits = self.runner(build_batch(self.blocks, ids_of, ids, slots), self.kv)
            if self.pipeline and all(r.decoder.greedy for r in reqs) and (
                    self.chain_rows is None or len(reqs) <= self.chain_rows):
                tokens = greedy.lazy(logits, fast=self.fast_chain)
                # Built while the previous step ran; launched once it is done: its tasks hold
                # the pool, whose writes would copy it, not write in place (measured: 4x slower).
                out += self.resolve()
                if chained and self._repicked is not None:
                    self.kv.restore(snap)
                    ids = mx.array(self._repicked, dtype=mx.int32)[:, None]
                    logits = self.runner(build_batch(self.blocks, ids_of, ids, slots), self.kv)
                    tokens = greedy.lazy(logits, fast=self.fast_chain)
                    self.recorder.rebuilt_steps += 1
                del snap  # held, the pool's old arrays would be copied, not written in place
                mx.async_eval(tokens, *self.kv.arrays)
                self.flight = Flight(reqs, tokens, t, logits)
                return out
            picked = self._pick(reqs, logits)
        except Exception as e:  # noqa: BLE001 - the batch forward failed: all of it
            return out + self.resolve() + [Outcome(r, error=error_text(e)) for r in reqs]
        self._timed("decode", len(reqs), time.perf_counter() - t)
        return out + picked

    def _verify(self, reqs: list[Request], logits: mx.array) -> list[Outcome]:
        """Outcomes of decode rows: one row per request, or ``1 + k`` for one with drafts."""
        starts = list(accumulate((1 + len(r.draft) for r in reqs), initial=0))
        if starts[-1] == len(reqs):
            return self._pick(reqs, logits)
        plain = [i for i, r in enumerate(reqs) if not r.draft]
        out = self._pick([reqs[i] for i in plain], logits[mx.array([starts[i] for i in plain])]
                         ) if plain else []
        spec = [(r, starts[i]) for i, r in enumerate(reqs) if r.draft]
        masks, failed = verify.draft_masks([r for r, _ in spec])
        argmax = [r for r, _ in spec if r.decoder.argmax and r.request_id not in failed]
        rows = [j for r, a in spec if r in argmax for j in range(a, a + 1 + len(r.draft))]
        some = (logits if rows == list(range(len(logits)))  # a lone sequence: no 1 MB gather
                else logits[mx.array(rows)] if rows else None)
        targets = iter(greedy.tokens(
            verify.masked(some, verify.stacked(masks, argmax, logits.shape[-1])),
            fast=self.fast_greedy, wait=self.kv.arrays) if rows else [])
        verified: list[Outcome] = []
        for r, a in spec:
            try:
                if r.request_id in failed:
                    raise failed[r.request_id]
                toks = (verify.accepted_greedy(r.draft, [next(targets) for _ in [0, *r.draft]])
                        if r.decoder.argmax else r.decoder.sample_drafts(verify.masked(
                            logits[a:a + 1 + len(r.draft)], masks.get(r.request_id)), r.draft))
                verified.append(Outcome(r, len(toks), toks[0], more=toks[1:],
                                        drafted=len(r.draft)))
            except Exception as e:  # noqa: BLE001 - one request's failure stays its own
                verified.append(Outcome(r, error=error_text(e)))
        # an accepted token came from its own verify row: its logprob is that row's
        return out + logprobs.attach(verified, logits, [a for _, a in spec])

    def _pick(self, reqs: list[Request], logits: mx.array) -> list[Outcome]:
        """Each request's next token from its row of ``logits`` (the pool is evaluated)."""
        rows = [i for i, r in enumerate(reqs) if r.decoder.argmax]
        out: list[Outcome | None] = [None] * len(reqs)
        if rows:  # one batched pick for the argmax rows, whatever their neighbours need
            some = logits if len(rows) == len(reqs) else logits[mx.array(rows)]
            grammars = [reqs[i].decoder.grammar for i in rows]
            if any(g is not None for g in grammars):  # constrained greedy: masked, batched
                some, failed = mask_rows(some, grammars)
                for j, e in failed.items():
                    out[rows[j]] = Outcome(reqs[rows[j]], error=error_text(e))
            tokens = greedy.tokens(some, fast=self.fast_greedy,
                                   wait=self.kv.arrays)
            for i, tok in zip(rows, tokens, strict=True):
                out[i] = out[i] or Outcome(reqs[i], 1, tok)
        return logprobs.attach([o if o is not None else self._sample(r, logits[i:i + 1])
                                for i, (r, o) in enumerate(zip(reqs, out, strict=True))], logits)

    def _sample(self, req: Request, row: mx.array) -> Outcome:
        """Per-request samplers and logits processors (temperature, top-p, penalties)."""
        try:
            return Outcome(req, 1, req.decoder.sample(row, req.all_ids))
        except Exception as e:  # noqa: BLE001
            # the forward wrote this row's K/V; the request ends, so it does not matter
            return Outcome(req, error=error_text(e))

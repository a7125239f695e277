"""The engine: a model, its paged KV pool, and continuous batching over it.

Callers `submit` requests (any thread) and iterate the returned handle for
events; `cancel`, `metrics` and `block_map` are thread-safe. Steps run either
on the engine's own thread (`start`) or, without it, in whichever consumer
thread is waiting for an event. One step flows one way: the scheduler plans
(admission, preemption, blocks), the executor runs the model and returns
outcomes, and the engine applies them. Every way a request ends goes through
`_finish`, which releases its blocks exactly once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from functools import partial

import mlx.core as mx

from engine.config import EngineConfig
from engine.constraint import Constraint, Grammars
from engine.decoder import Decoder
from engine.errors import RequestError
from engine.executor import Outcome, StepExecutor
from engine.generation import GenerationEvent, GenerationResult, collect
from engine.loop import EngineLoop
from engine.metrics import EngineMetrics, MetricsRecorder, snapshot
from engine.model.backend import cpu_compile_off
from engine.model.loader import LoadedModel
from engine.pacing import StepPacer
from engine.prompts import PromptMixin
from engine.request import Priority, Request, RequestHandle, RequestState
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, StepPlan
from engine.speculation import build_speculator
from engine.thinking import ThinkBudget, close_ids
from engine.validation import check_ids, check_params, check_scope, check_ttl
from engine.wiring import EngineParts, build_kv


class Engine(PromptMixin, EngineLoop):
    """Serves generation requests for one model over a block-paged KV pool."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, *,
                 parts: EngineParts | None = None, draft: LoadedModel | None = None):
        """``draft``: the loaded draft model of ``speculate="draft:..."`` (else it is loaded
        from the name). ``parts``: the runner, pool and prefix cache to serve over, when the
        caller built them (`engine.wiring.build_kv`) to put its own around them first (the
        distributed leader); by default they are built here from ``config``."""
        super().__init__()
        cpu_compile_off()
        self.loaded = loaded
        self.config = config = config or EngineConfig()
        parts = parts or build_kv(loaded, config)
        self.runner, self.layout, self.kv, self.blocks = (parts.runner, parts.layout,
                                                          parts.kv, parts.blocks)
        self.prefix, self.swap = parts.prefix, parts.swap
        self.notices = parts.notices  # e.g. a KV format that fell back: the front end says it
        self.max_context = parts.scheduler_config.max_context
        self.vocab_size = self.runner.embed_tokens.weight.shape[0]
        self.recorder = MetricsRecorder()
        pacer = StepPacer(len(self.runner.layers), group_target_s=config.cancel_check_s,
                          step_target_s=config.step_target_s)
        self.scheduler = Scheduler(self.blocks, self.prefix, self.swap, parts.scheduler_config,
                                   pacer)
        self.scheduler.shifter = parts.shifter
        pipeline = config.pipeline if config.pipeline is not None else (
            mx.default_device() == mx.gpu or loaded.cpu_ext)
        self.executor = StepExecutor(self.runner, self.kv, self.blocks, self.recorder, pacer,
                                     pipeline=pipeline, fast_greedy=loaded.cpu_ext,
                                     unwanted=self._unwanted)
        self.speculator = build_speculator(config.speculate, pacer, self.recorder, self.blocks,
                                           self.vocab_size, self.notices, loaded, draft)
        self._ids = itertools.count()
        self.grammars = Grammars(self.tokenizer._tokenizer, self.tokenizer.eos_token_ids,
                                 self.vocab_size)  # constrained decoding, built on first use
        self.think_close = close_ids(self.tokenizer)  # forced when a thinking budget runs out

    tokenizer = property(lambda self: self.loaded.tokenizer)

    # -- requests --------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
               priority: Priority = Priority.INTERACTIVE, timeout_s: float | None = None,
               tenant: str = "local", permission_version: int = 0,
               cache_ttl_s: float | None = None) -> RequestHandle:
        """Queue a request; iterate the returned handle for its events.

        Every field is checked here: a bad one raises `RequestError` (and counts a
        rejection) in the caller's thread, as does a request that can never fit (a
        `RequestTooLargeError`). One that fits only with fewer new tokens gets them:
        the handle's ``max_tokens`` is what was granted, its ``notice`` says why.
        ``cache_ttl_s`` sets the disk lifetime of the prompt blocks it writes (a pinned
        document session); None uses the tenant's TTL.
        """
        params = params if params is not None else SamplingParams()
        try:
            if not isinstance(params, SamplingParams):
                raise RequestError("params must be SamplingParams")
            check_scope(tenant, permission_version, timeout_s)
            check_ttl(cache_ttl_s)
            try:
                priority = Priority(priority)
            except ValueError as e:
                raise RequestError(f"priority must be one of {list(Priority)}") from e
            ids = check_ids(prompt_ids, self.vocab_size)
            check_params(params)
            check_ids(list(params.logit_bias), self.vocab_size, what="logit_bias token")
            shift = self.scheduler.shifter.wants(params.context_shift)
            max_new, notice = self.scheduler.check(len(ids), params.max_tokens, shift=shift)
            c = params.constraint
            if c is not None and not isinstance(c, Constraint):
                raise RequestError("constraint must be an engine.Constraint")
            decoder = Decoder(params, self.tokenizer.detokenizer, self.tokenizer.eos_token_ids,
                              max_new, self.grammars.matcher(c) if c is not None else None,
                              None if params.thinking_budget is None else ThinkBudget(
                                  params.thinking_budget, self.think_close,
                                  inside=params.thinking))
            prefix = self.prefix.new_sequence(tenant, permission_version, ttl_s=cache_ttl_s)
        except RequestError:
            self.recorder.count_rejection()
            raise
        except (TypeError, ValueError) as e:  # anything else about the values: the caller's
            self.recorder.count_rejection()
            raise RequestError(f"bad request: {e}") from e
        now = time.perf_counter()
        req = Request(next(self._ids), ids, decoder, prefix, priority=priority, arrival=now,
                      deadline=now + timeout_s if timeout_s is not None else None,
                      notice=notice, context_shift=shift)
        s = req.stats
        s.prompt_tokens, s.block_size = len(ids), self.layout.block_size
        s.bytes_per_token, s.kv_format = self.layout.bytes_per_token, self.layout.kv_format
        self._enqueue(req)
        return RequestHandle(req.request_id, partial(self._next_event, req),
                             lambda: not req.events.empty(), self.cancel, max_new, notice)

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 **kwargs) -> Iterator[GenerationEvent]:
        """Stream one request's events (submit + iterate)."""
        yield from self.submit(prompt_ids, params, **kwargs)

    def generate_text(self, prompt_ids: list[int], params: SamplingParams | None = None,
                      **kwargs) -> GenerationResult:
        """Run a request to the end; raises `RequestError` if it failed."""
        result = collect(self.generate(prompt_ids, params, **kwargs))
        if result.finish_reason == "error":
            raise RequestError(result.error or "the request failed")
        return result

    # -- one step --------------------------------------------------------------------
    def _step(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for req in inbox:
            if not req.finished:
                self.scheduler.add(req)
        self._apply_cancels()
        now = time.perf_counter()
        with self._lock:
            live = list(self._requests.values())
        for req in live:
            if req.deadline is not None and now > req.deadline:
                self._finish(req, "timeout")
        self.prefix.maybe_sweep()
        with self._lock:
            inbox_empty = not self._inbox
        spec = self.speculator.active  # drafts follow the last token: nothing may be in flight
        ahead = self.executor.in_flight and inbox_empty and self.scheduler.can_plan_ahead()
        if self.executor.in_flight and (spec or not ahead):
            for outcome in self.executor.resolve(build_ahead=ahead and self.speculator.quiet):
                self._apply(outcome)
        self.speculator.cost.close(going_on=bool(self.scheduler.running))
        if spec:
            self.speculator.assign(self.scheduler.running,
                                   bool(self.scheduler.waiting or self.scheduler.swapped))
        plan = self.scheduler.schedule()
        self.speculator.cost.start(plan)
        self._admitted(plan)
        for outcome in self.executor.run(plan):
            self._apply(outcome)
        self.recorder.steps += 1
        self.recorder.peak_blocks = max(self.recorder.peak_blocks, self.blocks.num_used_blocks)

    def _admitted(self, plan: StepPlan) -> None:
        self.recorder.preemptions += len(plan.preempted)
        for req, error in plan.failed:
            self._finish(req, "error", error=error)
        for a in plan.admitted:
            s = a.request.stats
            if s.queue_s == 0.0:  # first admission, not a resume after preemption
                s.queue_s = time.perf_counter() - a.request.arrival
                s.cached_tokens, s.cache_source = a.cached_tokens, a.source
                self.recorder.cached_tokens += a.cached_tokens
                self.recorder.prompt_tokens += s.prompt_tokens
                if a.request.in_prefill:  # a progress bar can show from the first chunk on
                    a.request.events.put(GenerationEvent(
                        a.request.request_id, None, "",
                        prefill=(a.cached_tokens, s.prompt_tokens)))

    def _apply(self, o: Outcome) -> None:
        """Apply one executor outcome to its request: computed K/V, a token, or an error."""
        req = o.request
        if req.finished:
            return
        try:
            if o.error is not None:
                raise RuntimeError(o.error)
            req.num_computed += o.computed
            if o.drafted:  # the rejected drafts' slots go back; their K/V is never read
                self.blocks.truncate(req.request_id, o.drafted - len(o.more))
            if o.token is not None and self.speculator.active:
                self.speculator.settle(req, [o.token, *o.more])
            self.executor.fault(req, "token" if o.token is not None else "computed")
            done = min(req.num_computed, req.total_len)  # accepted drafts: registered next step
            if self.prefix.due(req.prefix, done):  # (building all_ids copies the context)
                self.prefix.on_computed(req.request_id, req.prefix, req.all_ids, done,
                                        len(req.prompt_ids))
            if o.token is not None:
                now = time.perf_counter()
                for i, token in enumerate([o.token, *o.more]):
                    if not req.finished:  # an accepted draft may end it (EOS, a stop string)
                        self._accept(req, token, now, o.logprobs[i] if o.logprobs else None)
            elif req.stats.preemptions == 0:
                req.events.put(GenerationEvent(req.request_id, None, "",
                                               prefill=(req.num_computed, len(req.prompt_ids))))
        except Exception as e:  # noqa: BLE001 - one request's failure stays its own
            self._finish(req, "error", error=o.error or f"{type(e).__name__}: {e}")

    def _accept(self, req: Request, token: int, now: float, logprob=None) -> None:
        """Record a sampled token (and its `TokenLogprob`); emit it, or finish the request."""
        s, rec = req.stats, self.recorder
        req.output_ids.append(token)
        if s.generation_tokens == 0:
            s.ttft_s = now - req.arrival
            s.prefill_s = s.ttft_s - s.queue_s
            rec.observe("ttft_s", s.ttft_s)
            rec.observe("prefill_tps", s.prefill_tps)
        else:
            itl = now - req.last_token_at
            s.inter_token_s.append(itl)
            s.decode_s = now - req.arrival - s.ttft_s
            rec.observe("itl_s", itl)
        req.last_token_at = now
        s.generation_tokens += 1
        s.blocks_used = max(s.blocks_used, len(self.blocks.block_tables[req.request_id]))
        out = req.decoder.accept(token, s.generation_tokens)
        lps = [logprob] if logprob is not None else None
        if out.finish is None:
            req.events.put(GenerationEvent(req.request_id, token, out.text, logprobs=lps))
        else:
            self._finish(req, out.finish, token=token, text=out.text, logprobs=lps)

    def _finish(self, req: Request, reason: str, *, error: str | None = None,
                token: int | None = None, text: str = "", logprobs=None) -> None:
        """End a request: release its blocks exactly once, emit the final event."""
        if req.finished:
            return
        decided = req.cancel_at or time.perf_counter()
        s = req.stats
        s.stop_string = req.decoder.stop.matched
        window = self.blocks.window
        s.bytes_used = self.kv.bytes_for(s.blocks_used,
                                         window.held(req.request_id) if window else 0)
        s.blocks_released = self.scheduler.release(req)
        s.release_latency_ms = (time.perf_counter() - decided) * 1e3
        req.state, req.finish_reason, req.error = RequestState.FINISHED, reason, error
        rec = self.recorder
        rec.finish(reason, s.release_latency_ms)
        if s.generation_tokens > 1 and s.decode_s > 0:
            rec.observe("decode_tps", s.decode_tps)
        with self._lock:
            self._requests.pop(req.request_id, None)
        self.speculator.forget(req.request_id)
        req.events.put(GenerationEvent(req.request_id, token, text, finish_reason=reason,
                                       stats=s, error=error, logprobs=logprobs))

    def _settle(self) -> None:
        # a launched decode step still running at interpreter exit aborts the process
        # (MLX's stream thread is torn down under it): wait for it; its tokens are dropped
        with self._step_lock:
            self.executor.resolve()
        mx.synchronize()

    def _close(self) -> None:
        self._settle()  # without an engine thread, steps ran (and queued work) here
        self.prefix.close()  # drains the disk writer

    # -- observation -------------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        """A snapshot of the pool, the prefix cache, the queues and the latencies."""
        with self._lock:
            inbox = len(self._inbox)
        return snapshot(self.blocks, self.recorder, self.layout, self.scheduler, self.prefix, inbox)

    def block_map(self) -> str:
        """One character per block: "." free, "#" in use, "S" shared, "c" cached."""
        cached = set(self.blocks.evictable)
        return "".join("c" if b in cached else "." if r == 0 else "#" if r == 1 else "S"
                       for b, r in enumerate(list(self.blocks.ref_counts)))


"""The engine: a model, its paged KV pool, and continuous batching over it.

Callers `submit` requests (any thread) and iterate the returned handle for
events; `cancel`, `metrics` and `block_map` are thread-safe. Steps run either
on the engine's own thread (`start`) or, without it, in whichever consumer
thread is waiting for an event. Every way a request ends goes through
`_finish`, which drops its block references exactly once.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator

import mlx.core as mx

from engine.config import EngineConfig
from engine.errors import EngineStoppedError, RequestError, RequestTooLargeError
from engine.executor import StepExecutor
from engine.generation import GenerationEvent, GenerationResult, StopMatcher, collect
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.kv_cache import PagedKVCache
from engine.kvcache.prefix_cache import PrefixCache
from engine.kvcache.swap import HostSwap
from engine.metrics import EngineMetrics, MetricsRecorder, snapshot
from engine.model.loader import LoadedModel
from engine.model.model_runner import PagedModel
from engine.request import Priority, Request, RequestHandle, RequestState
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig


class Engine:
    """Serves generation requests for one model over a block-paged KV pool."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.loaded = loaded
        self.config = config = config or EngineConfig()
        self.runner = PagedModel(loaded.model, loaded.model_type)
        if config.fuse_projections:
            self.runner.fuse_projections()
        dtype = getattr(mx, config.kv_dtype) if config.kv_dtype else None
        self.layout = self.runner.kv_layout(config.block_size, dtype)
        num_blocks = self.layout.num_blocks_for(config.kv_budget_bytes)
        if num_blocks < 1:
            raise ValueError(
                f"KV budget of {config.kv_budget_bytes} bytes holds no block of "
                f"{self.layout.bytes_per_block} bytes"
            )
        self.kv = PagedKVCache(self.layout, num_blocks)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.max_context = min(config.max_context or loaded.context_length, loaded.context_length)
        self.recorder = MetricsRecorder()
        self.swap = HostSwap(self.kv, self.blocks, config.swap_budget_bytes)
        self.prefix = PrefixCache(loaded, self.kv, self.blocks, config)
        sched = SchedulerConfig(
            max_running=config.max_running,
            max_prefill_tokens=config.max_step_tokens or config.prefill_chunk,
            prefill_chunk=config.prefill_chunk,
            max_prefill_tokens_decoding=config.max_step_tokens_decoding,
            watermark_blocks=max(1, int(config.watermark * num_blocks)),
        )
        self.scheduler = Scheduler(self.blocks, sched, self)
        self.executor = StepExecutor(self)
        self._ids = itertools.count()
        self._lock = threading.RLock()  # guards the inbox, cancels and the request table
        self._step_lock = threading.RLock()  # one step at a time
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._cancels: dict[int, float] = {}
        self._requests: dict[int, Request] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._in_step = False  # a cancel from inside a step waits for the next one

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    # -- prompts -------------------------------------------------------------------
    def encode_prompt(self, prompt: str, *, system: str | None = None, raw: bool = False,
                      history: list[dict] | None = None) -> list[int]:
        """Token ids for a user prompt: through the chat template unless ``raw``."""
        if not prompt or not prompt.strip():
            raise RequestError("the prompt is empty")
        tok = self.tokenizer
        if raw or not getattr(tok, "chat_template", None):
            return list(tok.encode(prompt))
        messages = [{"role": "system", "content": system}] if system else []
        messages += (history or []) + [{"role": "user", "content": prompt}]
        return list(tok.apply_chat_template(messages, add_generation_prompt=True))

    def check_request(self, prompt_ids: list[int], params: SamplingParams,
                      ) -> tuple[int, str | None]:
        """Validate a request: (max new tokens it may produce, a notice if reduced).

        Raises `RequestTooLargeError` for a request that can never fit.
        """
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= self.max_context:
            raise RequestTooLargeError(
                f"the prompt has {n} tokens; the context holds {self.max_context}"
            )
        pool_tokens = self.blocks.num_blocks * self.blocks.block_size
        if n >= pool_tokens:
            raise RequestTooLargeError(
                f"the prompt has {n} tokens; the KV pool holds {pool_tokens} "
                f"({self.blocks.num_blocks} blocks; raise the KV budget)"
            )
        fits = min(self.max_context, pool_tokens) - n
        if params.max_tokens <= fits:
            return params.max_tokens, None
        if self.config.overflow == "reject":
            raise RequestTooLargeError(
                f"{n} prompt + {params.max_tokens} new tokens exceed the "
                f"{'context' if self.max_context <= pool_tokens else 'KV pool'} "
                f"({min(self.max_context, pool_tokens)} tokens)"
            )
        return fits, f"max_tokens reduced from {params.max_tokens} to {fits} to fit"

    # -- requests --------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
               priority: Priority = Priority.INTERACTIVE, timeout_s: float | None = None,
               tenant: str = "local", permission_version: int = 0) -> RequestHandle:
        """Queue a request; iterate the returned handle for its events.

        Raises at once (and counts a rejection) if the request can never fit.
        """
        params = params or SamplingParams()
        try:
            if self._stopped:
                raise EngineStoppedError("the engine has shut down")
            max_new, notice = self.check_request(list(prompt_ids), params)
        except RequestError:
            self.recorder.rejections += 1
            raise
        now = time.perf_counter()
        req = Request(next(self._ids), list(prompt_ids), params, max_new,
                      priority=Priority(priority), tenant=tenant,
                      permission_version=permission_version, arrival=now,
                      deadline=now + timeout_s if timeout_s is not None else None)
        req.notice = notice
        s = req.stats
        s.prompt_tokens, s.block_size = len(prompt_ids), self.layout.block_size
        s.bytes_per_token = self.layout.bytes_per_token
        with self._wake:
            self._requests[req.request_id] = req
            self._inbox.append(req)
            self._wake.notify()
        return RequestHandle(self, req)

    def cancel(self, request_id: int) -> bool:
        """Cancel a request; it ends within one step. False if unknown or already done."""
        with self._wake:
            req = self._requests.get(request_id)
            if req is None or req.finished:
                return False
            self._cancels.setdefault(request_id, time.perf_counter())
            self._wake.notify()
            threaded = self._thread is not None and self._thread.is_alive()
        if not threaded and not self._in_step:  # nobody else will step soon: release now
            with self._step_lock:
                self._apply_cancels()
        return True

    def _apply_cancels(self) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels, {}
        for rid, at in cancels.items():
            req = self._requests.get(rid)
            if req is not None:
                req.cancel_at = at
                self._finish(req, "cancelled")

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

    def _next_event(self, req: Request) -> GenerationEvent:
        """The request's next event; drives steps itself when no engine thread runs."""
        while True:
            try:
                return req.events.get_nowait()
            except queue.Empty:
                pass
            thread = self._thread
            if thread is not None and thread.is_alive():
                try:
                    return req.events.get(timeout=0.5)
                except queue.Empty:
                    continue
            if req.finished and req.events.empty():
                raise RuntimeError("request finished without a final event")
            self.step()

    # -- the step loop -----------------------------------------------------------------
    def start(self) -> None:
        """Run steps on a background thread until `shutdown` (idempotent)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._loop, name="kvchat-engine",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stopped or self._inbox or self._cancels
                           or self.scheduler.has_work):
                    self._wake.wait()
                if self._stopped:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a bug in a step must not strand requests
                self._fail_all(f"engine step failed: {type(e).__name__}: {e}")

    def _fail_all(self, error: str) -> None:
        with self._step_lock:
            with self._lock:
                live = list(self._requests.values())
            for req in live:
                self._finish(req, "error", error=error)

    def step(self) -> None:
        """One engine step: take in requests and cancels, plan, run, release."""
        with self._step_lock:
            self._in_step = True
            try:
                self._step()
            finally:
                self._in_step = False

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
        plan = self.scheduler.schedule()
        self.recorder.preemptions += len(plan.preempted)
        self.executor.run(plan)
        self.recorder.steps += 1
        self.recorder.peak_blocks = max(self.recorder.peak_blocks,
                                        self.blocks.num_used_blocks)

    # -- scheduler hooks --------------------------------------------------------------
    def blocks_to_admit(self, req: Request) -> int:
        """Free blocks the request needs: cached prefix blocks in use elsewhere cost none."""
        shared = sum(1 for b in self.prefix.ram_hits(req) if self.blocks.ref_counts[b] > 0)
        return self.blocks.blocks_needed(req.total_len) - shared

    def admit(self, req: Request) -> None:
        cached, source = self.prefix.admit(req)
        if req.stats.queue_s == 0.0:  # first admission (not a resume after preemption)
            req.stats.queue_s = time.perf_counter() - req.arrival
            req.stats.cached_tokens, req.stats.cache_source = cached, source
            self.recorder.cached_tokens += cached
            self.recorder.prompt_tokens += len(req.prompt_ids)
        if req.sampler is None:
            p = req.params
            if p.seed is not None:
                mx.random.seed(p.seed)
            req.sampler = p.make_sampler()
            req.processors = p.make_logits_processors()
            req.detok = self.tokenizer.detokenizer
            req.stop = StopMatcher(p.stop)

    def preempt(self, req: Request) -> None:
        """Give back a running request's blocks: swap them to host, or recompute later."""
        req.stats.preemptions += 1
        if self.config.preempt_mode == "swap" and self.swap.can_swap_out(req):
            self.swap.swap_out(req)
            req.state = RequestState.SWAPPED
        else:
            self.blocks.free(req.request_id)
            req.num_computed = req.registered = 0
            req.state = RequestState.WAITING

    def swap_in(self, req: Request) -> None:
        self.swap.swap_in(req)
        req.state = RequestState.RUNNING

    # -- tokens and endings -----------------------------------------------------------------
    def _finish(self, req: Request, reason: str, *, error: str | None = None,
                token: int | None = None, text: str = "") -> None:
        """End a request: drop its block references exactly once, emit the final event."""
        if req.finished:
            return
        decided = req.cancel_at or time.perf_counter()
        self.scheduler.remove(req)
        self.swap.drop(req)
        s = req.stats
        s.bytes_used = s.blocks_used * self.layout.bytes_per_block
        s.blocks_released = self.blocks.free(req.request_id)
        s.release_latency_ms = (time.perf_counter() - decided) * 1e3
        req.state, req.finish_reason, req.error = RequestState.FINISHED, reason, error
        rec = self.recorder
        rec.release(s.release_latency_ms)
        rec.count_finish(reason)
        if s.generation_tokens > 1 and s.decode_s > 0:
            rec.observe("decode_tps", s.decode_tps)
        with self._lock:
            self._requests.pop(req.request_id, None)
        req.events.put(GenerationEvent(req.request_id, token, text, finish_reason=reason,
                                       stats=s, error=error))

    def shutdown(self) -> None:
        """Finish every request ("shutdown"), release all blocks, stop the thread."""
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._step_lock:
            with self._lock:
                pending = list(self._requests.values())
                self._inbox.clear()
            for req in pending:
                self._finish(req, "shutdown")
        self.prefix.close()  # drains the disk writer

    # -- observation -------------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        """A snapshot of the pool, the prefix cache, the queues and the latencies."""
        return snapshot(self)

    def block_map(self) -> str:
        """One character per block: "." free, "#" in use, "S" shared, "c" cached."""
        cached = set(self.blocks.evictable)
        return "".join("c" if b in cached else "." if r == 0 else "#" if r == 1 else "S"
                       for b, r in enumerate(list(self.blocks.ref_counts)))

    # -- a single sequence's forward (tests, tools) ------------------------------------------
    def _forward(self, seq_id: int, token_ids: list[int] | mx.array, *, logits: bool):
        """Append ``token_ids`` to sequence ``seq_id`` and run the model over them."""
        L = len(token_ids) if isinstance(token_ids, list) else token_ids.size
        plan = self.blocks.append(seq_id, L)
        self.kv.copy_blocks(plan.copies)
        ids = mx.array(token_ids, dtype=mx.int32) if isinstance(token_ids, list) else token_ids
        batch = self.executor.batch([seq_id], ids.reshape(1, L), [plan.slots])
        return self.runner(batch, self.kv, logits=logits)

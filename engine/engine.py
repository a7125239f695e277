"""The engine: a model, its paged KV pool, and streaming generation over it."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import mlx.core as mx

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import RequestError
from engine.generation import GenerationEvent, RequestStats, StopMatcher
from engine.kv_cache import PagedKVCache
from engine.loader import LoadedModel
from engine.model_runner import PagedModel, StepBatch
from engine.paged_attention import contiguous_run
from engine.sampling import SamplingParams


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
        self._ids = itertools.count()

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

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Validate a request; return the max new tokens it may produce."""
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= self.max_context:
            raise RequestError(
                f"the prompt has {n} tokens; the context holds {self.max_context}"
            )
        max_new = min(params.max_tokens, self.max_context - n)
        need = self.blocks.blocks_needed(n + max_new)
        if need > self.blocks.num_blocks:
            raise RequestError(
                f"{n} prompt + {max_new} new tokens need {need} KV blocks; "
                f"the pool has {self.blocks.num_blocks} (raise the KV budget)"
            )
        return max_new

    # -- forward -------------------------------------------------------------------
    def _forward(self, seq_id: int, token_ids: list[int] | mx.array, *, logits: bool):
        """Append ``token_ids`` to sequence ``seq_id`` and run the model over them."""
        L = len(token_ids) if isinstance(token_ids, list) else token_ids.size
        plan = self.blocks.append(seq_id, L)
        self.kv.copy_blocks(plan.copies)
        ids = mx.array(token_ids, dtype=mx.int32) if isinstance(token_ids, list) else token_ids
        n = self.blocks.num_tokens[seq_id]
        table = self.blocks.block_tables[seq_id]
        batch = StepBatch(
            input_ids=ids.reshape(1, L),
            offsets=mx.array([n - L], dtype=mx.int32),
            slots=mx.array(plan.slots, dtype=mx.int32),
            block_tables=mx.array([table], dtype=mx.int32),
            context_lens=[n],
            block_run=contiguous_run(table),
        )
        return self.runner(batch, self.kv, logits=logits)

    # -- generation ----------------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 ) -> Iterator[GenerationEvent]:
        """Stream the generation for one request, token by token.

        The request's blocks are released on every way out: finish, stop
        string, error, and the consumer closing the generator (disconnect).
        """
        params = params or SamplingParams()
        max_new = self.check_request(prompt_ids, params)
        seq_id = next(self._ids)
        stats = RequestStats(prompt_tokens=len(prompt_ids), block_size=self.layout.block_size,
                             bytes_per_token=self.layout.bytes_per_token)
        sampler = params.make_sampler()
        processors = params.make_logits_processors()
        if params.seed is not None:
            mx.random.seed(params.seed)
        detok = self.tokenizer.detokenizer
        detok.reset()
        stop = StopMatcher(params.stop)
        eos = set() if params.ignore_eos else set(self.tokenizer.eos_token_ids)
        history = mx.array(prompt_ids, dtype=mx.int32)
        tic = time.perf_counter()
        self.blocks.allocate(seq_id)
        try:
            chunk = self.config.prefill_chunk
            # prefill: all but the last prompt token, in chunks (as mlx-lm does)
            for start in range(0, len(prompt_ids) - 1, chunk):
                end = min(start + chunk, len(prompt_ids) - 1)
                self._forward(seq_id, prompt_ids[start:end], logits=False)
                mx.eval(self.kv.keys, self.kv.values)
            stats.prefill_s = time.perf_counter() - tic

            def sample(y: mx.array) -> mx.array:
                nonlocal history
                logits = self._forward(seq_id, y, logits=True)
                if processors:
                    history = mx.concatenate([history, y])
                    for proc in processors:
                        logits = proc(history, logits)
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                return sampler(logprobs)

            # Pipelined as in mlx-lm: the next step's graph is built and queued
            # before waiting on this token, hiding Python time behind compute.
            y = sample(mx.array(prompt_ids[-1:], dtype=mx.int32))
            mx.async_eval(y)
            last = tic
            finish = None
            while finish is None:
                stats.blocks_used = len(self.blocks.block_tables[seq_id])
                next_y = None
                if stats.generation_tokens + 1 < max_new:
                    next_y = sample(y)
                    mx.async_eval(next_y)
                token = y.item()
                now = time.perf_counter()
                if stats.generation_tokens == 0:
                    stats.ttft_s = now - tic
                else:
                    stats.inter_token_s.append(now - last)
                    stats.decode_s = now - tic - stats.ttft_s
                last = now
                stats.generation_tokens += 1
                if token in eos:
                    finish, text = "stop", ""
                else:
                    detok.add_token(token)
                    text, hit = stop.feed(detok.last_segment)
                    if hit:
                        finish = "stop"
                    elif stats.generation_tokens >= max_new:
                        finish = "length"
                if finish is not None:
                    detok.finalize()
                    if finish == "length" or token in eos:
                        # bytes the detokenizer held back may still complete a stop string
                        more, hit = stop.feed(detok.last_segment)
                        text += more if hit else more + stop.flush()
                        finish = "stop" if hit else finish
                    break
                yield GenerationEvent(seq_id, token, text)
                y = next_y
            stats.bytes_used = stats.blocks_used * self.layout.bytes_per_block
            stats.blocks_released = self.blocks.free(seq_id)
            yield GenerationEvent(seq_id, token, text, finish_reason=finish, stats=stats)
        finally:
            self.blocks.free(seq_id)  # no-op when already released above

    def generate_text(self, prompt_ids: list[int], params: SamplingParams | None = None):
        """Run a request to the end; returns (text, token ids, finish reason, stats)."""
        text, tokens, final = [], [], None
        for event in self.generate(prompt_ids, params):
            text.append(event.text)
            if event.token is not None:
                tokens.append(event.token)
            final = event
        return "".join(text), tokens, final.finish_reason, final.stats

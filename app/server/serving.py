"""One completion request's life: encode, admit (bounded queue), submit, stream or collect.

The request runs under its API key's tenant and permission version, so its prefix
blocks are never shared with another tenant. Whatever way it ends (the answer is done,
the client disconnects, the drain deadline passes, the task is cancelled), the engine
handle is cancelled on the way out, which releases its blocks within one engine step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.server import choices, context, errors, reasoning, tool_calls
from app.server.choices import ANSWERED, Samples, unfinished
from app.server.errors import APIError
from app.server.keys import Principal
from app.server.logprobs_out import TokenText
from app.server.openai_schema import ParsedRequest
from app.server.responses import Reply
from app.server.state import ServerState
from app.server.streaming import EventStreamResponse, cancel_on_disconnect
from engine import prompts
from engine.errors import EngineStoppedError, RequestError, RequestTooLargeError
from engine.generation import GenerationEvent
from engine.request import RequestHandle
from engine.sampling import SamplingParams

CHARS_PER_TOKEN = 16  # a prompt over context x 16 characters can never fit: refused untokenized
RETRY_AFTER_S = 1
SEEDS = 1 << 64


def native_tools(engine) -> bool:
    """Whether the model's chat template renders ``tools`` itself."""
    return "tools" in (getattr(engine.tokenizer, "chat_template", None) or "")


def encode(engine, parsed: ParsedRequest) -> list[int]:
    """Prompt token ids: chat messages through the chat template, or a raw prompt."""
    if parsed.kind == "chat" and (parsed.uses_tools or parsed.template_kwargs or any(
            m["role"] == "tool" or m.get("tool_calls") for m in parsed.messages)):
        native = native_tools(engine)
        messages, tools = tool_calls.render(parsed.messages,
                                            parsed.tools if parsed.uses_tools else [], native)
        return prompts.messages_ids(engine.tokenizer, messages, tools, parsed.template_kwargs)
    if parsed.kind == "chat":
        *history, last = parsed.messages
        return engine.encode_prompt(last["content"], history=history)
    if isinstance(parsed.prompt, list):
        return list(parsed.prompt)
    return engine.encode_prompt(parsed.prompt, raw=True)


def sampling_params(parsed: ParsedRequest, default_max_tokens: int,
                    template: str | None = None) -> SamplingParams:
    constraint = parsed.constraint
    if parsed.uses_tools and parsed.tool_choice != "auto":  # required, or a named function
        style = tool_calls.style_of(template) if "tools" in (template or "") else "hermes"
        constraint = tool_calls.grammar(parsed.tools, parsed.tool_choice,
                                        parsed.parallel_tool_calls, style)
    return SamplingParams(
        max_tokens=parsed.max_tokens or default_max_tokens, temperature=parsed.temperature,
        top_p=parsed.top_p, top_k=parsed.top_k, min_p=parsed.min_p,
        repetition_penalty=parsed.repetition_penalty, seed=parsed.seed, stop=parsed.stop,
        presence_penalty=parsed.presence_penalty, frequency_penalty=parsed.frequency_penalty,
        logit_bias=parsed.logit_bias, logprobs=parsed.logprobs,
        thinking_budget=parsed.thinking_budget if constraint is None else None,
        constraint=constraint)


async def complete(state: ServerState, request: Request, parsed: ParsedRequest,
                   principal: Principal) -> Response:
    """Serve a parsed completion request (its ``n`` answers); raises `APIError` for a
    refusal."""
    if parsed.n > state.max_n:
        raise errors.invalid(f"n must be at most {state.max_n} on this server (--max-n), "
                             f"got {parsed.n}", "n")
    ids, params = await prepare(state, parsed, principal)
    handle, reply = submit(state, ids, params, parsed, principal)
    if parsed.logprobs is not None:
        reply.token_text = TokenText.of(state.engine.tokenizer)
    samples = Samples(state.pump, handle, lambda i: fork(state, ids, params, principal, i),
                      parsed.n)
    gone = samples_gone(state, samples)
    if parsed.stream:
        return EventStreamResponse(choices.stream(samples, reply, parsed.include_usage),
                                   on_disconnect=gone, headers=reply.headers())
    async with cancel_on_disconnect(request.receive, gone):
        body = await choices.whole(samples, reply)
    return JSONResponse(body, headers=reply.headers())


def fork(state: ServerState, ids: list[int], params: SamplingParams, principal: Principal,
         index: int) -> RequestHandle:
    """Submit answer ``index`` of a request with ``n`` > 1 (its own seed)."""
    if params.seed is not None:
        params = dataclasses.replace(params, seed=(params.seed + index) % SEEDS)
    try:
        return state.engine.submit(ids, params, tenant=principal.tenant,
                                   permission_version=principal.permission_version)
    except EngineStoppedError:
        raise errors.shutting_down() from None
    except RequestError as e:  # the first sample was taken: this is the pool's state
        raise APIError(503, f"answer {index} could not start: {e}", type="server_error",
                       code="unavailable") from None


async def prepare(state: ServerState, parsed: ParsedRequest, principal: Principal | None = None
                  ) -> tuple[list[int], SamplingParams]:
    """The prompt's ids (tokenized off the event loop, under the context policy) and the
    sampling parameters."""
    engine = state.engine
    if state.draining:
        raise errors.shutting_down()
    limit = engine.max_context * CHARS_PER_TOKEN
    if parsed.text_chars > limit:
        raise errors.context_length(
            f"the prompt has {parsed.text_chars} characters; this model's context holds "
            f"{engine.max_context} tokens", parsed.prompt_param)
    try:
        ids = await state.run_tokenizer(encode, engine, parsed)
        params = sampling_params(parsed, state.default_max_tokens,
                                 getattr(engine.tokenizer, "chat_template", None))
        ids = await context.apply(state, parsed, ids, params.max_tokens, encode, principal)
    except RequestError as e:
        raise errors.invalid(str(e), parsed.prompt_param) from None
    return ids, params


def submit(state: ServerState, ids: list[int], params: SamplingParams, parsed: ParsedRequest,
           principal: Principal) -> tuple[RequestHandle, Reply]:
    """Admit the request into the engine, or refuse it (full queue, never fits, bad field)."""
    engine = state.engine
    if state.draining:  # SIGTERM may have come while the prompt was being encoded
        raise errors.shutting_down()
    waiting = engine.metrics().waiting
    if waiting >= state.max_waiting:
        raise errors.queue_full(waiting, RETRY_AFTER_S)
    inside = (parsed.kind == "chat" or params.thinking_budget is not None) and \
        reasoning.opens_thinking(engine.tokenizer.decode(ids[-4:]))  # a think tag left open
    params.thinking = inside  # where a thinking budget starts counting
    try:
        handle = engine.submit(ids, params, tenant=principal.tenant,
                               permission_version=principal.permission_version)
    except RequestTooLargeError as e:
        raise errors.context_length(str(e), parsed.prompt_param) from None
    except RequestError as e:
        param = "response_format" if params.constraint is not None and str(e).startswith(
            "invalid ") else None  # a schema or grammar that does not compile
        raise errors.invalid(str(e), param) from None
    except EngineStoppedError:
        raise errors.shutting_down() from None
    notes = [handle.notice, *(parsed.context or {}).get("notes", [])]
    reply = Reply(parsed.kind, model=state.model_id, fingerprint=state.fingerprint,
                  max_tokens=handle.max_tokens, context=parsed.context,
                  notice="; ".join(n for n in notes if n) or None,
                  tools=parsed.tools if parsed.uses_tools else [],
                  thinking=inside and parsed.kind == "chat")
    return handle, reply


def on_disconnect(state: ServerState, handle: RequestHandle) -> Callable[[], None]:
    """What to do when the client goes away: cancel at once (counted once, if still live)."""
    fired = False

    def gone() -> None:
        nonlocal fired
        if not fired and state.pump.abandon(handle):
            state.counters.disconnects += 1
        fired = True

    return gone


def samples_gone(state: ServerState, samples: Samples) -> Callable[[], None]:
    """`on_disconnect` for the ``n`` answers of one request: all are cancelled."""
    fired = False

    def gone() -> None:
        nonlocal fired
        if not fired and samples.cancel_all():
            state.counters.disconnects += 1
        fired = True

    return gone


async def whole_answer(state: ServerState, request: Request, handle: RequestHandle
                       ) -> tuple[str, GenerationEvent]:
    """(text, final event) of an answer read to its end; the client leaving while it waits
    cancels the request at once. Raises `APIError` for an answer that did not complete."""
    texts, final = [], None
    async with cancel_on_disconnect(request.receive, on_disconnect(state, handle)):
        async for event in state.pump.events(handle):
            texts.append(event.text)
            final = event
    if final is None or final.finish_reason not in ANSWERED:
        reason = final.finish_reason if final is not None else "cancelled"
        raise unfinished(reason, final.error if final is not None else None)
    return "".join(texts), final


__all__ = ["ANSWERED", "complete", "encode", "sampling_params", "unfinished"]

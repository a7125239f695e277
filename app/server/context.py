"""The context policy of served chat requests (``kvchat serve --context-policy``).

The server is stateless, so each request brings its whole conversation. Within its
budget (``--context-budget``; default the context less the request's max_tokens) it is
sent as it is. Over it, `app.context_policy` decides, as in the chat: ``error`` (the
default, OpenAI's behaviour) leaves the refusal to the engine, a 400
``context_length_exceeded`` when it can never fit (or when it passes an explicit
``--context-budget``); ``truncate`` leaves out the oldest turns, never the system
messages or the last one; ``summarize`` has the model condense the turns truncate would
leave out (`app.context_summary`, at background priority, before the answer) and sends
the summary with the system text. What was cut or summarized is in the response's
``kvchat`` object (``truncated_turns``, ``summarized_turns``, ``context``) and its
``X-Kvchat-Notice`` header.
"""

from __future__ import annotations

import asyncio

from app.context_policy import Fitted, fit
from app.context_summary import SummaryJob
from app.server import errors
from app.server.openai_schema import ParsedRequest

SYSTEM_ROLES = ("system", "developer")


def budget_of(state, max_tokens: int) -> int:
    context = state.engine.max_context
    return state.context_budget or max(context // 2, context - max_tokens)


async def apply(state, parsed: ParsedRequest, ids: list[int], max_tokens: int, encode,
                principal=None) -> list[int]:
    """The prompt's ids under the server's policy (``parsed.messages`` rewritten when cut)."""
    policy, engine = state.context_policy, state.engine
    budget = budget_of(state, max_tokens)
    if parsed.kind != "chat" or len(ids) <= budget:
        return ids
    if policy == "error":
        if state.context_budget is None:
            return ids  # the engine refuses what can never fit: OpenAI's 400
        raise errors.context_length(f"the prompt has {len(ids)} tokens, over the server's "
                                    f"--context-budget of {budget}", "messages")
    system = [m for m in parsed.messages if m["role"] in SYSTEM_ROLES]
    *history, last = [m for m in parsed.messages if m["role"] not in SYSTEM_ROLES]
    system_text = "\n\n".join(m["content"] for m in system)
    count = engine.count_tokens

    def fitted_with(summary=None) -> Fitted:
        return fit(history, policy=policy, budget=budget, count=count, system=system_text,
                   question=last["content"], summary=summary)

    fitted = fitted_with()
    if policy == "summarize" and fitted.kept_from >= 2:
        job = SummaryJob(engine, list(history), None, fitted.kept_from - fitted.kept_from % 2,
                         max_tokens=max(64, budget // 4),
                         tenant=getattr(principal, "tenant", "local"),
                         permission_version=getattr(principal, "permission_version", 0))
        summary = await asyncio.to_thread(job.run)
        if summary is not None:
            fitted = fitted_with(summary)
    while True:
        head = [{"role": "system", "content": fitted.system}] if fitted.system else []
        parsed.messages = [*head, *fitted.history, last]
        ids = await state.run_tokenizer(encode, engine, parsed)
        if len(ids) <= budget or not fitted.history:
            break
        k = min(2, len(fitted.history))  # the count was an estimate: one more pair out
        fitted.truncated_turns += 1
        fitted.truncated_tokens += sum(count(m["content"]) for m in fitted.history[:k])
        fitted.history, fitted.kept_from = fitted.history[k:], fitted.kept_from + k
    parsed.context = {**fitted.to_dict(), "notes": fitted.notes()}
    return ids

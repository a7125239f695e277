"""Request fields about what is sampled and reported: ``n``, ``logprobs`` /
``top_logprobs``, ``logit_bias``, and reasoning (``reasoning_effort``, ``thinking_budget``,
``chat_template_kwargs``). Each check returns the value to store or raises a 400 naming
the field; `settle` checks how they combine once the whole body is read."""

from __future__ import annotations

from app.server.errors import invalid
from app.server.values import boolean, integer, number

MAX_LOGIT_BIAS = 1024
MAX_N = 128  # the schema's bound; the server's own limit (`--max-n`, 8) is checked at serving
MAX_TOP_LOGPROBS = 20  # OpenAI's (the engine's too)
EFFORTS = ("minimal", "low", "medium", "high")
# reasoning_effort -> thinking budget (tokens inside <think> before </think> is forced)
EFFORT_BUDGETS = {"minimal": 0, "low": 256, "medium": 1024, "high": 4096}
TEMPLATE_KWARGS = {"enable_thinking": bool, "reasoning_effort": str}


def logit_bias(name: str, value) -> dict[int, float]:
    """``{"<token id>": bias in [-100, 100]}``, as OpenAI's."""
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers", name)
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10):
            raise invalid(f"logit_bias keys must be token ids, got {key!r:.40}", name)
        out[int(key)] = number(name, bias, -100.0, 100.0)
    return out


def reasoning_effort(name: str, value) -> None:
    if value not in EFFORTS:
        raise invalid(f"reasoning_effort must be one of {', '.join(EFFORTS)}", name)


def template_kwargs(name: str, value) -> None:
    """vLLM's ``chat_template_kwargs``: only the variables kvchat passes on."""
    if not isinstance(value, dict) or any(
            k not in TEMPLATE_KWARGS or not isinstance(v, TEMPLATE_KWARGS[k])
            for k, v in value.items()):
        raise invalid("chat_template_kwargs takes enable_thinking (true/false) and "
                      "reasoning_effort", name)


def n(name: str, value) -> int:
    return integer(name, value, 1, MAX_N + 1)


def thinking_budget(name: str, value) -> int:
    return integer(name, value, 0, 1 << 31)


def top_logprobs(name: str, value) -> int:
    return integer(name, value, 0, MAX_TOP_LOGPROBS + 1)


def legacy_logprobs(name: str, value) -> int:
    """/v1/completions' ``logprobs``: how many alternatives (0 = the chosen token's only)."""
    return integer(name, value, 0, MAX_TOP_LOGPROBS + 1)


def settle(parsed, body: dict) -> None:
    """Checks across fields, once each has passed its own: chat's logprobs/top_logprobs
    pair, the thinking budget (given, or from reasoning_effort) against a constraint."""
    if parsed.kind == "chat":
        wants = boolean("logprobs", body["logprobs"]) if body.get("logprobs") is not None \
            else False
        top = body.get("top_logprobs")
        if top is not None and not wants:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        parsed.logprobs = (top or 0) if wants else None
    constrained = parsed.constraint is not None or (
        parsed.tools and parsed.tool_choice not in ("auto", "none"))
    if parsed.thinking_budget is not None and constrained:
        raise invalid("thinking_budget cannot be combined with response_format, a grammar "
                      "or a required tool call", "thinking_budget")
    effort = body.get("reasoning_effort")
    if parsed.thinking_budget is None and effort is not None and not constrained:
        parsed.thinking_budget = EFFORT_BUDGETS[effort]

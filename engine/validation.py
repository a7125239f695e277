"""Validation at the door: every field of a request is checked before it reaches the engine.

A bad value raises `RequestError` naming the field and its allowed range, in the
caller's thread, so one client's bad request never reaches a step that other
requests share (an out-of-vocabulary id would read outside the embedding table).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.errors import RequestError

MAX_TENANT_LEN = 128
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
SEED_LIMIT = 1 << 64
MAX_LOGIT_BIAS = 1024


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(name: str, value, lo: float, hi: float, *, hi_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    if value < lo or value > hi or (hi_open and value == hi):
        bracket = ")" if hi_open else "]"
        raise RequestError(f"{name} must be in [{lo:g}, {hi:g}{bracket}, got {value!r}")


def check_params(p) -> None:
    """Raise `RequestError` unless every field of a `SamplingParams` is in range.

    (Untyped: `engine.sampling` calls this from its constructor, and imports point one way.)
    """
    if not _is_int(p.max_tokens) or p.max_tokens < 1:
        raise RequestError(f"max_tokens must be an integer >= 1, got {p.max_tokens!r}")
    _finite("temperature", p.temperature, 0.0, 100.0)
    _finite("top_p", p.top_p, 0.0, 1.0)
    _finite("min_p", p.min_p, 0.0, 1.0)
    if not _is_int(p.top_k) or p.top_k < 0:
        raise RequestError(f"top_k must be an integer >= 0, got {p.top_k!r}")
    if p.repetition_penalty is not None:
        _finite("repetition_penalty", p.repetition_penalty, 0.0, 100.0)
        if p.repetition_penalty == 0:
            raise RequestError("repetition_penalty must be > 0")
    if p.seed is not None and (not _is_int(p.seed) or not 0 <= p.seed < SEED_LIMIT):
        raise RequestError(f"seed must be an integer in [0, 2^64), got {p.seed!r}")
    _finite("presence_penalty", p.presence_penalty, -2.0, 2.0)
    _finite("frequency_penalty", p.frequency_penalty, -2.0, 2.0)
    bias = p.logit_bias
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers")
    for token, value in bias.items():
        if not _is_int(token) or token < 0:
            raise RequestError(f"logit_bias keys must be token ids, got {token!r:.40}")
        _finite("a logit_bias value", value, -100.0, 100.0)
    if p.logprobs is not None and (not _is_int(p.logprobs) or not 0 <= p.logprobs <= 20):
        raise RequestError(f"logprobs must be an integer in [0, 20], got {p.logprobs!r:.40}")
    if p.thinking_budget is not None and (not _is_int(p.thinking_budget)
                                          or p.thinking_budget < 0):
        raise RequestError(f"thinking_budget must be an integer >= 0, "
                           f"got {p.thinking_budget!r:.40}")
    if p.thinking_budget is not None and p.constraint is not None:
        raise RequestError("thinking_budget cannot be combined with a constraint (the forced "
                           "</think> would break the grammar)")
    stops = p.stop
    if not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop must be a list of at most {MAX_STOP_STRINGS} strings")
    for s in stops:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_LEN:
            raise RequestError(f"each stop string must have 1..{MAX_STOP_LEN} characters, "
                               f"got {s!r:.40}")


def check_ids(prompt_ids: Sequence[int], vocab_size: int, what: str = "prompt token"
              ) -> list[int]:
    """The prompt (or other token ids) as a list of ints, each in ``[0, vocab_size)``."""
    try:
        ids = list(prompt_ids)
    except TypeError as e:
        raise RequestError("prompt ids must be a sequence of integers") from e
    for i, t in enumerate(ids):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise RequestError(f"{what} {i} is {t!r}; token ids must be integers in "
                               f"[0, {vocab_size})")
    return ids


def check_scope(tenant, permission_version, timeout_s) -> None:
    """Tenant, permission version and timeout of a request."""
    if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_LEN:
        raise RequestError(f"tenant must be a non-empty string of at most {MAX_TENANT_LEN} "
                           f"characters, got {tenant!r:.40}")
    if not _is_int(permission_version) or not 0 <= permission_version < (1 << 63):
        raise RequestError(f"permission_version must be an integer in [0, 2^63), "
                           f"got {permission_version!r}")
    if timeout_s is not None:
        _finite("timeout_s", timeout_s, 0.0, 1e9)


def check_ttl(ttl_s) -> None:
    """A cache lifetime: None (the tenant's), or positive seconds up to ten years."""
    if ttl_s is not None:
        _finite("cache_ttl_s", ttl_s, 1e-3, 3650 * 86400.0)

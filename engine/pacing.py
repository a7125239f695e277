"""Step pacing from measured forward times: cancel checks and the prefill budget.

A forward costs about ``fixed + per_token * tokens`` (the weights are read once per
forward; attention and the activations grow with the tokens). From the forwards
the executor times, `StepPacer` keeps both terms and answers two questions:
- how many layers may run between cancel checks, so that a cancel during a long
  prefill lands within ~``group_target_s`` (issue: a 512-token chunk takes seconds
  on a CPU);
- how many prompt tokens a step that also decodes may prefill, so the decoding
  sequences' inter-token latency stays near ``step_target_s``.
"""

from __future__ import annotations

ALPHA = 0.3  # EMA weight of the newest measurement


def ema(old: float | None, new: float, weight: float = ALPHA) -> float:
    """The moving average ``old`` (None: nothing yet) with ``new`` at ``weight``."""
    return new if old is None else (1 - weight) * old + weight * new


class StepPacer:
    """Measured cost of forwards -> layer groups and per-step prefill budgets."""

    def __init__(self, num_layers: int, *, group_target_s: float = 0.12,
                 step_target_s: float | None = 0.2, min_prefill_tokens: int = 16):
        self.num_layers = num_layers
        self.group_target_s = group_target_s
        self.step_target_s = step_target_s
        self.min_prefill_tokens = min_prefill_tokens
        self.fixed_s: float | None = None  # a forward's cost apart from its tokens
        self.per_token_s: float | None = None

    def observe(self, tokens: int, seconds: float, *, decode_only: bool) -> None:
        """Record one timed forward of ``tokens`` packed tokens."""
        if decode_only:  # few tokens: nearly all of it is the fixed cost
            self.fixed_s = ema(self.fixed_s, seconds)
        elif tokens >= 32:
            fixed = self.fixed_s or 0.0
            self.per_token_s = ema(self.per_token_s, max(seconds - fixed, 0.0) / tokens)

    def estimate_s(self, tokens: int) -> float | None:
        """Expected seconds of a forward over ``tokens`` tokens (None until measured)."""
        if self.per_token_s is None:
            return None
        return (self.fixed_s or 0.0) + self.per_token_s * tokens

    def layer_group(self, tokens: int) -> int:
        """Layers to run between cancel checks in a forward over ``tokens`` tokens."""
        est = self.estimate_s(tokens)
        if est is None:
            return 1  # unmeasured: check after every layer (an eval per layer costs little)
        per_layer = est / self.num_layers
        return max(1, min(self.num_layers, int(self.group_target_s / max(per_layer, 1e-9))))

    def decoding_budget(self, cap: int) -> int:
        """Prompt tokens a step with decodes may prefill: within ``step_target_s``."""
        if self.step_target_s is None or self.per_token_s is None:
            return cap
        room = self.step_target_s - (self.fixed_s or 0.0)
        tokens = int(room / max(self.per_token_s, 1e-9))
        return max(self.min_prefill_tokens, min(cap, tokens))

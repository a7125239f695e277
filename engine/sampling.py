"""Sampling parameters; the samplers themselves are mlx-lm's."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.constraint import Constraint
from engine.validation import check_params


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop."""

    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0  # OpenAI's, over the last 20 tokens (mlx-lm's window)
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added logit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    constraint: Constraint | None = None  # JSON schema, JSON, regex or grammar the output keeps
    logprobs: int | None = None  # report each token's logprob and this many alternatives
    thinking_budget: int | None = None  # tokens inside <think> before </think> is forced
    thinking: bool = False  # the prompt leaves the answer inside an opened <think>
    context_shift: bool | None = None  # past the context, drop the middle; None: the engine's

    def __post_init__(self):
        check_params(self)  # and again at submit: the fields may change after construction

    def make_sampler(self):
        from mlx_lm.sample_utils import make_sampler

        return make_sampler(self.temperature, top_p=self.top_p, min_p=self.min_p,
                            top_k=self.top_k)

    def make_logits_processors(self):
        from mlx_lm.sample_utils import make_logits_processors

        return make_logits_processors(
            logit_bias=self.logit_bias or None, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty or None,
            frequency_penalty=self.frequency_penalty or None)

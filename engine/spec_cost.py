"""What decode steps cost, as speculative decoding measures them (`engine.speculation`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.pacing import StepPacer, ema


@dataclass(slots=True)
class SpecCost:
    """What decode steps cost, measured: a plain step of ``rows`` sequences (an average per
    batch size), and each verified draft token on top (the extra seconds of a step with
    drafts over a plain step of as many rows). Until a draft was timed, a draft token is
    taken to cost what a prompt token costs in the pacer's prefill measurements."""

    pacer: StepPacer
    warmup: int = 3  # the engine's first decode steps (allocation, first calls) are not timed
    plain: dict[int, float] = field(default_factory=dict)  # rows -> seconds of a plain step
    per_draft: float | None = None

    def observe(self, rows: int, drafts: int, seconds: float) -> None:
        """A decode step of ``rows`` sequences that also verified ``drafts`` tokens."""
        if self.warmup > 0:
            self.warmup -= 1
        elif not drafts:
            self.plain[rows] = ema(self.plain.get(rows), seconds)
        elif rows in self.plain:  # noise can make one sample negative: their mean is not
            self.per_draft = ema(self.per_draft, (seconds - self.plain[rows]) / drafts)

    def fit(self, rows: int) -> tuple[float, float] | None:
        """(seconds of a plain step of ``rows``, seconds per draft token), once measured."""
        step = self.plain.get(rows)
        if step is None and self.plain:  # the nearest batch size measured
            step = self.plain[min(self.plain, key=lambda r: abs(r - rows))]
        per = self.per_draft if self.per_draft is not None else self.pacer.per_token_s
        if step is None or per is None:
            return None
        return step, max(per, 1e-6)

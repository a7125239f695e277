"""What decode steps cost, as speculative decoding measures them (`engine.speculation`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.pacing import StepPacer, ema

OUTLIER = 3.0  # a step timed over 3x its estimate counts as 3x (a pause, not the step)


@dataclass(slots=True)
class SpecCost:
    """What decode steps cost, measured: a plain step of ``rows`` sequences, and each
    verified draft token on top (the extra seconds of a step with drafts over a plain step
    of as many rows), both per batch size (the nearest one measured stands in). Until a
    draft was timed, a draft token is taken to cost what a prompt token costs in the
    pacer's prefill measurements.

    A step is timed from its start (`start`) to the next one's (`close`): the same span for
    a plain step, launched while the engine goes on, and a verify step, read before it
    goes on (timing only the forwards, a plain step took in the engine's work between
    steps and a verify step did not: a draft looked up to 5x cheaper than it was)."""

    pacer: StepPacer
    warmup: int = 3  # the engine's first decode steps (allocation, first calls) are not timed
    plain: dict[int, float] = field(default_factory=dict)  # rows -> seconds of a plain step
    per: dict[int, float] = field(default_factory=dict)  # rows -> seconds of a draft token
    started: tuple[int, int, float] | None = None  # the running step: rows, drafts, since

    def start(self, plan) -> None:
        """A step starts (a `StepPlan`): timed if it only decodes."""
        self.started = None if plan.prefills or not plan.decodes else (
            len(plan.decodes), sum(len(r.draft) for r, _ in plan.decodes), time.perf_counter())

    def close(self, going_on: bool) -> None:
        """The next step starts: observe the last one, if its batch is ``going_on`` (else
        the engine may have idled since)."""
        step, self.started = self.started, None
        if step is not None and going_on:
            self.observe(step[0], step[1], time.perf_counter() - step[2])

    def observe(self, rows: int, drafts: int, seconds: float) -> None:
        """A decode step of ``rows`` sequences that also verified ``drafts`` tokens."""
        if self.warmup > 0:
            self.warmup -= 1
            return
        step = self.plain.get(rows)
        if not drafts:
            self.plain[rows] = ema(step, seconds if step is None else min(seconds,
                                                                          OUTLIER * step))
        elif step is not None:  # noise can make one sample negative: their mean is not
            old = self.per.get(rows)
            seconds = seconds if old is None else min(seconds, OUTLIER * (step + old * drafts))
            self.per[rows] = ema(old, (seconds - step) / drafts)

    def fit(self, rows: int) -> tuple[float, float] | None:
        """(seconds of a plain step of ``rows``, seconds per draft token), once measured."""
        step, per = _nearest(self.plain, rows), _nearest(self.per, rows)
        per = per if per is not None else self.pacer.per_token_s
        if step is None or per is None:
            return None
        return step, max(per, 1e-6)

    def row(self, rows: int) -> float | None:
        """Seconds a sequence adds to a plain step of ``rows``: the slope from the smallest
        batch measured (None: no smaller batch measured, or one sequence)."""
        low = min(self.plain, default=rows)
        if low >= rows:
            return None
        return max(_nearest(self.plain, rows) - self.plain[low], 0.0) / (rows - low)


def _nearest(measured: dict[int, float], rows: int) -> float | None:
    if not measured:
        return None
    return measured[min(measured, key=lambda r: (abs(r - rows), r))]

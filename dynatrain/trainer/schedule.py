"""The learning-rate schedule: linear warmup, then cosine or linear decay to a floor.

The rate is a pure function of the step about to be taken, so the schedule has no state of its
own: the step count, which every switch and recovery already carries, is all it needs, and a run
resumed under another layout continues on the same curve. No torch import (job manifests are
validated without it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("constant", "cosine", "linear")


class ScheduleError(ValueError):
    """A schedule field is out of range; the message names it."""


@dataclass(frozen=True)
class LRSchedule:
    warmup_steps: int = 0
    """Steps over which the rate rises linearly to the peak: step ``s`` (0-based) of the
    warmup trains at ``peak * (s + 1) / warmup_steps``."""
    decay: str = "constant"
    """After warmup: ``constant`` (stay at the peak), ``cosine`` or ``linear`` to ``min_lr``."""
    decay_steps: int = 0
    """The step at which decay reaches ``min_lr`` (counted from 0, warmup included); after it
    the rate stays at the floor. 0 means the job's total steps."""
    min_lr: float = 0.0
    """The floor the decay ends at."""

    def __post_init__(self) -> None:
        problems = schedule_problems(self)
        if problems:
            raise ScheduleError("; ".join(problems))

    def resolved(self, total_steps: int) -> "LRSchedule":
        """This schedule with ``decay_steps`` 0 replaced by the job's ``total_steps``."""
        if self.decay_steps or self.decay == "constant":
            return self
        return LRSchedule(self.warmup_steps, self.decay, max(total_steps, self.warmup_steps + 1),
                          self.min_lr)

    def lr(self, peak: float, step: int) -> float:
        """The rate for optimizer step ``step`` (0-based: the first step is 0)."""
        if step < self.warmup_steps:
            return peak * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return peak
        span = max(1, (self.decay_steps or self.warmup_steps + 1) - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.decay == "cosine":
            return self.min_lr + (peak - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return peak - (peak - self.min_lr) * progress


def schedule_problems(s: LRSchedule) -> list[str]:
    p = []
    if not isinstance(s.warmup_steps, int) or s.warmup_steps < 0:
        p.append(f"warmupSteps={s.warmup_steps!r} must be an integer >= 0")
    if s.decay not in DECAYS:
        p.append(f"decay={s.decay!r} is not one of {', '.join(DECAYS)}")
    if not isinstance(s.decay_steps, int) or s.decay_steps < 0:
        p.append(f"decaySteps={s.decay_steps!r} must be an integer >= 0 (0: the job's steps)")
    elif s.decay_steps and isinstance(s.warmup_steps, int) and s.decay_steps <= s.warmup_steps:
        p.append(f"decaySteps={s.decay_steps} must exceed warmupSteps={s.warmup_steps}")
    if not isinstance(s.min_lr, (int, float)) or s.min_lr < 0:
        p.append(f"minLearningRate={s.min_lr!r} must be a number >= 0")
    return p

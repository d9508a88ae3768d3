"""What the running job measures of its own steps, against what the cost model predicted.

The solver picks layouts from an analytical cost model (:mod:`.costmodel`) and a device
profile; nothing told it how far off it was on this job and this machine. Every worker's step
record now carries its split of the step (``StepRecord``: compute, communication wait,
redundancy wait, summing to the step's time), and this module turns those into figures the
controller logs, exports and keeps in the run's report:

- :class:`StepCosts`: per device, an exponentially smoothed mean of the step and of each part
  of its split, over the running generation's steps (its first step is left out: it pays the
  new generation's warm-up, allocations and lazily built communicators);
- :meth:`StepCosts.stage_compute`: a pipeline stage's compute is that of its slowest device
  (the stage's other ranks wait for it in their collectives), so uneven stages show as
  unequal figures here, and their ratio to the mean as :attr:`Measurement.imbalance`;
- :meth:`StepCosts.add_experts`: an MoE job's tokens per expert, summed over the generation's
  steps and its data-parallel ranks, so :attr:`Measurement.expert_skew` (the busiest expert
  over the mean) and :attr:`Measurement.ep_imbalance` (the busiest expert-parallel rank's
  experts over the mean rank's: the rank the others wait for in the token exchange) show
  routing that a uniform cost model cannot see;
- :func:`measure`: the smoothed step time of the job (its slowest device) over the cost
  model's prediction for the running layout, the calibration ratio a planner would scale its
  estimates by.

Pure values and arithmetic: no clock, no process, no torch (a contract checks it), so the
figures are pinned by hand-computed cases (``tests/controller/test_measured.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynatrain.vps.layout import Layout

GiB = 1 << 30

SMOOTHING = 0.3
"""Weight of the newest step in the smoothed means (about the last 3 steps count most)."""

WARMUP_STEPS = 1
"""Steps of each generation left out of the means (the first pays the generation's set-up)."""

MIN_STEPS = 3
"""Steps every device of the layout must have reported before a :class:`Measurement` is made."""

PARTS = ("step", "compute", "communication", "redundancy", "forward", "backward", "memory")
"""Seconds, each part of the step (forward and backward are parts of compute), and the
device's memory in bytes."""


@dataclass
class DeviceCost:
    """One device's smoothed step split in the running generation (seconds)."""

    steps: int = 0
    """Steps counted (after the warm-up)."""
    seen: int = 0
    """Steps reported, the warm-up included."""
    means: dict[str, float] = field(default_factory=dict)

    def add(self, values: dict[str, float], alpha: float) -> None:
        self.seen += 1
        if self.seen <= WARMUP_STEPS:
            return
        self.steps += 1
        for part, value in values.items():
            was = self.means.get(part)
            self.means[part] = value if was is None else (1 - alpha) * was + alpha * value


@dataclass(frozen=True)
class Measurement:
    """The running layout's measured step against the cost model's prediction."""

    generation: int
    layout: str
    steps: int
    """The fewest steps any device of the layout had counted."""
    step_seconds: float
    """The job's smoothed step time: its slowest device's."""
    predicted_seconds: float
    """The cost model's step time for the layout on the job's device profile (0: none)."""
    stage_compute: tuple[float, ...]
    """Each pipeline stage's smoothed compute seconds per step (its slowest device's)."""
    communication_seconds: float
    """The slowest device's smoothed wait in collectives and pipeline exchanges."""
    stage_expert_tokens: tuple[tuple[int, ...], ...] = ()
    """MoE: tokens routed to each expert over the generation, per pipeline stage (its layers,
    every data-parallel rank); () for a dense model."""
    ep: int = 1
    """The layout's expert-parallel degree (rank ``r`` holds experts ``[r*E/ep, (r+1)*E/ep)``)."""
    device_compute: tuple[tuple[int, int, float], ...] = ()
    """(device, pipeline stage, smoothed compute seconds per step) of every device of the
    layout, in rank order: who within a stage is the slow one (:mod:`.straggler`)."""
    stage_forward: tuple[float, ...] = ()
    stage_backward: tuple[float, ...] = ()
    """Each pipeline stage's forward and backward compute seconds per step, both of the
    device its :attr:`stage_compute` is (so they are parts of it); () when the workers did
    not report them."""
    memory_bytes: int = 0
    """The device with the most memory at its steps (0: not reported)."""
    predicted_memory_bytes: int = 0
    """The cost model's peak memory per device for the layout (0: none)."""

    @property
    def ratio(self) -> float:
        """Measured over predicted step time (1.0: the model is right; 0 without a prediction)."""
        return self.step_seconds / self.predicted_seconds if self.predicted_seconds > 0 else 0.0

    @property
    def imbalance(self) -> float:
        """The slowest stage's compute over the mean stage's (1.0: even stages)."""
        mean = sum(self.stage_compute) / len(self.stage_compute)
        return max(self.stage_compute) / mean if mean > 0 else 1.0

    @property
    def expert_tokens(self) -> tuple[int, ...]:
        """MoE: tokens routed to each expert over the generation (every stage)."""
        return tuple(map(sum, zip(*self.stage_expert_tokens)))

    @property
    def expert_skew(self) -> float:
        """The busiest expert's tokens over the mean expert's (1.0: even routing, or dense)."""
        t = self.expert_tokens
        return max(t) * len(t) / sum(t) if t and sum(t) else 1.0

    @property
    def ep_imbalance(self) -> float:
        """The busiest expert-parallel rank's tokens over the mean rank's (1.0 with ep=1),
        over all stages."""
        return _ep_imbalance(self.expert_tokens, self.ep)

    @property
    def stage_ep_imbalance(self) -> tuple[float, ...]:
        """:attr:`ep_imbalance` of each pipeline stage's own layers: the stage whose busiest
        EP rank carries the most is the one its routing slows."""
        return tuple(_ep_imbalance(t, self.ep) for t in self.stage_expert_tokens)

    def summary(self) -> dict:
        experts = {"expert_tokens": list(self.expert_tokens),
                   "expert_skew": round(self.expert_skew, 4),
                   "ep_imbalance": round(self.ep_imbalance, 4),
                   "stage_ep_imbalance": [round(x, 4) for x in self.stage_ep_imbalance]
                   } if self.stage_expert_tokens else {}
        return {**experts,
                "generation": self.generation, "layout": self.layout, "steps": self.steps,
                "step_seconds": round(self.step_seconds, 6),
                "predicted_seconds": round(self.predicted_seconds, 6),
                "ratio": round(self.ratio, 4),
                "stage_compute_seconds": [round(s, 6) for s in self.stage_compute],
                "imbalance": round(self.imbalance, 4),
                "communication_seconds": round(self.communication_seconds, 6),
                "stage_forward_seconds": [round(s, 6) for s in self.stage_forward],
                "stage_backward_seconds": [round(s, 6) for s in self.stage_backward],
                "memory_bytes": self.memory_bytes,
                "predicted_memory_bytes": self.predicted_memory_bytes}

    def __str__(self) -> str:
        predicted = (f" vs {self.predicted_seconds:.3f} s predicted (x{self.ratio:.2f})"
                     if self.predicted_seconds > 0 else "")
        stages = "/".join(f"{s:.3f}" for s in self.stage_compute)
        return (f"measured {self.layout}: step {self.step_seconds:.3f} s{predicted}; "
                f"stage compute {stages} s (imbalance {self.imbalance:.2f}"
                + (", forward/backward " + "/".join(f"{f:.3f}+{b:.3f}" for f, b in zip(
                    self.stage_forward, self.stage_backward)) if any(self.stage_forward) else "")
                + f"), communication {self.communication_seconds:.3f} s"
                + (f", memory {self.memory_bytes / GiB:.2f} GiB" + (
                    f" vs {self.predicted_memory_bytes / GiB:.2f} predicted"
                    if self.predicted_memory_bytes else "") if self.memory_bytes else "")
                + f", over {self.steps} steps"
                + (f"; experts' tokens max/mean {self.expert_skew:.2f}, over the {self.ep} EP "
                   f"ranks {self.ep_imbalance:.2f}" + (
                       " (by stage " + "/".join(f"{x:.2f}" for x in self.stage_ep_imbalance)
                       + ")" if len(self.stage_expert_tokens) > 1 else "")
                   if self.stage_expert_tokens else ""))


def _ep_imbalance(tokens: tuple[int, ...], ep: int) -> float:
    """The busiest of ``ep`` ranks over the mean, rank ``r`` holding experts
    ``[r*E/ep, (r+1)*E/ep)`` (1.0 for ep=1, no tokens, or experts ep does not divide)."""
    if ep < 2 or not tokens or not sum(tokens) or len(tokens) % ep:
        return 1.0
    per = len(tokens) // ep
    ranks = [sum(tokens[r * per:(r + 1) * per]) for r in range(ep)]
    return max(ranks) * ep / sum(ranks)


class StepCosts:
    """The smoothed step split of each device of one generation (see the module docstring)."""

    def __init__(self, alpha: float = SMOOTHING):
        if not 0 < alpha <= 1:
            raise ValueError(f"smoothing weight alpha={alpha!r} must be in (0, 1]")
        self.alpha = alpha
        self.generation = 0
        self.devices: dict[int, DeviceCost] = {}
        self.expert_tokens: dict[int, list[int]] = {}
        """Device -> its tokens per expert summed over the generation's step records (MoE)."""

    def add(self, device: int, generation: int, values: dict[str, float]) -> None:
        """One step record of ``device`` in ``generation`` (``values``: seconds per part of
        :data:`PARTS`). A newer generation starts the means again (another layout's steps
        cost something else); a record of an older one is ignored."""
        if generation < self.generation:
            return
        if generation > self.generation:
            self.generation, self.devices, self.expert_tokens = generation, {}, {}
        unknown = set(values) - set(PARTS)
        if unknown:
            raise ValueError(f"step parts {sorted(unknown)} are not among {PARTS}")
        self.devices.setdefault(device, DeviceCost()).add(values, self.alpha)

    def add_experts(self, device: int, generation: int, tokens) -> None:
        """One step record's tokens per expert (MoE; sent by TP index 0 of each data-parallel
        rank and stage), added to ``device``'s sums. A record of another generation than the
        one :meth:`add` last saw is ignored."""
        if generation != self.generation or not tokens:
            return
        known = next(iter(self.expert_tokens.values()), None)
        if known is not None and len(tokens) != len(known):
            raise ValueError(f"{len(tokens)} experts reported, {len(known)} before in the "
                             "same generation")
        was = self.expert_tokens.get(device) or [0] * len(tokens)
        self.expert_tokens[device] = [a + int(b) for a, b in zip(was, tokens)]

    def stage_experts(self, layout: Layout) -> tuple[tuple[int, ...], ...]:
        """Each pipeline stage's tokens per expert: the sums of its devices (() if none
        reported any: a dense model)."""
        if not self.expert_tokens:
            return ()
        width = len(next(iter(self.expert_tokens.values())))
        stages = [[0] * width for _ in range(layout.pp)]
        for rank, device in enumerate(layout.device_of):
            for e, n in enumerate(self.expert_tokens.get(device, ())):
                stages[layout.coords(rank)[0]][e] += n
        return tuple(map(tuple, stages))

    def steps(self, layout: Layout) -> int:
        """The fewest steps counted by any device of ``layout`` (0 if one has none)."""
        return min((self.devices[d].steps if d in self.devices else 0)
                   for d in layout.device_of)

    def _slowest(self, devices, part: str) -> float:
        return max(self.devices[d].means.get(part, 0.0) for d in devices)

    def _stages(self, layout: Layout) -> list[list[int]]:
        by_stage: list[list[int]] = [[] for _ in range(layout.pp)]
        for rank, device in enumerate(layout.device_of):
            by_stage[layout.coords(rank)[0]].append(device)
        return by_stage

    def _slowest_in_compute(self, layout: Layout) -> list[DeviceCost]:
        """Each pipeline stage's slowest device in compute: the one the stage waits for."""
        return [max((self.devices[d] for d in devices),
                    key=lambda c: c.means.get("compute", 0.0))
                for devices in self._stages(layout)]

    def stage_compute(self, layout: Layout) -> tuple[float, ...]:
        """Each pipeline stage's compute: the slowest of its devices (after :meth:`steps`)."""
        return self.stage_part(layout, "compute")

    def stage_part(self, layout: Layout, part: str) -> tuple[float, ...]:
        """Each pipeline stage's ``part`` of compute (forward, backward) as measured on the
        device its compute is taken from, the slowest. Not the slowest device per part: with
        uneven work in a stage (a straggler's smaller share) one device can have the longest
        forward and another the longest backward, and the two maxima would add up to more
        than any device's compute."""
        return tuple(c.means.get(part, 0.0) for c in self._slowest_in_compute(layout))

    def measurement(self, layout: Layout, predicted_seconds: float,
                    min_steps: int = MIN_STEPS, predicted_memory: int = 0
                    ) -> Measurement | None:
        """The figures of ``layout`` once every device of it has counted ``min_steps``."""
        steps = self.steps(layout)
        if steps < min_steps:
            return None
        devices = layout.device_of
        return Measurement(self.generation, layout.to_text(), steps,
                           self._slowest(devices, "step"), predicted_seconds,
                           self.stage_compute(layout), self._slowest(devices, "communication"),
                           self.stage_experts(layout), layout.ep,
                           tuple((d, layout.coords(rank)[0],
                                  self.devices[d].means.get("compute", 0.0))
                                 for rank, d in enumerate(devices)),
                           self.stage_part(layout, "forward"),
                           self.stage_part(layout, "backward"),
                           int(self._slowest(devices, "memory")), predicted_memory)

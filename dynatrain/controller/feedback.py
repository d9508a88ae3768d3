"""The running job's measurements fed back to the cost model (#38 item 1).

The solver prices layouts on a device profile (a preset, or this machine probed); the running
job measures how far off that is (:mod:`.measured`). A single ratio of measured over predicted
step time would change no choice: every candidate layout would be scaled alike. What does
change choices is *which part* the model gets wrong. So the measured step is split as the
workers report it, and set against the prediction's own split:

- **compute**: the busiest pipeline stage's compute, each stage taken at the *median* of its
  devices (a straggler is one device's problem, :mod:`.straggler`'s, not the profile's),
  against the prediction's ``compute + optimizer``;
- **waits**: what is left of the measured step, ``step - the slowest device's compute`` (the
  time that device, which waits for no one, spends in collectives and pipeline exchanges),
  against the prediction's communication and bubble terms;
- **memory**: the device with the most memory at its steps (a GPU's peak allocated, a CPU
  worker's resident memory) against the predicted peak per device.

Each ratio is a property of the devices or of their links, not of the layout, so it carries
over to the layouts the job has not run: :func:`calibrated` scales the profile's compute rates
by the first and its link bandwidths and latencies by the second, and, where the job needs
more memory than predicted, shrinks the memory a layout may fill by the third (never grows
it: a model that overestimates is only safe); the solver then prices every candidate with
the job's own figures. A measurement more than 30x off is not used: the profile then
describes other devices (:data:`BOUNDS`). :class:`Feedback` keeps the ratios of the last
few generations (their geometric mean, so one layout's noise does not swing the choice),
rounded to 5% steps (a decision changes only when the figures do), and the step time each
layout shape measured, so that a layout the job ran and measured slower is not chosen again
as "better" (:meth:`~.policy.Policy.decide`: measured beats modelled, and two layouts cannot
take turns).

Used for the decisions when ``spec.parallelism.rebalance`` is on (the measured decisions);
the measured/predicted ratio in the log and the metrics stays against the uncalibrated profile.
Pure: no torch, grpc or kubernetes (the decisions' import contract).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from dynatrain.spec.hardware import DeviceProfile

from .costmodel import Estimate
from .measured import Measurement

COMPUTE_PARTS = ("compute", "optimizer")
"""Parts of :attr:`.costmodel.Estimate.breakdown` a device spends computing."""
WAIT_PARTS = ("bubble", "tp_comm", "ep_comm", "pp_comm", "dp_comm", "zero_comm", "other")
"""Parts it spends waiting: in collectives, exchanges, and the pipeline's fill and drain."""
BOUNDS = (1 / 30, 30.0)
"""A measurement whose compute or waits ratio is outside these is not used: a prediction that
far off says the profile describes other devices (CPU workers priced as H100s), not how fast
these are, and scaling it would distort the trade-off between compute and communication (one
ratio clamped, the other not). A memory ratio outside them is left out alone."""
QUANTUM = 0.05
"""Ratios are rounded to steps of 5% (on a log scale)."""
GENERATIONS = 3
"""How many generations' ratios are averaged."""


@dataclass(frozen=True)
class Factors:
    """Measured over predicted, per part of the step (1.0: the profile is right)."""

    compute: float = 1.0
    waits: float = 1.0
    memory: float = 1.0

    def __str__(self) -> str:
        return (f"compute x{self.compute:.2f}, waits x{self.waits:.2f}, "
                f"memory x{self.memory:.2f}")


def _inside(ratio: float) -> bool:
    return BOUNDS[0] <= ratio <= BOUNDS[1]


def _rounded(ratio: float) -> float:
    step = math.log1p(QUANTUM)
    return round(math.exp(round(math.log(ratio) / step) * step), 4)


def factors(m: Measurement, predicted: Estimate) -> Factors | None:
    """The ratios of one measurement against the prediction for its layout (None when the
    prediction has no such part, nothing was measured, or the profile is not these devices:
    :data:`BOUNDS`)."""
    if not m.device_compute:
        return None
    by_stage: dict[int, list[float]] = {}
    for _, stage, seconds in m.device_compute:
        by_stage.setdefault(stage, []).append(seconds)
    compute = max(statistics.median(v) for v in by_stage.values())
    waits = max(0.0, m.step_seconds - max(s for _, _, s in m.device_compute))
    p_compute = sum(predicted.breakdown.get(k, 0.0) for k in COMPUTE_PARTS)
    p_waits = sum(predicted.breakdown.get(k, 0.0) for k in WAIT_PARTS)
    if p_compute <= 0 or compute <= 0:
        return None
    # A layout with (next to) nothing to wait for says nothing about the links.
    waits_ratio = waits / p_waits if p_waits > 1e-3 * p_compute and waits > 0 else 1.0
    memory_ratio = (m.memory_bytes / predicted.memory_bytes
                    if m.memory_bytes and predicted.memory_bytes else 1.0)
    if not (_inside(compute / p_compute) and _inside(waits_ratio)):
        return None
    return Factors(_rounded(compute / p_compute), _rounded(waits_ratio),
                   _rounded(memory_ratio) if _inside(memory_ratio) else 1.0)


def calibrated(profile: DeviceProfile, f: Factors) -> DeviceProfile:
    """``profile`` with its compute ``f.compute`` times slower and its links ``f.waits`` times
    slower (bandwidths divided, latencies multiplied), so that an estimate on it scales each
    compute term by ``f.compute`` and each communication term by ``f.waits``; and its memory
    divided by ``f.memory`` where that is over 1 (a layout fits only with the room the job
    was measured to need over the prediction)."""
    if f == Factors():
        return profile
    c, w = f.compute, f.waits
    return replace(
        profile,
        name=f"{profile.name} (measured: {f})",
        flops_per_second=profile.flops_per_second / c,
        fp32_flops_per_second=profile.fp32_flops_per_second / c,
        attention_flops_per_second=profile.attention_flops_per_second / c,
        memory_bytes_per_second=profile.memory_bytes_per_second / c,
        elementwise_bytes_per_second=profile.elementwise_bytes_per_second / c,
        op_seconds=profile.op_seconds * c,
        intra_node_bytes_per_second=profile.intra_node_bytes_per_second / w,
        inter_node_bytes_per_second=profile.inter_node_bytes_per_second / w,
        latency_seconds=profile.latency_seconds * w,
        group_latency_seconds=tuple((n, s * w) for n, s in profile.group_latency_seconds),
        memory_bytes=int(profile.memory_bytes / max(1.0, f.memory)))


@dataclass
class Feedback:
    """The job's measured ratios over its last generations, and each layout shape's measured
    step time (see the module docstring)."""

    by_generation: dict[int, Factors] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)
    """Layout shape (canonical text) -> the step seconds it measured last."""

    def add(self, generation: int, m: Measurement, predicted: Estimate | None) -> None:
        """The running generation's newest measurement (it replaces that generation's last)."""
        self.steps[m.layout] = m.step_seconds
        f = factors(m, predicted) if predicted is not None else None
        if f is not None:
            self.by_generation[generation] = f
            for old in sorted(self.by_generation)[:-GENERATIONS]:
                del self.by_generation[old]

    @property
    def factors(self) -> Factors:
        """The geometric mean of the kept generations' ratios, rounded (1.0 with none)."""
        if not self.by_generation:
            return Factors()
        kept = list(self.by_generation.values())
        return Factors(*(_rounded(math.exp(statistics.fmean(math.log(getattr(f, part))
                                                              for f in kept)))
                         for part in ("compute", "waits", "memory")))


def describe(fb: Feedback, generation: int) -> str:
    """The log line of ``generation``'s first measurement: the factors the decisions now use."""
    if generation not in fb.by_generation:
        return (f"not calibrated: generation {generation} measured over {BOUNDS[1]:g}x off the "
                f"cost model's compute or waits (the profile describes other devices); the "
                f"decisions use {fb.factors}")
    return (f"calibrated: {fb.factors} the cost model's figures, measured over "
            f"{len(fb.by_generation)} generation(s); the solver prices layouts with them")

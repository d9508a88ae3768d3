"""A device measured persistently slower than its peers is left out, live, when the job is
faster without it (#38 item 3; reason ``rebalance``, under ``spec.parallelism.rebalance``).

Every device of a stage computes the same work (the data-parallel and tensor-parallel ranks
of one pipeline stage), so the one whose smoothed compute is well above the median of its
stage's others is slow by itself: a throttled GPU, a noisy neighbour, a bad host. Everyone
waits for it at the next collective, so it adds ``its compute - the median`` to the step.

Whether leaving it out pays is the measured step priced on fewer devices: the step it would
take if the slow device were as fast as its peers, times what the cost model says the best
layout on the others costs relative to the running one (the model's relative change,
calibrated by the measurement). The device is left out when that is at least 5% faster than
the measured step and pays the switch's cost back within ``paybackSteps``. A pipeline stage
split cannot cure a slow data-parallel rank (its stage's other ranks are fast), and uneven
micro-batch shares are not built; this is the rule for the case where no split helps.

The front ends drop the device (:attr:`~dynatrain.controller.core.JobController.slow`): the
local runner stops its worker, the operator deletes its pod, so the scheduler may place a
new one on a healthy node, which then joins as new capacity.

Pure: no torch, grpc or kubernetes (the decisions' import contract).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from dynatrain.spec.hardware import DeviceProfile
from dynatrain.spec.job import JobSpec

from .costmodel import SolverError, estimate
from .measured import Measurement
from .policy import Decision, Policy, estimate_kwargs

MIN_SAVING = 0.05
"""The least share of the measured step that leaving a device out must save."""


@dataclass(frozen=True)
class Slow:
    """The slowest device of its stage, against the median of the stage's other devices."""

    device: int
    stage: int
    compute: float
    peers: float
    """The median compute of the stage's other devices."""

    @property
    def factor(self) -> float:
        return self.compute / self.peers if self.peers > 0 else 1.0

    def __str__(self) -> str:
        return (f"device {self.device} computes {self.factor:.2f}x the median of its stage's "
                f"other devices ({self.compute * 1e3:.1f} vs {self.peers * 1e3:.1f} ms a step)")


def slowest(m: Measurement) -> Slow | None:
    """The device that stands out most from the others of its stage (None: no stage has two
    devices, or none was measured)."""
    by_stage: dict[int, list[tuple[int, float]]] = {}
    for device, stage, compute in m.device_compute:
        by_stage.setdefault(stage, []).append((device, compute))
    found = None
    for stage, devices in sorted(by_stage.items()):
        if len(devices) < 2:
            continue
        device, compute = max(devices, key=lambda dc: (dc[1], -dc[0]))
        peers = statistics.median(c for d, c in devices if d != device)
        slow = Slow(device, stage, compute, peers)
        if found is None or slow.factor > found.factor:
            found = slow
    return found


def leave_out(v, job: JobSpec, policy: Policy, profile: DeviceProfile) -> Decision | None:
    """The switch that leaves the slow device out (the best layout on the other usable
    devices), when ``spec.parallelism.rebalance`` is on and it pays; ``v`` is the decision's
    :class:`~dynatrain.controller.decide.View`."""
    reb, m, lay = job.rebalance, v.measurement, v.layout
    if not reb.enabled or job.mode != "auto" or lay is None or m is None:
        return None
    if m.layout != lay.to_text() or lay.world < 2:
        return None
    slow = slowest(m)
    if slow is None or slow.factor < reb.threshold:
        return None
    if job.training.steps - v.step < max(policy.min_steps_left, 1):
        return None
    if v.now - policy.last_voluntary < policy.cooldown_s:
        return None
    others = [d for d in v.usable if d != slow.device and d not in v.doomed]
    if len(others) < max(1, job.min_workers):
        return None
    kw = estimate_kwargs(job)
    try:
        best = policy.best_on(job, profile, len(others), kw)
        now = estimate(job.model, replace(lay, stages=None), profile, **kw)
    except SolverError:
        return None
    healthy = m.step_seconds - (slow.compute - slow.peers)
    without = max(healthy, 0.0) * best.step_seconds / now.step_seconds
    saving = m.step_seconds - without
    if saving < MIN_SAVING * m.step_seconds or saving * reb.payback_steps < v.switch_cost_s:
        return None
    decision = policy.shrink(job, lay, others, best, "rebalance")
    decision.left_out = (slow.device,)
    decision.note = (f"{slow}: left out; the step measured {m.step_seconds * 1e3:.1f} ms, "
                     f"{without * 1e3:.1f} ms estimated on {best.layout.world} devices "
                     f"({best.layout.to_text()}) without it")
    return decision

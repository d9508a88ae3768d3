"""A device measured persistently slower than its peers is left out, live, when the job is
faster without it (#38 item 3; reason ``rebalance``, under ``spec.parallelism.rebalance``).

Every device of a stage computes the same work (the data-parallel and tensor-parallel ranks
of one pipeline stage), so the one whose smoothed compute is well above the median of its
stage's others is slow by itself: a throttled GPU, a noisy neighbour, a bad host. Everyone
waits for it at the next collective, so it adds ``its compute - the median`` to the step.

Whether leaving it out pays is read from the measurement alone: without it, the ``n - 1``
other devices of its stage share its work, so the step loses the slow device's compute and
gains its peers' times ``n / (n - 1)``. That is a leave-out only when the device is slower
than ``n / (n - 1)`` of its peers (2x with two, 1.33x with four), and the estimate must be at
least 5% under the measured step and pay the switch's cost back within ``paybackSteps``. (The
cost model is not asked: where its profile does not describe the devices, as with CPU workers
priced as H100s, its relative change says nothing; the solver still picks the layout.) A pipeline stage
split cannot cure a slow data-parallel rank (its stage's other ranks are fast), and uneven
micro-batch shares are not built; this is the rule for the case where no split helps.

The front ends drop the device (:attr:`~dynatrain.controller.core.JobController.slow`): the
local runner stops its worker, the operator deletes its pod, so the scheduler may place a
new one on a healthy node, which then joins as new capacity.

Pure: no torch, grpc or kubernetes (the decisions' import contract).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from dynatrain.spec.hardware import DeviceProfile
from dynatrain.spec.job import JobSpec

from .costmodel import SolverError
from .measured import Measurement
from .routing import MIN_SKEW
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
    devices, or none was measured). A stage whose MoE routing is skewed is not judged: its
    expert-parallel ranks are meant to compute unlike amounts (:mod:`.routing` prices that)."""
    by_stage: dict[int, list[tuple[int, float]]] = {}
    for device, stage, compute in m.device_compute:
        by_stage.setdefault(stage, []).append((device, compute))
    skew = m.stage_ep_imbalance
    found = None
    for stage, devices in sorted(by_stage.items()):
        if len(devices) < 2:
            continue
        if stage < len(skew) and skew[stage] >= MIN_SKEW:
            continue          # its EP ranks compute unlike shares of tokens: not a straggler
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
    try:
        best = policy.best_on(job, profile, len(others), estimate_kwargs(job))
    except SolverError:
        return None
    n = sum(1 for _, stage, _ in m.device_compute if stage == slow.stage)
    without = m.step_seconds - slow.compute + slow.peers * n / (n - 1)
    saving = m.step_seconds - without
    if saving < MIN_SAVING * m.step_seconds or saving * reb.payback_steps < v.switch_cost_s:
        return None
    decision = policy.shrink(job, lay, others, best, "rebalance")
    decision.left_out = (slow.device,)
    decision.note = (f"{slow}: left out; the step measured {m.step_seconds * 1e3:.1f} ms, "
                     f"{without * 1e3:.1f} ms estimated with its {n - 1} peers taking its "
                     f"share; now {best.layout.to_text()}")
    return decision

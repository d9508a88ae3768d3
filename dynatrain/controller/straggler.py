"""A device measured persistently slower than its peers gets fewer micro-batches, or is left
out, live, whichever makes the job faster (#38 item 3; reason ``rebalance``, under
``spec.parallelism.rebalance``).

Every device of a stage computes the same work per micro-batch (the data-parallel and
tensor-parallel ranks of one pipeline stage), so the one whose smoothed compute is well above
the median of its stage's others is slow by itself: a throttled GPU, a noisy neighbour, a bad
host. Everyone waits for it at the next collective, so it sets the step.

Two cures are priced from the measurement alone (the cost model is not asked: where its
profile does not describe the devices, as with CPU workers priced as H100s, its relative
change says nothing):

- **Fewer micro-batches** (:func:`shares_for`): each data-parallel rank ``j`` (its pipeline:
  every device with that DP index) computes ``r_j`` seconds per micro-batch, measured as its
  slowest device's compute over its share. The step's micro-batches are dealt out so that the
  slowest rank finishes first: one at a time, each to the rank that would then finish
  soonest, which minimises ``max r_j * share_j``. The global batch and the gradient's scale
  do not change (:mod:`dynatrain.vps.layout`: shares), so the training is the same, up to
  the order in which the DP ranks' gradients are summed. Needs ``ep=1``; off with
  ``spec.parallelism.rebalance.shares: false``, for a job that must train bit-identically to
  a run without rebalancing.
- **Left out**: the ``n - 1`` other devices of its stage share its work, so the step loses the
  slow device's compute and gains its peers' times ``n / (n - 1)`` (per micro-batch, where
  the shares are uneven). The device must be slower than ``n / (n - 1)`` of its peers (2x with
  two, 1.33x with four) for this to help at all; the front ends then drop it
  (:attr:`~dynatrain.controller.core.JobController.slow`): the local runner stops its worker,
  the operator deletes its pod, so the scheduler may place a new one on a healthy node, which
  then joins as new capacity.

The faster of the two is taken when it is at least 5% under the measured step and pays the
switch's cost back within ``paybackSteps``. A stage split (:func:`.decide.rebalance`) cannot
cure a slow data-parallel rank (its stage's other ranks are fast); these are the rules for
that case. A reshared layout is measured afresh: its slow device then computes about what its
peers do, so nothing stands out and nothing more is done until the devices change.

Pure: no torch, grpc or kubernetes (the decisions' import contract).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from dynatrain.vps.layout import Layout, LayoutError, micro_batch_shares
from dynatrain.spec.hardware import DeviceProfile
from dynatrain.spec.job import JobSpec

from .costmodel import SolverError, estimate
from .measured import Measurement
from .routing import MIN_SKEW
from .policy import Decision, Policy, estimate_kwargs

MIN_SAVING = 0.05
"""The least share of the measured step that a cure must save."""
TIE = 0.01
"""Estimates this close (relative) are a tie, which leaving the device out wins."""


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


def shares_for(rates: list[float], total: int) -> tuple[int, ...]:
    """Micro-batches per data-parallel rank, ``total`` in all and at least one each, that
    minimise the slowest rank's time ``rates[j] * share[j]`` (``rates``: seconds per
    micro-batch). Dealt one at a time to the rank that would finish soonest with it, which is
    optimal for this min-max (each choice keeps the running maximum as low as it can be); a
    tie goes to the lower rank, so the result is deterministic."""
    if total < len(rates):
        raise ValueError(f"{total} micro-batches cannot give each of {len(rates)} "
                         "data-parallel ranks one")
    shares = [1] * len(rates)
    for _ in range(total - len(rates)):
        j = min(range(len(rates)), key=lambda k: (rates[k] * (shares[k] + 1), k))
        shares[j] += 1
    return tuple(shares)


@dataclass(frozen=True)
class Reshare:
    """New micro-batch shares for the running layout, and the step they are estimated at."""

    layout: Layout
    seconds: float
    rates: tuple[float, ...]
    """Measured seconds per micro-batch of each data-parallel rank (its slowest device)."""

    def __str__(self) -> str:
        rates = "/".join(f"{r * 1e3:.1f}" for r in self.rates)
        return (f"shares {'+'.join(map(str, self.layout.shares or ()))} of the micro-batches "
                f"(measured {rates} ms per micro-batch by data-parallel rank)")


def reshare(m: Measurement, lay: Layout, job: JobSpec) -> Reshare | None:
    """The running layout with its micro-batches dealt by the DP ranks' measured speeds
    (:func:`shares_for`), and the step that is estimated at: the measured step less the
    slowest rank's compute plus the new slowest's. None where shares cannot apply (ep > 1,
    dp = 1) or they would not change."""
    if lay.ep != 1 or lay.dp < 2:
        return None
    try:
        shares = micro_batch_shares(lay, job.global_batch_size, job.training.micro_batch_size)
    except LayoutError:
        return None
    compute = [0.0] * lay.dp
    for rank, (_, _, seconds) in enumerate(m.device_compute):
        j = lay.coords(rank)[1]
        compute[j] = max(compute[j], seconds)
    if min(compute) <= 0:
        return None
    rates = [c / s for c, s in zip(compute, shares)]
    new = shares_for(rates, sum(shares))
    if new == shares:
        return None
    seconds = m.step_seconds - max(compute) + max(r * s for r, s in zip(rates, new))
    return Reshare(replace(lay, shares=new), seconds, tuple(rates))


def relieve(v, job: JobSpec, policy: Policy, profile: DeviceProfile) -> Decision | None:
    """The switch that relieves the job of its slowest device, when
    ``spec.parallelism.rebalance`` is on and one pays (see the module docstring): fewer
    micro-batches for it, or the best layout on the other usable devices, whichever is
    estimated faster. ``v`` is the decision's :class:`~dynatrain.controller.decide.View`."""
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
    options = []                                 # (estimated step, its rank, decision)
    fewer = reshare(m, lay, job) if reb.shares else None
    priced = fewer and estimate(job.model, fewer.layout, profile, **estimate_kwargs(job))
    if fewer is not None and priced.fits:     # more micro-batches hold more activations
        options.append((fewer.seconds, fewer.seconds, Decision(
            fewer.layout, "rebalance", priced,
            note=(f"{slow}: {fewer}; the step measured {m.step_seconds * 1e3:.1f} ms, "
                  f"{fewer.seconds * 1e3:.1f} ms estimated with them"))))
    out = leave_out(v, job, policy, profile, slow)
    if out is not None:
        # Within TIE of each other the device goes: the job is as fast and a device is given
        # back (on a cluster, a new pod on a healthy node then joins as capacity).
        decision, seconds = out
        options.append((seconds, seconds / (1 + TIE), decision))
    if not options:
        return None
    seconds, _, decision = min(options, key=lambda o: o[1])
    saving = m.step_seconds - seconds
    if saving < MIN_SAVING * m.step_seconds or saving * reb.payback_steps < v.switch_cost_s:
        return None
    return decision


def leave_out(v, job: JobSpec, policy: Policy, profile: DeviceProfile,
              slow: Slow) -> tuple[Decision, float] | None:
    """The switch that leaves ``slow`` out (the best layout on the other usable devices) and
    the step it is estimated at, or None where the others cannot run the job."""
    m, lay = v.measurement, v.layout
    others = [d for d in v.usable if d != slow.device and d not in v.doomed]
    if len(others) < max(1, job.min_workers):
        return None
    try:
        best = policy.best_on(job, profile, len(others), estimate_kwargs(job))
    except SolverError:
        return None
    n = sum(1 for _, stage, _ in m.device_compute if stage == slow.stage)
    # Its peers take its micro-batches: per micro-batch, a peer computes its own time over
    # its share (the same figure for every rank when the shares are even). Where the best
    # layout cannot use every other device (dp=3 does not split a batch of 8), the devices it
    # does use take the idle ones' work too.
    unused = len(others) / best.layout.world
    without = m.step_seconds - slow.compute + peer_rate(m, lay, slow) * n / (n - 1) * unused
    decision = policy.shrink(job, lay, others, best, "rebalance")
    decision.left_out = (slow.device,)
    decision.note = (f"{slow}: left out; the step measured {m.step_seconds * 1e3:.1f} ms, "
                     f"{without * 1e3:.1f} ms estimated with its {n - 1} peers taking its "
                     f"share{'' if unused == 1 else f' on {best.layout.world} devices'}; "
                     f"now {best.layout.to_text()}")
    return decision, without


def peer_rate(m: Measurement, lay: Layout, slow: Slow) -> float:
    """The median compute of ``slow``'s stage peers, as if each had an even share of the
    step's micro-batches (their measured compute when the shares are even)."""
    if lay.shares is None:
        return slow.peers
    total = sum(lay.shares)
    even = total / lay.dp
    return statistics.median(
        seconds / lay.shares[lay.coords(rank)[1]] * even
        for rank, (device, stage, seconds) in enumerate(m.device_compute)
        if stage == slow.stage and device != slow.device)

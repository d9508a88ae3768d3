"""The controller's decisions, as pure functions of what it knows.

:class:`~.core.JobController` executes (it calls agents, runs switches, keeps the record); the
rules that say *what* to do live here, each a function of frozen values with no clock, no
network and no process of its own:

- :func:`next_action`: at a tick, what the job does now: nothing, give up, recover from a
  failure, or switch to the layout the :class:`~.policy.Policy` chose, and what to answer a
  user's pending layout request;
- :func:`superseded`: while a Prepare is in flight, whether a newer signal made its target
  wrong (it is then aborted and decided again);
- :func:`after_status_error`, :func:`stopped_answering`: the watchdog's rules for a Status
  or health call that failed (the second one also inside a switch's Commit, in the
  orchestrator);
- :func:`hung`: members that answer Status but hold the others up;
- :func:`acts_on_notice`: whether a preemption notice (the cluster's, or a worker's SIGTERM)
  becomes a live switch, by ``spec.preemptionPolicy`` (the operator and the controller ask);
- :func:`exit_is_failure`: whether a worker that exited, or whose pod is gone, failed (the
  local runner and the operator ask);
- :func:`choose_restore`, :func:`previous_restore`: where a recovery restores from (which
  step, which mirrors; the running generation, or the one before it);
- :func:`rebalance` (with :func:`.mixed.balanced_stages`): when the measured pipeline stages
  are uneven (:mod:`.measured`; an MoE stage by its measured routing, :mod:`.routing`), move
  layers between them, live (reason ``rebalance``), each layer priced by the cost model's
  per-layer figures scaled to its stage's measured time (:mod:`.layercost`);
- a device measured persistently slower than its stage's others gets fewer micro-batches
  (uneven data-parallel shares) or is left out, whichever is faster (:mod:`.straggler`);
- devices of different speeds (:attr:`View.speeds`) get stages of like devices, weighted
  (:mod:`.mixed`).

The module imports no grpc, kubernetes or torch (a contract in pyproject.toml says so), so its
rules are tested as tables of cases in milliseconds (tests/controller/test_decide.py), apart
from the processes that the end-to-end tests start.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dynatrain.vps.layout import Layout, default_stages, layout_problems
from dynatrain.vps.topology import DEFAULT_DEVICES_PER_NODE

from . import layercost, mixed, routing, straggler
from .mixed import balanced_stages
from .costmodel import SolverError, estimate
from .measured import Measurement
from dynatrain.spec.hardware import DeviceProfile
from dynatrain.spec.job import JobSpec
from .policy import Decision, Policy, estimate_kwargs, seq_len_of

VOLUNTARY = ("scale-up", "better-layout", "rebalance")
"""Switch reasons the policy may choose or not (a cooldown applies; a request supersedes)."""
INTERRUPT_GRACE_S = 1.0
"""How long members may report INTERRUPTED before the controller recovers without knowing
which device failed (normally the runner or the cluster names it within milliseconds)."""
SILENT_AFTER_MISSES = 2
"""Status (or health) calls missed in a row after which a device counts as silent rather
than slow: a switch is not started with it, and one in flight is given up."""


@dataclass(frozen=True)
class Request:
    """A user's open layout request, as the decision sees it."""

    layout: Layout


@dataclass(frozen=True)
class View:
    """What a decision reads: the controller's state at one instant, as values."""

    now: float
    """Monotonic seconds."""
    layout: Layout | None
    """The running layout with its devices (None before the first generation)."""
    usable: tuple[int, ...]
    """Devices with an agent and no notice, sorted."""
    doomed: frozenset[int] = frozenset()
    failed: frozenset[int] = frozenset()
    """Members that died without notice (recovery pending)."""
    misses: dict[int, int] = field(default_factory=dict)
    """Device -> Status calls missed in a row."""
    step: int = 0
    finished: bool = False
    last_step_at: float = 0.0
    give_up_s: float = float("inf")
    interrupted_since: float | None = None
    recover_in_memory: bool = True
    request: Request | None = None
    measurement: Measurement | None = None
    """The running generation's measured step (:mod:`.measured`), once it has one."""
    switch_cost_s: float = 1.0
    """What a switch costs the job in seconds of training (the last one's pause)."""
    share: int | None = None
    """The most workers the job may hold while its pool is contended (:mod:`.share`), or
    None when it binds nothing."""
    speeds: dict[int, float] = field(default_factory=dict)
    """Device -> its speed (FLOP/s of its node's GPU, where the front end knows it): devices
    of different speeds get pipeline stages of like devices, weighted (:mod:`.mixed`)."""
    measured_steps: dict[str, float] = field(default_factory=dict)
    """Layout shape (canonical text) -> the step seconds the job measured on it
    (:mod:`.feedback`)."""
    wait_below_minimum: bool = False
    """Pushed under its minimum by notices, the job waits at a checkpoint instead of failing
    (the front end can hold it: the operator, for a job with ``spec.checkpoint``)."""

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(self.layout.device_of) if self.layout else ()


# -- what a tick does ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    """Answer the pending request with this state and text."""

    state: str
    text: str


@dataclass(frozen=True)
class Idle:
    """Nothing to do now (``why`` for the reader; ``answer`` for a pending request)."""

    why: str = ""
    answer: Answer | None = None


@dataclass(frozen=True)
class Finished:
    """The job trained its last step: every open request is refused, saying so."""


@dataclass(frozen=True)
class GiveUp:
    """The job cannot go on: it fails with ``why``."""

    why: str


@dataclass(frozen=True)
class Recover:
    """Devices died without notice (or members are interrupted): recover in memory."""


@dataclass(frozen=True)
class Park:
    """Notices leave fewer devices than ``spec.elastic.minWorkers``: every member (those
    with a notice still run until their deadline) writes one checkpoint at a step they agree
    on; the job then holds no workers and waits for its minimum, to continue from there
    under whatever layout fits (``why`` says what pushed it under)."""

    why: str


@dataclass(frozen=True)
class Refuse:
    """The pending request cannot be met (``why``, the solver's reason): refuse it and run
    on as before it."""

    why: str


@dataclass(frozen=True)
class Switch:
    """Switch to ``decision.layout`` for ``decision.reason``."""

    decision: Decision
    answer: Answer | None = None


Action = Idle | Finished | GiveUp | Recover | Park | Refuse | Switch


def next_action(v: View, policy: Policy, job: JobSpec, profile: DeviceProfile) -> Action:
    """What the job does at this tick. The order is the rules' priority: a finished job does
    nothing; a stalled one gives up; a failure is recovered before anything else; notices
    that leave fewer devices than the minimum park the job at a checkpoint (or fail it where
    nothing can hold it); a switch
    does not start while a member is suspected of hanging (the watchdog decides first) unless
    a notice forces it; else the policy chooses."""
    if v.finished:
        return Finished()
    stalled = v.now - v.last_step_at
    if v.layout is not None and stalled > v.give_up_s:
        return GiveUp(f"no step trained for {stalled:.0f} s (the give-up timeout, "
                      f"spec.recovery.timeouts.giveUpSeconds={v.give_up_s:g}); members "
                      f"{list(v.members)} at step {v.step}")
    if v.failed or (v.interrupted_since is not None
                    and v.now - v.interrupted_since > INTERRUPT_GRACE_S):
        if not v.recover_in_memory:
            return Idle("the front end restarts the job (checkpoint-and-restart)")
        return Recover()
    must_leave = v.doomed & set(v.members)
    if must_leave and len(v.usable) < job.min_workers:
        why = (f"notices take devices {sorted(must_leave)}, which leaves {len(v.usable)} "
               f"usable, fewer than spec.elastic.minWorkers={job.min_workers}")
        if v.wait_below_minimum:
            return Park(why)
        return GiveUp(f"no layout fits the devices left: {why} (on a cluster, a job with "
                      "spec.checkpoint waits at a checkpoint for its minimum instead)")
    if v.layout is None and v.wait_below_minimum and len(v.usable) < job.min_workers:
        # Not started (or parked) and short of its minimum, say a start whose workers were
        # taken meanwhile: a job the front end can hold waits for them rather than failing.
        return Idle(f"{len(v.usable)} usable workers, fewer than spec.elastic.minWorkers="
                    f"{job.min_workers}: waiting for them")
    suspects = sorted(d for d in v.members if v.misses.get(d))
    if suspects and not must_leave:
        return Idle(f"devices {suspects} missed Status: the watchdog decides about them first")
    try:
        decision = policy.decide(job, profile, v.layout, list(v.usable), set(v.doomed), v.step,
                                 share=v.share, measured=v.measured_steps)
    except SolverError as e:
        if v.layout is None or must_leave:
            return GiveUp(f"no layout fits the devices left: {e}")
        if v.request is not None:
            return Refuse(str(e))
        return Idle(f"the solver found nothing better: {e}")
    answer = None
    if v.request is not None and v.layout is not None:
        answer = waiting_answer(v.request, decision, len(v.usable))
    if decision is None:
        split = rebalance(v, job, policy, profile) if v.request is None else None
        if split is not None:
            target, note = split
            return Switch(Decision(target, "rebalance", estimate(
                job.model, target, profile, **estimate_kwargs(job)), note=note))
        slow = straggler.relieve(v, job, policy, profile) if v.request is None else None
        if slow is not None:
            return Switch(slow)
        return Idle(answer=answer)
    if v.speeds:
        layout = mixed.weigh(job, decision.layout, v.speeds, profile, estimate_kwargs(job))
        if layout is not decision.layout:
            decision = replace(decision, layout=layout)
    return Switch(decision, answer)


def rebalance(v: View, job: JobSpec, policy: Policy,
              profile: DeviceProfile | None = None) -> tuple[Layout, str] | None:
    """The running layout with its layers split again between its stages (and what priced
    the stages, for the log: the MoE routing, or "" for the measured times), when
    ``spec.parallelism.rebalance`` is on and the measurement says it pays: the slowest stage
    measured at least ``threshold`` times the mean one (an MoE stage priced by its measured
    routing, :mod:`.routing`, where that is skewed), the split from :func:`balanced_stages`
    modelled to save at least 5% of the step, and that saving over ``paybackSteps`` steps at
    least the switch's own cost. As a voluntary switch it also waits for the policy's cooldown
    and is not made near the job's end. A new generation is measured afresh (its first step
    left out), so a rebalance is judged on the layout it made before another is made."""
    reb, m, lay = job.rebalance, v.measurement, v.layout
    if not reb.enabled or job.mode != "auto" or lay is None or lay.pp < 2 or m is None:
        return None
    if m.layout != lay.to_text():
        return None
    # An MoE stage's cost as its measured routing makes it (exact counts), else its measured
    # compute time.
    routed = routing.routed_stage_costs(m, job.model, lay, seq_len_of(job))
    costs = routed or m.stage_compute
    mean = sum(costs) / len(costs)
    if mean <= 0 or max(costs) / mean < reb.threshold:
        return None
    if job.training.steps - v.step < max(policy.min_steps_left, 1):
        return None
    if v.now - policy.last_voluntary < policy.cooldown_s:
        return None
    stages = lay.stages or default_stages(job.model.num_layers, lay.pp)
    # What a stage computes whatever its layers (embedding, head and loss), from the cost
    # model's per-layer figures scaled to the measured stage (:mod:`.layercost`); an MoE
    # stage priced by its routing spreads its cost over its layers.
    fixed = None if routed or profile is None else layercost.fixed_seconds(
        costs, stages, layercost.stage_model(job, lay, stages, profile))
    split = balanced_stages(costs, stages, fixed)
    if split == tuple(stages):
        return None
    fixed = fixed or (0.0,) * len(stages)
    per_layer = [(c - f) / n for c, f, n in zip(costs, fixed, stages)]
    saving = max(costs) - max(f + k * r for f, k, r in zip(fixed, split, per_layer))
    if routed:
        # A layer's routing costs the same on any stage: only the pipeline's overlap gains,
        # the (m-1) of m micro-batches that wait for the slowest stage (none with m = 1,
        # where the stages run one after the other).
        saving *= routing.overlapped(job, lay)
    if saving < 0.05 * m.step_seconds or saving * reb.payback_steps < v.switch_cost_s:
        return None
    target = replace(lay, stages=split)
    if layout_problems(target, job.model):
        return None
    return target, routing.describe(m) if routed else ""


def waiting_answer(req: Request, decision: Decision | None, usable: int) -> Answer | None:
    """Why a pending request is not applied by this decision (None: it is, or no news)."""
    if decision is not None and decision.reason == "requested":
        return None
    if req.layout.world > usable:
        return Answer("waiting", f"needs {req.layout.world} workers, {usable} usable: "
                      "applied when capacity allows")
    if decision is not None:
        return Answer("pending", f"after the {decision.reason} switch in progress")
    return None


# -- while a switch is in flight -----------------------------------------------------------------
@dataclass(frozen=True)
class InFlight:
    """The switch being prepared: the devices taking part, its target and why."""

    involved: frozenset[int]
    target: Layout
    reason: str


def superseded(v: View, flight: InFlight, *, present: frozenset[int]) -> str | None:
    """Why the Prepare in flight must be aborted and decided again, or None to go on.

    ``present``: devices with an agent. A device taking part that is gone or failed, or has
    stopped answering Status; a notice on a device of the target; a user's request, over a
    voluntary switch, that capacity allows."""
    lost = sorted(d for d in flight.involved if d not in present or d in v.failed)
    if lost:
        return f"device(s) {lost} lost"
    silent = sorted(d for d in flight.involved if stopped_answering(v.misses.get(d, 0)))
    if silent:
        return f"device(s) {silent} stopped answering Status"
    doomed = sorted(set(flight.target.device_of) & v.doomed)
    if doomed:
        return f"preemption notice for device(s) {doomed}, which the target uses"
    req = v.request
    if flight.reason in VOLUNTARY and req is not None and not req.layout.same_shape(flight.target) \
            and req.layout.world <= len(v.usable):
        return f"layout {req.layout.to_text()} was requested"
    return None


# -- the watchdog --------------------------------------------------------------------------------
def stopped_answering(misses: int) -> bool:
    """Whether a device taking part in a switch has stopped answering: it missed
    :data:`SILENT_AFTER_MISSES` checks in a row (Status while a Prepare is in flight, the gRPC
    health check while a Commit is). One miss is a slow answer, not yet a verdict."""
    return misses >= SILENT_AFTER_MISSES


def after_status_error(*, slow: bool, silent_s: float, watchdog_s: float) -> str | None:
    """A member's Status call failed: why it is failed now, or None (a miss, not yet a
    failure). ``slow``: the call ran out of time (the agent may be busy); otherwise it was
    refused (the process is gone). ``silent_s``: since its last answer."""
    if not slow:
        return "stopped answering"
    if silent_s >= watchdog_s:
        return f"hung: no answer to Status for {silent_s:.1f} s (watchdog {watchdog_s:g} s)"
    return None


def hung(waits: dict[int, float], *, stalled_s: float, limit_s: float) -> list[int]:
    """Members that make no progress while answering Status: when the job has trained no step
    for ``limit_s``, the members that have waited in a collective for half of it are waiting
    for the ones that wait for nothing, and those hang. When every member waits, the hang is
    inside the collectives and no one can be blamed (the collective timeout ends it).
    ``waits``: member -> seconds it has waited in its current collective."""
    if stalled_s < limit_s:
        return []
    waiting = [d for d, w in waits.items() if w >= limit_s / 2]
    idle = sorted(d for d, w in waits.items() if w < 1.0)
    return idle if waiting and idle else []


def acts_on_notice(job: JobSpec) -> bool:
    """Whether a preemption notice becomes a live switch (``spec.preemptionPolicy: Switch``)
    or is only reported, the device then recovered if it goes (``Ignore``)."""
    return job.preemption_policy == "Switch"


def exit_is_failure(*, member: bool, released: bool, code: int | None) -> bool:
    """Whether a worker that exited (or whose pod is gone) failed, for both front ends: a
    member of the running layout that the front end did not release (a pod it deleted after
    switching it off, a replaced unhealthy pod) and that did not exit 0 (``code`` None: not
    known, as when a pod is gone). A leaver exits 0 once its part of a switch is done, maybe
    before the controller records the new layout; the job's state judges an exit seen while a
    switch is in flight (a :class:`~.inbox.DeviceFailed` taken in by :func:`.jobstate.decide`
    counts only if the switch fails)."""
    return member and not released and code != 0


# -- recovery ------------------------------------------------------------------------------------
def choose_restore(model, old: Layout, new: Layout, failed: tuple[int, ...], holdings: dict,
                   *, devices_per_node: int | dict[int, str] = DEFAULT_DEVICES_PER_NODE
                   ) -> tuple[int, dict[int, int]] | None:
    """The newest step every survivor holds a snapshot of and from which ``new`` can be
    planned, with the mirrors (proxies) that make it whole; None if no step qualifies.

    ``holdings``: device -> its Status (snapshot_steps, mirror_of, mirror_steps). The planner
    itself decides whether a step is whole: it fails (PlanError) when some state of a failed
    device has neither a surviving replica nor a mirror. ``devices_per_node``: the plan's node
    map (devices per node, or device -> node name: :mod:`dynatrain.vps.topology`).
    """
    from dynatrain.vps.planner import PlanError, plan_switch

    survivors = [d for d in old.device_of if d not in failed]
    if not survivors:
        return None
    common = set.intersection(*(set(holdings[d].snapshot_steps) if d in holdings else set()
                                for d in survivors))
    for step in sorted(common, reverse=True):
        proxies = {}
        for d, st in holdings.items():
            if st.mirror_of in failed and step in st.mirror_steps:
                proxies[st.mirror_of] = d
        try:
            plan_switch(model, old, new, devices_per_node=devices_per_node, dead=failed,
                        proxies=proxies)
        except PlanError:
            continue
        return step, proxies
    return None


def node_map(device_nodes: dict[int, str], devices_per_node: int, *layouts: Layout
             ) -> dict[int, str] | int:
    """The node map to plan a switch between ``layouts`` on (:mod:`dynatrain.vps.topology`):
    the real nodes when every device of them has a known one (``device_nodes``), else
    ``devices_per_node`` (a partial map would count each unknown device as a node of its
    own)."""
    devices = {d for layout in layouts for d in layout.device_of}
    if devices and devices <= device_nodes.keys():
        return {d: device_nodes[d] for d in sorted(devices)}
    return devices_per_node


def previous_restore(model, new: Layout, holdings: dict, nodes
                     ) -> tuple[Layout, tuple[int, ...], tuple[int, dict[int, int]]] | None:
    """Recovery from the generation before the running one, whose snapshots its members
    keep for two steps after a planned switch (and a member whose switch out of it failed
    still holds as its own): (its layout, its devices that are gone, (step, proxies)), or
    None. The way back when the running generation holds no whole copy yet (a member that
    just joined and has not mirrored its state, a new stage). ``nodes(*layouts)``: the node
    map to plan on (:func:`node_map`)."""
    from types import SimpleNamespace

    from dynatrain.vps.layout import parse_layout

    kept = {d: st for d, st in holdings.items() if st.previous_generation}
    if not kept:
        return None
    g = max(st.previous_generation for st in kept.values())
    lead = next(st for st in kept.values() if st.previous_generation == g)
    prev = parse_layout(lead.previous_layout).with_devices(lead.previous_devices)
    held = {d: SimpleNamespace(snapshot_steps=list(st.previous_snapshot_steps),
                               mirror_of=st.previous_mirror_of,
                               mirror_steps=list(st.previous_mirror_steps))
            for d, st in kept.items() if st.previous_generation == g}
    for d, st in holdings.items():
        # A member whose own switch out of generation g failed (e.g. in the mirror exchange
        # with a joiner that died as its part ended) still runs g: its snapshots are g's, and
        # the worker restores from them for g's layout (WorkerControl.redundancy_for).
        if d not in held and st.generation == g and st.layout == lead.previous_layout \
                and tuple(st.devices) == tuple(lead.previous_devices):
            held[d] = SimpleNamespace(snapshot_steps=list(st.snapshot_steps),
                                      mirror_of=st.mirror_of,
                                      mirror_steps=list(st.mirror_steps))
    dead = tuple(sorted(d for d in prev.device_of if d not in held))
    choice = choose_restore(model, prev, new, dead, held, devices_per_node=nodes(prev, new))
    return (prev, dead, choice) if choice is not None else None

"""The job's state as one frozen value, and the one function that changes it.

:func:`decide` is ``(state, event) -> (state, actions)``: it takes a :class:`JobState` and one
event and returns the next state and what the executor (:class:`~.core.JobController`) must
do. It has no clock, no network and no process of its own, and imports no grpc, kubernetes or
torch (a contract in pyproject.toml says so), so whole event sequences are replayed against it
in milliseconds (tests/controller/test_jobstate.py, and the overlap property's random
scenarios in tests/controller/test_decide.py).

What it owns:

- **who takes part**: the devices with an agent, preemption notices and their deadlines,
  devices that failed (and why), stragglers left out, the running layout;
- **the watchdog's verdicts**: Status calls missed in a row (a suspect holds a switch back),
  and when silence or a refused call makes a device failed (:class:`StatusFailed`);
- **the switch in flight** (its devices, target and reason), and the leavers that exited
  during it, which count as failures only if it fails;
- **layout requests and their answers**: pending, waiting for capacity, applied, superseded,
  refused, and the spec the job goes back to when one is refused or withdrawn;
- **the decisions**: at a :class:`Tick`, :func:`.decide.next_action` over the state and the
  executor's facts (progress, measurements); where a recovery places the job
  (:class:`PlaceRecovery`) and what it restores from (:class:`Holdings`); at a
  :class:`Watch` while a Prepare is in flight, :func:`.decide.superseded`.

The events are the front ends' (:mod:`.inbox`: a device up, a notice, a device left or
failed, a spec edit, a layout request) and the executor's own (:mod:`.jobevents`): what it
read (progress, each Status call), what its actions came to (a switch began, committed or
failed; a recovery's placement and the survivors' holdings; a restart; an adoption) and the
facts of a tick. The actions (:mod:`.jobevents` too) are what only the executor can do: close
an agent's connection, write the log, tell the front end a request's answer, set the worker
count, run what a tick decided (:class:`~.decide.Switch`, :class:`~.decide.Recover`,
:class:`~.decide.Park`, :class:`~.decide.GiveUp`) or where a recovery goes and restores from,
or abort a Prepare (:class:`Abort`).

The executor keeps only what is not a decision: the agents' connections, progress and its
audit, measurements, and the two-phase switch itself (:mod:`.orchestrator`). Front ends read
the state as published, a value that no one can change under them
(:attr:`~.core.JobController.state`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dynatrain.spec.job import JobSpec
from dynatrain.vps.layout import Layout

from . import decide as rules
from . import inbox as ev
from .costmodel import SolverError
from .jobevents import (  # noqa: F401 (the reducer's vocabulary, importable from here)
    LayoutRequest, Progressed, StatusAnswered, StatusFailed, SwitchBegan, SwitchEnded,
    Committed, Adopted, Reconciled, Restarted, LeftOut, Tick, PlaceRecovery, Holdings, Watch,
    Close, Log, Answered, Workers, Place, RestoreFrom, FromCheckpoint, Abort, Event, Action)


@dataclass(frozen=True)
class JobState:
    """Everything the job's decisions read and change, as one value."""

    job: JobSpec
    auto_job: JobSpec | None = None
    """The spec before the first request fixed the layout (restored if it is refused)."""
    layout: Layout | None = None
    """The running layout with its devices (None before the first generation)."""
    step: int = 0
    """The job's step as the executor last read it."""
    agents: frozenset[int] = frozenset()
    """Devices whose agent answers (members, joiners, standbys)."""
    deadlines: tuple[tuple[int, float], ...] = ()
    """(device, monotonic deadline by which it must have left the running layout), sorted."""
    slow: frozenset[int] = frozenset()
    """Devices left out for computing slower than their peers: never usable again."""
    failed: frozenset[int] = frozenset()
    """Devices of the running layout that died without notice (recovery pending)."""
    lost: tuple[tuple[int, str], ...] = ()
    """Every device that ever failed, in order, and why (the operator replaces their pods)."""
    flight: rules.InFlight | None = None
    """The switch or recovery in flight."""
    exits: tuple[tuple[int, str], ...] = ()
    """Leavers of the switch in flight that exited (a failure only if the switch fails)."""
    requests: tuple[LayoutRequest, ...] = ()
    answered: tuple[tuple[int, float], ...] = ()
    """(device, monotonic time of its last answered Status, or of its coming up): the
    watchdog's clock."""
    misses: tuple[tuple[int, int], ...] = ()
    """(device, Status calls it missed in a row): a suspect, no switch starts with it."""

    @property
    def doomed(self) -> dict[int, float]:
        """Device -> its notice's deadline (a copy)."""
        return dict(self.deadlines)

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(self.layout.device_of) if self.layout else ()

    @property
    def usable(self) -> tuple[int, ...]:
        """Devices with an agent, no notice and not left out, sorted."""
        doomed = self.doomed
        return tuple(sorted(d for d in self.agents if d not in doomed and d not in self.slow))

    @property
    def leaving(self) -> frozenset[int]:
        """Members that the switch in flight takes out of the job."""
        if self.flight is None:
            return frozenset()
        return frozenset(self.members) - frozenset(self.flight.target.device_of)

    @property
    def pending_request(self) -> LayoutRequest | None:
        return next((r for r in reversed(self.requests) if r.open), None)


# -- the reducer ---------------------------------------------------------------------------------
def decide(s: JobState, e: Event) -> tuple[JobState, tuple[Action, ...]]:
    """The next state and what the executor does, for one event."""
    out: list[Action] = []
    for kind, handler in _HANDLERS:
        if isinstance(e, kind):
            s = handler(s, e, out)
            return s, tuple(out)
    raise TypeError(f"not a job event: {e!r}")


def decide_all(s: JobState, events) -> tuple[JobState, tuple[Action, ...]]:
    """:func:`decide` over ``events`` in order; every action, in order."""
    out: list[Action] = []
    for e in events:
        s, acts = decide(s, e)
        out.extend(acts)
    return s, tuple(out)


def view(s: JobState, t: Tick) -> rules.View:
    """The state and a tick's facts as the values :func:`.decide.next_action` reads."""
    return _view(s, t.now, finished=t.finished, last_step_at=t.last_step_at,
                 give_up_s=t.give_up_s, interrupted_since=t.interrupted_since,
                 recover_in_memory=t.recover_in_memory, measurement=t.measurement,
                 switch_cost_s=t.switch_cost_s, share=t.share, speeds=dict(t.speeds),
                 measured_steps=dict(t.measured_steps),
                 wait_below_minimum=t.wait_below_minimum)


def _view(s: JobState, now: float, **facts) -> rules.View:
    """The state's part of a :class:`~.decide.View`, with the executor's ``facts``."""
    req = s.pending_request
    return rules.View(now=now, layout=s.layout, usable=s.usable, doomed=frozenset(s.doomed),
                      failed=s.failed, misses=dict(s.misses), step=s.step,
                      request=rules.Request(req.layout) if req is not None else None, **facts)


def _workers(s: JobState, out: list) -> None:
    out.append(Workers(len(s.usable)))


def _put(pairs: tuple, key, value=None) -> tuple:
    """``pairs`` (sorted (key, value) tuples) with ``key`` set to ``value`` (None: removed)."""
    d = dict(pairs)
    if value is None:
        d.pop(key, None)
    else:
        d[key] = value
    return tuple(sorted(d.items()))


def _device_up(s: JobState, e: ev.DeviceUp, out: list) -> JobState:
    s = replace(s, agents=s.agents | {e.device})
    _workers(s, out)
    return s


def _notice(s: JobState, e: ev.Notice, out: list) -> JobState:
    s = replace(s, deadlines=_put(s.deadlines, e.device, e.at + e.seconds))
    _workers(s, out)
    return s


def _device_left(s: JobState, e: ev.DeviceLeft, out: list) -> JobState:
    if e.device in s.agents:
        out.append(Close(e.device, later=s.flight is not None))
    d = e.device
    s = replace(s, agents=s.agents - {d}, deadlines=_put(s.deadlines, d),
                answered=_put(s.answered, d), misses=_put(s.misses, d))
    _workers(s, out)
    return s


def _mark_failed(s: JobState, device: int, why: str, out: list) -> JobState:
    out.append(Log(f"device {device} failed: {why}"))
    return replace(s, failed=s.failed | {device}, lost=s.lost + ((device, why),))


def _device_failed(s: JobState, e: ev.DeviceFailed, out: list) -> JobState:
    # A leaver of the switch in flight exits as its part ends: that is a failure only if the
    # switch then fails (judged when it ends, :func:`_switch_ended`).
    d = e.device
    if s.flight is not None and d in s.members and d not in s.flight.target.device_of:
        if d not in dict(s.exits):
            s = replace(s, exits=s.exits + ((d, e.why),))
    elif d in s.members and d not in s.failed:
        s = _mark_failed(s, d, e.why, out)
    return _device_left(s, ev.DeviceLeft(d), out)


def _answer(s: JobState, req: LayoutRequest, state: str, text: str, out: list, *,
            step: int | None = None) -> JobState:
    """``req`` (one of ``s.requests``) now answered ``state``/``text``."""
    if (req.state, req.answer) == (state, text):
        return s
    new = replace(req, state=state, answer=text,
                  applied_step=step if state == "applied" else req.applied_step)
    out.append(Log(f"layout request {req.layout.to_text()}: {state}: {text}"))
    out.append(Answered(new))
    return replace(s, requests=tuple(new if r is req else r for r in s.requests))


def _requested(s: JobState, e: ev.LayoutRequested, out: list) -> JobState:
    layout = e.layout
    for old in s.requests:
        if old.open:
            s = _answer(s, old, "superseded", f"superseded by the request for "
                        f"{layout.to_text()}", out)
    auto = s.auto_job
    if auto is None and s.job.mode != "fixed":
        auto = s.job
    req = LayoutRequest(layout, s.step)
    s = replace(s, auto_job=auto, job=replace(s.job, mode="fixed", layout=layout),
                requests=s.requests + (req,))
    if layout.same_shape(s.layout):
        return _answer(s, req, "applied", "already running", out, step=s.step)
    return _answer(s, req, "pending", f"requested at step {req.step}", out)


def _spec_edited(s: JobState, e: ev.SpecEdited, out: list) -> JobState:
    # A new fixed layout is a request; back to ``auto`` withdraws one.
    before, job = s.job, e.job
    s = replace(s, job=job)
    if job.mode == "fixed" and job.layout is not None and (
            before.mode != "fixed" or before.layout is None
            or not before.layout.same_shape(job.layout)):
        return _requested(replace(s, auto_job=None), ev.LayoutRequested(job.layout), out)
    if job.mode != "fixed":
        s = replace(s, auto_job=None)
        for req in s.requests:
            if req.open:
                s = _answer(s, req, "superseded", "withdrawn: parallelism.mode is auto again",
                            out)
    return s


def _status_answered(s: JobState, e: StatusAnswered, out: list) -> JobState:
    return replace(s, answered=_put(s.answered, e.device, e.at), misses=_put(s.misses, e.device))


def _status_failed(s: JobState, e: StatusFailed, out: list) -> JobState:
    # The watchdog: a call that ran out of time is a miss (a suspect); silent for the
    # watchdog's time, or refused, the device failed (:func:`.decide.after_status_error`).
    d = e.device
    if e.slow:
        s = replace(s, misses=_put(s.misses, d, dict(s.misses).get(d, 0) + 1))
    since = dict(s.answered).get(d)
    if since is None:
        since, s = e.at, replace(s, answered=_put(s.answered, d, e.at))
    why = rules.after_status_error(slow=e.slow, silent_s=e.at - since, watchdog_s=e.watchdog_s)
    if e.judge and why is not None:
        return _device_failed(s, ev.DeviceFailed(d, why if e.slow else f"{why}: {e.error}"),
                              out)
    return s


def _progressed(s: JobState, e: Progressed, out: list) -> JobState:
    return replace(s, step=e.step) if e.step != s.step else s


def _switch_began(s: JobState, e: SwitchBegan, out: list) -> JobState:
    return replace(s, flight=rules.InFlight(e.involved, e.target, e.reason), exits=())


def _switch_ended(s: JobState, e: SwitchEnded, out: list) -> JobState:
    exits, s = s.exits, replace(s, flight=None, exits=())
    if not e.ok:
        for d, why in exits:              # they left nothing behind: failures after all
            if d in s.members and d not in s.failed:
                s = _mark_failed(s, d, why, out)
    return s


def _committed(s: JobState, e: Committed, out: list) -> JobState:
    req = s.pending_request
    if e.recovered and req is not None and not req.layout.same_shape(e.layout) \
            and e.displaced:
        s = _answer(s, req, "pending", e.displaced, out)
    s = replace(s, layout=e.layout)
    req = s.pending_request
    if req is not None and req.layout.same_shape(e.layout):
        s = _answer(s, req, "applied", f"applied at step {e.step} ({e.reason})", out,
                    step=e.step)
    if e.recovered:
        s = replace(s, failed=frozenset())
    _workers(s, out)
    return s


def _adopted(s: JobState, e: Adopted, out: list) -> JobState:
    return replace(s, layout=e.layout)


def _reconciled(s: JobState, e: Reconciled, out: list) -> JobState:
    devices = set(e.layout.device_of)
    s = replace(s, failed=frozenset(d for d in s.failed if d in devices))
    for d in e.layout.device_of:          # gone before it was a member on record
        if d not in s.agents and d not in s.failed:
            s = _mark_failed(s, d, f"lost while the switch to generation {e.generation} "
                             "completed", out)
    return replace(s, layout=e.layout)


def _restarted(s: JobState, e: Restarted, out: list) -> JobState:
    out.extend(Close(d) for d in sorted(s.agents))
    s = replace(s, agents=frozenset(), deadlines=(), failed=frozenset(), layout=None,
                answered=(), misses=())        # the watchdog's clocks went with the agents
    _workers(s, out)
    return s


def _left_out(s: JobState, e: LeftOut, out: list) -> JobState:
    s = replace(s, slow=s.slow | e.devices)
    _workers(s, out)
    return s


def _tick(s: JobState, t: Tick, out: list) -> JobState:
    action = rules.next_action(view(s, t), t.policy, s.job, t.profile)
    req = s.pending_request
    if isinstance(action, rules.Finished):
        for r in s.requests:
            if r.open:
                s = _answer(s, r, "refused", f"not applied: the job finished at step {s.step} "
                            f"first ({r.answer})", out)
        return s
    if isinstance(action, rules.Refuse):
        s = _answer(s, req, "refused", action.why, out)
        # Run on as before the request: the layout the job had, or the solver's choice.
        return replace(s, job=s.auto_job or replace(s.job, layout=s.layout), auto_job=None)
    if req is not None and isinstance(action, (rules.Idle, rules.Switch)) \
            and action.answer is not None:
        s = _answer(s, req, action.answer.state, action.answer.text, out)
    if not isinstance(action, rules.Idle):
        out.append(action)
    return s


def _place_recovery(s: JobState, e: PlaceRecovery, out: list) -> JobState:
    # The policy over the devices left: the failed members and the noticed devices are
    # excluded; nothing better than the running layout without them is kept as it is.
    failed = tuple(sorted(s.failed & set(s.members)))
    try:
        d = e.policy.decide(s.job, e.profile, s.layout, list(s.usable),
                            set(s.doomed) | set(failed), s.step)
    except SolverError as err:
        out.append(rules.GiveUp(f"devices {list(failed)} failed and no layout fits the "
                                f"{len(s.usable)} devices left: {err}"))
        return s
    out.append(Place(d.layout if d is not None else s.layout, failed))
    return s


def _holdings(s: JobState, e: Holdings, out: list) -> JobState:
    # The newest step every survivor of the running generation holds whole (the failed
    # devices' state from their buddies' mirrors); else the generation before it; else the
    # newest checkpoint any survivor wrote; else nothing is left to train on.
    old, new, failed = s.layout, e.target, e.failed

    def nodes(*layouts):
        return rules.node_map(dict(e.device_nodes), e.devices_per_node, *layouts)

    choice = rules.choose_restore(s.job.model, old, new, failed, e.holdings,
                                  devices_per_node=nodes(old, new))
    if choice is not None:
        out.append(RestoreFrom(old, failed, choice[0], tuple(sorted(choice[1].items()))))
        return s
    found = rules.previous_restore(s.job.model, new, e.holdings, nodes)
    if found is not None:
        prev, dead, (step, proxies) = found
        out.append(RestoreFrom(prev, dead, step, tuple(sorted(proxies.items())), earlier=(
            f" of the generation before the last switch ({prev.to_text()} on "
            f"{list(prev.device_of)}; the running one has no whole copy yet)")))
        return s
    ckpt = max(((st.checkpoint_step, st.checkpoint) for st in e.holdings.values()
                if st.checkpoint), default=None)
    if ckpt is None:
        out.append(rules.GiveUp(
            f"devices {list(failed)} failed and no copy of their state survives in memory "
            "(their buddies are gone too, or spec.recovery.mirror is off), and there is no "
            "checkpoint to fall back on (set spec.checkpoint.intervalSteps); the job stops "
            f"at step {s.step}"))
    else:
        out.append(FromCheckpoint(ckpt[1], ckpt[0]))
    return s


def _watch(s: JobState, w: Watch, out: list) -> JobState:
    if s.flight is None:
        return s
    why = rules.superseded(_view(s, w.now), s.flight, present=s.agents)
    if why is not None:
        out.append(Abort(why))
    return s


_HANDLERS = (
    (ev.DeviceUp, _device_up), (ev.Notice, _notice), (ev.DeviceLeft, _device_left),
    (ev.DeviceFailed, _device_failed), (ev.LayoutRequested, _requested),
    (ev.SpecEdited, _spec_edited), (Progressed, _progressed),
    (StatusAnswered, _status_answered), (StatusFailed, _status_failed),
    (SwitchBegan, _switch_began), (SwitchEnded, _switch_ended), (Committed, _committed),
    (Adopted, _adopted), (Reconciled, _reconciled), (Restarted, _restarted),
    (LeftOut, _left_out), (Tick, _tick), (PlaceRecovery, _place_recovery),
    (Holdings, _holdings), (Watch, _watch),
)

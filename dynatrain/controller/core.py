"""The controller core: one job's devices, its running generation, and the switches between.

Both front ends drive a :class:`JobController` the same way: they report capacity
(:meth:`add_device`, :meth:`notice`, :meth:`remove_device`) and call :meth:`tick` often. A
tick reads every member's progress over the agents' Status (steps, losses, the samples each
data reader consumed), asks the :class:`~.policy.Policy` whether to switch, and runs the
two-phase switch (:mod:`.orchestrator`) when it says so, retrying a failed Prepare with a fresh
generation. The controller never touches training state itself; it only talks to agents.

Signals never wait behind a switch: while one is being prepared or committed, the controller
keeps reading progress and calls the front end's :attr:`JobController.intake` (which reports
new capacity signals), and a Prepare whose target a newer signal made wrong (a device lost, a
notice on a device of the target, a user's request over a voluntary switch) is aborted and
re-planned at once; a signal that does not conflict is merged into the next decision. Every
requested layout is answered (:class:`LayoutRequest`): applied, waiting for capacity with the
reason, superseded, or refused with the solver's reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import grpc

from dynatrain.agent.client import AgentCallError, AgentClient
from dynatrain.agent.metrics import REASONS, Metrics
from dynatrain.agent.v1 import agent_pb2 as pb
from dynatrain.vps.layout import Layout
from dynatrain.vps.topology import DEFAULT_DEVICES_PER_NODE

from . import decide
from .costmodel import SolverError
from .decide import choose_restore
from dynatrain.spec.hardware import DeviceProfile
from dynatrain.spec.job import JobSpec
from .orchestrator import Restore, SwitchFailed, SwitchRecord, Timeouts, switch
from .policy import Policy
from .progress import Progress

State = pb.StatusResponse.State
MAX_ATTEMPTS = 3


class JobFailed(RuntimeError):
    """The job cannot go on; the message says why and what was tried."""


class SuspendFailed(RuntimeError):
    """No checkpoint was written for a suspend; the message says why (the job trains on)."""


@dataclass
class LayoutRequest:
    """A layout a user asked for, and the controller's answer to it."""

    layout: Layout
    step: int
    """The job's step when it was asked for."""
    state: str = "pending"
    """``pending`` (to be applied at the next decision), ``waiting`` (needs capacity),
    ``applied``, ``superseded`` (by a newer request, or withdrawn) or ``refused``."""
    answer: str = ""
    applied_step: int | None = None

    @property
    def open(self) -> bool:
        """Not yet applied, superseded or refused."""
        return self.state in ("pending", "waiting")

    def summary(self) -> dict:
        return {"layout": self.layout.to_text(), "step": self.step, "state": self.state,
                "answer": self.answer, "applied_step": self.applied_step}


class JobController:
    def __init__(self, job: JobSpec, *, rendezvous: str, profile: DeviceProfile,
                 metrics: Metrics | None = None, policy: Policy | None = None,
                 timeouts: Timeouts = Timeouts(),
                 devices_per_node: int = DEFAULT_DEVICES_PER_NODE, log=print):
        self.job, self.rendezvous, self.profile = job, rendezvous, profile
        self.metrics = metrics or Metrics(namespace=job.namespace, job=job.name,
                                          reasons=REASONS)
        self.policy = policy or Policy()
        self.timeouts, self.devices_per_node, self.log = timeouts, devices_per_node, log
        self.clients: dict[int, AgentClient] = {}
        self.doomed: dict[int, float] = {}
        """Device -> monotonic deadline by which it must have left the running layout."""
        self.layout: Layout | None = None
        self.generation = 0
        self.generation_running = 0
        """The generation of :attr:`layout` (``generation`` counts every one started)."""
        self.switches: list[SwitchRecord] = []
        self.progress = Progress()
        self._seen: dict[int, int] = {}
        self.device_nodes: dict[int, str] = {}
        """device -> the node it runs on, where the front end knows it (a cluster's pods'
        ``spec.nodeName``): a rank's mirror goes to another node. A device never moves."""
        self.failed: set[int] = set()
        """Devices of the running layout that died without notice (recovery pending)."""
        self.lost: list[int] = []
        """Every device that ever failed (the operator replaces their pods)."""
        self.interrupted_since: float | None = None
        self.recoveries: list[SwitchRecord] = []
        self.first_step_end: dict[int, float] = {}
        """Generation -> wall time at which its first step ended (recovery time is measured
        up to it)."""
        self.step_times: dict[tuple[int, int], tuple[float, float]] | None = None
        """When a dict (``dynatrain bench goodput`` sets one; None: not kept, it grows with
        the job): (generation, step) -> (wall start, wall end) of every step trained, steps
        trained again after a rewind included, the earliest start and latest end over the
        devices that reported it."""
        self.resume_from = ""
        """A checkpoint the job's first generation starts from (any layout)."""
        self.recover_in_memory = True
        """False: leave failures to the front end (the local runner's restart mode)."""
        self.before_switch = None
        """Called with (old layout, new layout, reason) before a switch starts (the operator
        shows the job as Switching)."""
        self.intake = None
        """The front end's ``intake()``: report the capacity signals that arrived (notices,
        exits, joins, requests) now. Called while a switch waits, so none waits behind it."""
        self.requests: list[LayoutRequest] = []
        self.decisions: list[dict] = []
        """Every switch or recovery started: the step it started at, why, and its target (how
        late a signal was acted on is read from these)."""
        self.on_answer = None
        """Called with a :class:`LayoutRequest` whenever its answer changes (the operator's
        condition and Event; the log line is written here)."""
        self._auto_job: JobSpec | None = None
        """The spec before the first request fixed the layout (restored if it is refused)."""
        self._in_switch: tuple[set[int], Layout, str] | None = None
        """(devices taking part, target, reason) of the switch in flight."""
        self._to_close: list[AgentClient] = []
        self.previous_devices: tuple[int, ...] = ()
        """Devices of the generation before the running one (their snapshots may be kept)."""
        self._exits_in_switch: dict[int, str] = {}
        """Leavers of the switch in flight that exited (see :meth:`fail_device`)."""
        self._last_step_at = time.monotonic()
        """When the job last trained a step (or switched): the give-up clock."""
        self._step_seconds = 0.0
        """The latest step's duration (the watchdog waits at least three of them)."""
        self._last_answer: dict[int, float] = {}
        """Device -> monotonic time of its last answered Status (the watchdog's clock)."""
        self._misses: dict[int, int] = {}
        """Device -> Status calls it missed in a row (a suspect: no switch starts with it)."""

    # -- capacity ------------------------------------------------------------------------------
    def add_device(self, device: int, client: AgentClient) -> None:
        self.clients[device] = client
        self._last_answer[device] = time.monotonic()
        self._report_workers()

    def notice(self, device: int, seconds: float) -> None:
        """``device`` will be gone in ``seconds``: the running layout must leave it now."""
        self.doomed[device] = time.monotonic() + seconds
        self._report_workers()

    def remove_device(self, device: int) -> None:
        client = self.clients.pop(device, None)
        if client is not None:
            if self._in_switch is not None:
                self._to_close.append(client)    # the switch in flight may still call it
            else:
                client.close()
        self.doomed.pop(device, None)
        self._last_answer.pop(device, None)
        self._misses.pop(device, None)
        self._report_workers()

    def fail_device(self, device: int, why: str) -> None:
        """``device`` died without notice (a crash, a lost node): the next tick recovers.

        A leaver of the switch in flight exits as its part ends: that is a failure only if
        the switch then fails (judged when it ends)."""
        if self._in_switch is not None and device in self.members \
                and device not in self._in_switch[1].device_of:
            self._exits_in_switch.setdefault(device, why)
        elif device in self.members and device not in self.failed:
            self._mark_failed(device, why)
        self.remove_device(device)

    def _mark_failed(self, device: int, why: str) -> None:
        self.log(f"device {device} failed: {why}")
        self.failed.add(device)
        self.lost.append(device)

    def restart_from(self, checkpoint: str, step: int) -> None:
        """Every worker was replaced (checkpoint-and-restart): start again from ``checkpoint``."""
        for client in self.clients.values():
            client.close()
        self.clients.clear()
        self.doomed.clear()
        self.failed.clear()
        self.layout = None
        self.generation_running = 0          # none runs (the count goes on: ``generation``)
        self.interrupted_since = None
        self.resume_from = checkpoint
        self._rewind(step)
        self._seen.clear()
        self._report_workers()

    def suspend(self) -> tuple[str, int]:
        """Every member writes its part of one checkpoint at a step boundary they agree on
        and trains no further (``spec.suspend``); returns (path, step). The front end then
        removes the workers and, to resume, calls :meth:`restart_from` with what this
        returned: the job continues from that step under whatever layout fits the workers
        it then has. Raises :class:`SuspendFailed` (the job trains on, or is recovered if a
        member died inside the collective save)."""
        from .orchestrator import _fan_out

        if self.layout is None or self._in_switch is not None:
            raise SuspendFailed("no generation is running" if self.layout is None
                                else "a switch is in flight")
        members, g = self.members, self.generation_running
        replies = _fan_out(lambda d: self.clients[d].checkpoint(
            g, stop=True, timeout_s=self.timeouts.commit_s), members)
        bad = [f"device {d}: {r}" for d, r in zip(members, replies) if isinstance(r, Exception)]
        if bad:
            raise SuspendFailed("; ".join(bad))
        written = {(r.path, r.step) for r in replies}
        if len(written) != 1:       # one agreed boundary: every rank answers the same
            raise SuspendFailed(f"the members answered different checkpoints: {sorted(written)}")
        self.poll(judge=False)      # the last steps' records (their reads) before they go
        path, step = written.pop()
        self.log(f"suspended at step {step}: every member wrote its part of {path} and "
                 "trains no further")
        return path, step

    def request_layout(self, layout: Layout) -> LayoutRequest:
        """A user asked for this layout (``parallelism.mode: fixed``). It is applied at the
        next decision, or answered with why not (:attr:`requests`)."""
        for old in self.requests:
            if old.open:
                self._answer(old, "superseded", f"superseded by the request for "
                             f"{layout.to_text()}")
        if self._auto_job is None and self.job.mode != "fixed":
            self._auto_job = self.job
        self.job = replace(self.job, mode="fixed", layout=layout)
        req = LayoutRequest(layout, self.progress.step)
        self.requests.append(req)
        if layout.same_shape(self.layout):
            self._answer(req, "applied", "already running", step=self.progress.step)
        else:
            self._answer(req, "pending", f"requested at step {req.step}")
        return req

    def set_job(self, job: JobSpec) -> None:
        """The spec was edited (the operator): a new fixed layout is a request; back to
        ``auto`` withdraws one."""
        before = self.job
        self.job = job
        if job.mode == "fixed" and job.layout is not None and (
                before.mode != "fixed" or before.layout is None
                or not before.layout.same_shape(job.layout)):
            self._auto_job = None
            self.request_layout(job.layout)
        elif job.mode != "fixed":
            self._auto_job = None
            for req in self.requests:
                if req.open:
                    self._answer(req, "superseded", "withdrawn: parallelism.mode is auto again")

    def pending_request(self) -> LayoutRequest | None:
        return next((r for r in reversed(self.requests) if r.open), None)

    def _answer(self, req: LayoutRequest, state: str, text: str, *,
                step: int | None = None) -> None:
        if (req.state, req.answer) == (state, text):
            return
        req.state, req.answer = state, text
        if state == "applied":
            req.applied_step = step
        self.log(f"layout request {req.layout.to_text()}: {state}: {text}")
        if self.on_answer is not None:
            self.on_answer(req)

    @property
    def switching(self) -> bool:
        """A switch or recovery is in flight (signals are taken in meanwhile)."""
        return self._in_switch is not None

    @property
    def usable(self) -> list[int]:
        return sorted(d for d in self.clients if d not in self.doomed)

    @property
    def members(self) -> list[int]:
        return list(self.layout.device_of) if self.layout else []

    def reported_step(self) -> int:
        """The last step every live member has reported, its reads included. Members finish a
        step together but their records arrive one Status call apart, so a step after this one
        may still lack a reader's record: an audit stops here rather than call it unread."""
        live = [self._seen.get(d, 0) for d in self.members if d not in self.failed]
        return min([self.progress.step] + live)

    def _report_workers(self) -> None:
        self.metrics.set_workers(len(self.usable))

    # -- taking over a running job ---------------------------------------------------------------
    def adopt(self) -> str:
        """Take over a job whose agents already run (the controller restarted).

        The running generation is the highest that any agent runs; its layout and devices come
        from those agents. A generation prepared but not switched is finished when every device
        of it is ready and one of them already holds its Commit (the old controller was inside
        phase two: the others must commit too, or the committed ones wait forever), and is
        aborted otherwise (phase one: nothing moved; the policy will decide again).
        Returns what was found, for the log.
        """
        statuses = {}
        for d, c in self.clients.items():
            try:
                statuses[d] = c.status(since_step=1 << 62)
            except AgentCallError:
                continue
        running = [st for st in statuses.values()
                   if st.state in (State.TRAINING, State.FINISHED, State.SWITCHING)
                   and st.generation > 0]
        self.generation = max([self.generation] + [st.generation for st in statuses.values()]
                              + [st.prepared_generation for st in statuses.values()] + [0])
        if not running:
            return "no running generation: starting fresh"
        top = max(st.generation for st in running)
        lead = next(st for st in running if st.generation == top and st.layout)
        from dynatrain.vps.layout import parse_layout

        self.layout = parse_layout(lead.layout).with_devices(lead.devices)
        self.generation_running = top
        for d in self.layout.device_of:
            if d in statuses:
                self._seen[d] = statuses[d].step
        self.progress.step = max(st.step for st in running)
        found = f"running generation {top}: {self.layout.to_text()} on {list(lead.devices)}"
        pending = {d: st for d, st in statuses.items() if st.prepared_generation > top}
        if not pending:
            return found
        g = max(st.prepared_generation for st in pending.values())
        sample = next(st for st in pending.values() if st.prepared_generation == g)
        new = parse_layout(sample.prepared_layout).with_devices(sample.prepared_devices)
        members = sorted(set(self.layout.device_of) | set(new.device_of))
        ready = all(d in pending and pending[d].prepared_generation == g
                    and pending[d].prepared_ready for d in members)
        if ready and any(st.prepared_committed for st in pending.values()):
            from .orchestrator import _fan_out

            replies = _fan_out(lambda d: self.clients[d].commit(
                g, 0, timeout_s=self.timeouts.commit_s), members)
            bad = [(d, r) for d, r in zip(members, replies) if isinstance(r, Exception)]
            if bad:
                raise JobFailed(f"finishing generation {g} after a restart failed: {bad}")
            old, self.layout = self.layout, new
            self.generation_running = g
            self.metrics.set_layout(new)
            self.metrics.set_generation(g)
            return found + f"; finished the committed switch to generation {g} ({_text(old)} " \
                           f"-> {new.to_text()})"
        for d, st in pending.items():
            try:
                self.clients[d].abort(st.prepared_generation, "controller restarted")
            except AgentCallError:
                pass
        return found + f"; aborted the uncommitted generation {g}"

    # -- the loop --------------------------------------------------------------------------------
    def tick(self) -> SwitchRecord | None:
        """Read progress; act on what :func:`.decide.next_action` says. Returns the switch
        made, if any."""
        self.poll()
        action = decide.next_action(self.view(), self.policy, self.job, self.profile)
        req = self.pending_request()
        if isinstance(action, decide.Finished):
            for r in self.requests:
                if r.open:
                    self._answer(r, "refused", f"not applied: the job finished at step "
                                 f"{self.progress.step} first ({r.answer})")
            return None
        if isinstance(action, decide.GiveUp):
            raise JobFailed(action.why)
        if isinstance(action, decide.Recover):
            return self._recover()
        if isinstance(action, decide.Refuse):
            self._refuse(req, action.why)
            return None
        if req is not None and isinstance(action, (decide.Idle, decide.Switch)) \
                and action.answer is not None:
            self._answer(req, action.answer.state, action.answer.text)
        if not isinstance(action, decide.Switch):
            return None
        decision = action.decision
        record = self._switch(decision.layout, decision.reason)
        if record is not None and decision.reason in decide.VOLUNTARY:
            self.policy.record_voluntary()
        return record

    def view(self) -> decide.View:
        """The controller's state as the values :mod:`.decide` reads."""
        req = self.pending_request()
        return decide.View(
            now=time.monotonic(), layout=self.layout, usable=tuple(self.usable),
            doomed=frozenset(self.doomed), failed=frozenset(self.failed),
            misses=dict(self._misses), step=self.progress.step,
            finished=self.progress.finished, last_step_at=self._last_step_at,
            give_up_s=self.timeouts.give_up_s, interrupted_since=self.interrupted_since,
            recover_in_memory=self.recover_in_memory,
            request=decide.Request(req.layout) if req is not None else None)

    def _refuse(self, req: LayoutRequest, why: str) -> None:
        self._answer(req, "refused", why)
        # Run on as before the request: the layout the job had, or the solver's choice.
        self.job = self._auto_job or replace(self.job, layout=self.layout)
        self._auto_job = None

    def _decided(self, reason: str, target: Layout) -> None:
        self.decisions.append({"step": self.progress.step, "reason": reason,
                               "to": target.to_text(), "devices": list(target.device_of),
                               "time": time.time()})

    def _watch(self, phase: str) -> str | None:
        """While a switch waits: read progress, take in new signals, and say whether the
        switch in flight is now wrong (its Prepare is then aborted and re-planned)."""
        self.poll(judge=False)
        if self.intake is not None:
            self.intake()
        if phase != "prepare" or self._in_switch is None:
            return None
        involved, new, reason = self._in_switch
        return decide.superseded(self.view(), decide.InFlight(frozenset(involved), new, reason),
                                 present=frozenset(self.clients))

    def poll(self, *, judge: bool = True) -> Progress:
        """Collect step records from every member (each reports its own data reads).

        The watchdog: a member that does not answer Status within ``timeouts.status_s``
        missed one; one that has missed every call for ``timeouts.watchdog_s`` (a stopped or
        hung process) is declared failed. One that refuses the connection has exited.
        ``judge=False`` (while a switch runs: a leaver exits as it ends, and the switch
        watches its devices itself) only reads progress."""
        p = self.progress
        states, waits = [], {}
        now = time.monotonic()
        for d in self.members:
            if d in self.failed or d not in self.clients:
                continue
            try:
                st = self.clients[d].status(since_step=self._seen.get(d, 0),
                                            timeout_s=self.timeouts.status_s)
            except AgentCallError as e:
                slow = e.code == grpc.StatusCode.DEADLINE_EXCEEDED
                if slow:
                    self._misses[d] = self._misses.get(d, 0) + 1
                silent = now - self._last_answer.setdefault(d, now)
                why = decide.after_status_error(slow=slow, silent_s=silent,
                                                watchdog_s=self.timeouts.watchdog_s)
                if judge and why is not None:
                    self.fail_device(d, why if slow else f"{why}: {e}")
                continue
            self._last_answer[d] = time.monotonic()
            self._misses.pop(d, None)
            if st.leaving and d not in self.doomed and decide.acts_on_notice(self.job):
                # Told to leave (SIGTERM with a grace period): a notice from the worker itself
                # (spec.preemptionPolicy Ignore: it is lost at its deadline, and recovered).
                self.log(f"device {d} is leaving ({st.leaving_in_seconds:.0f} s of its grace "
                         "period left): switching it out")
                self.notice(d, st.leaving_in_seconds)
            if st.state == State.FAILED and judge:
                raise JobFailed(f"device {d} failed: {st.error}")
            states.append(st.state)
            if st.state == State.TRAINING:
                waits[d] = st.collective_wait_seconds
            self._ingest(d, st)
        if not judge:
            return p
        self._find_hung(waits)
        if State.INTERRUPTED in states:
            if self.interrupted_since is None:
                self.interrupted_since = time.monotonic()
        else:
            self.interrupted_since = None
        if states and not self.failed:
            p.finished = all(s == State.FINISHED for s in states)
        return p

    def _find_hung(self, waits: dict[int, float]) -> None:
        """The watchdog's second case: members that answer Status but make no progress. When
        the job has trained no step for the watchdog's time (or three steps' time, if steps
        are longer), the members that have waited in a collective for half of it are waiting
        for the ones that wait for nothing: those hang (stuck outside any collective) and are
        declared failed. When every member waits, the hang is inside the collectives and no
        one can be blamed: the collective timeout ends it."""
        limit = max(self.timeouts.watchdog_s, 3 * self._step_seconds)
        stalled = time.monotonic() - self._last_step_at
        if self.layout is None:
            return
        waiting = sorted(d for d, w in waits.items() if w >= limit / 2)
        for d in decide.hung(waits, stalled_s=stalled, limit_s=limit):
            self.fail_device(d, f"hung: no step for {stalled:.1f} s while devices {waiting} "
                                f"wait for it in a collective (watchdog {limit:g} s)")

    def _ingest(self, device: int, st) -> None:
        p = self.progress
        for rec in st.steps:
            if rec.step <= self._seen.get(device, 0):
                continue
            self._seen[device] = rec.step
            if rec.end_time:
                self.first_step_end.setdefault(rec.generation, rec.end_time)
            if rec.end_time and self.step_times is not None:
                key = (rec.generation, rec.step)
                start, end = rec.end_time - rec.seconds, rec.end_time
                if key in self.step_times:
                    was = self.step_times[key]
                    start, end = min(start, was[0]), max(end, was[1])
                self.step_times[key] = (start, end)
            p.losses.setdefault(rec.step, rec.loss)
            if rec.end_time:
                p.timeline[rec.step] = (rec.end_time, rec.tokens_per_second)
            if rec.sample_end > rec.sample_begin:
                p.reads.setdefault(rec.step, {})[device] = (rec.sample_begin, rec.sample_end)
            if rec.step >= p.step:
                if rec.step > p.step:
                    self._last_step_at = time.monotonic()
                    self._step_seconds = rec.seconds
                p.step, p.loss, p.tokens_per_second = rec.step, rec.loss, rec.tokens_per_second

    def _drop_unreachable(self, devices) -> bool:
        """Ask each device for its Status; fail (members) or drop (others) those that do not
        answer. True if any was gone."""
        gone = False
        for d in sorted(devices):
            client = self.clients.get(d)
            if client is None:           # failed, or removed while the switch ran
                gone = True
                continue
            try:
                client.status(since_step=1 << 62, timeout_s=self.timeouts.watchdog_s)
            except AgentCallError as e:
                gone = True
                if d in self.members:
                    self.fail_device(d, f"stopped answering during a switch: {e}")
                else:
                    self.log(f"device {d} is gone: {e}")
                    self.remove_device(d)
        return gone

    def _run_switch(self, generation: int, old: Layout | None, new: Layout, reason: str,
                    involved, **kw) -> SwitchRecord:
        """One two-phase switch, watching for signals while it waits (see :meth:`_watch`)."""
        self._in_switch = (set(involved), new, reason)
        try:
            return switch(dict(self.clients), generation, old, new, self.rendezvous,
                          reason=reason, timeouts=self.timeouts,
                          devices_per_node=self.devices_per_node, watch=self._watch,
                          device_nodes=dict(self.device_nodes), **kw)
        except SwitchFailed:
            for d, why in self._exits_in_switch.items():      # they left nothing behind
                if d in self.members and d not in self.failed:
                    self._mark_failed(d, why)
            raise
        finally:
            self._in_switch = None
            self._exits_in_switch.clear()
            for client in self._to_close:
                client.close()
            self._to_close.clear()

    def _switch(self, new: Layout, reason: str) -> SwitchRecord | None:
        old = self.layout
        last_error = None
        if self.before_switch is not None:
            self.before_switch(old, new, reason)
        involved = set(old.device_of if old else ()) | set(new.device_of)
        self._decided(reason, new)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            self.generation += 1
            kw = {"checkpoint": self.resume_from} if old is None and self.resume_from else {}
            try:
                record = self._run_switch(self.generation, old, new, reason, involved, **kw)
            except SwitchFailed as e:
                last_error = e
                self.metrics.observe_switch(reason, "aborted" if e.retryable else "failed",
                                            {}, 0)
                if e.superseded:
                    self.log(f"switch {_text(old)} -> {new.to_text()} ({reason}) superseded "
                             f"while preparing: {e}; deciding again")
                    return None
                if self._drop_unreachable(involved):
                    # A device died under the switch: the next tick recovers (or re-plans)
                    # with the devices left; retrying this switch would fail again.
                    self.log(f"switch to {new.to_text()} failed because a device is gone: {e}")
                    return None
                if not e.retryable:
                    raise JobFailed(f"switch {_text(old)} -> {new.to_text()} ({reason}) "
                                    f"failed: {e}") from e
                self.log(f"switch to {new.to_text()} aborted (attempt {attempt} of "
                         f"{MAX_ATTEMPTS}): {e}")
                time.sleep(min(2.0, 0.25 * 2 ** attempt))
                continue
            record.attempts = attempt
            if kw:
                self.log(f"started from checkpoint {self.resume_from} at step {record.step}")
                if not self.progress.reads:
                    self.progress.first_step = record.step
                self._rewind(record.step)
                self.resume_from = ""
            self._after_switch(old, new, record)
            return record
        raise JobFailed(f"switch {_text(old)} -> {new.to_text()} ({reason}) failed "
                        f"{MAX_ATTEMPTS} times; last error: {last_error}")

    # -- recovery from unplanned failures ----------------------------------------------------------
    def _recover(self) -> SwitchRecord | None:
        """Bring the job back after devices died without notice: a new layout over the
        devices left, started from the last step whose state survives in memory (every
        survivor's snapshot; the failed devices' unique state from their buddies' mirrors), or
        from the newest checkpoint when no in-memory copy survives."""
        if self._reconcile() and not self.failed and self.interrupted_since is None:
            self.metrics.set_layout(self.layout)
            self.metrics.set_generation(self.generation_running)
            return None                    # the survivors train on: nothing to recover
        old, failed = self.layout, tuple(sorted(self.failed & set(self.members)))
        t0 = time.monotonic()
        try:
            decision = self.policy.decide(self.job, self.profile, old, self.usable,
                                          set(self.doomed) | set(failed), self.progress.step)
        except SolverError as e:
            raise JobFailed(f"devices {list(failed)} failed and no layout fits the "
                            f"{len(self.usable)} devices left: {e}") from e
        new = decision.layout if decision is not None else old
        self._decided("failure", new)
        holdings = {}
        for d in sorted(set(self.clients) & (set(old.device_of) | set(new.device_of)
                                             | set(self.previous_devices))):
            try:
                holdings[d] = self.clients[d].status(since_step=self._seen.get(d, 0),
                                                     timeout_s=self.timeouts.watchdog_s)
            except AgentCallError as e:
                # Lost too: recover again over the devices that answer.
                self.fail_device(d, f"does not answer during the recovery from the failure "
                                    f"of devices {list(failed)}: {e}")
                return None
            if d in old.device_of:
                self._ingest(d, holdings[d])        # steps reported since the last poll
        choice = choose_restore(self.job.model, old, new, failed, holdings,
                                devices_per_node=self._nodes_for(old, new))
        start, dead, earlier = old, failed, ""
        if choice is None:
            found = self._previous_restore(new, holdings)
            if found is not None:
                start, dead, choice = found
                earlier = (f" of the generation before the last switch ({start.to_text()} on "
                           f"{list(start.device_of)}; the running one has no whole copy yet)")
        lost_from = self.progress.step
        self.generation += 1
        if choice is not None:
            restore = Restore(choice[0], dead, choice[1])
            what = (f"restoring step {restore.step}{earlier} from memory"
                    + (f" (mirrors of {sorted(restore.proxies)} on "
                       f"{[restore.proxies[k] for k in sorted(restore.proxies)]})"
                       if restore.proxies else ""))
            self.log(f"recovering: {_text(old)} -> {new.to_text()}, {what}")
            kw = dict(restore=restore)
        else:
            ckpt = max(((st.checkpoint_step, st.checkpoint) for st in holdings.values()
                        if st.checkpoint), default=None)
            if ckpt is None:
                raise JobFailed(
                    f"devices {list(failed)} failed and no copy of their state survives in "
                    f"memory (their buddies are gone too, or spec.recovery.mirror is off), and "
                    f"there is no checkpoint to fall back on (set spec.checkpoint."
                    f"intervalSteps); the job stops at step {self.progress.step}")
            self.log(f"recovering: no in-memory copy of the state of {list(failed)} survives; "
                     f"restarting {new.to_text()} from checkpoint {ckpt[1]} (step {ckpt[0]})")
            kw = dict(checkpoint=ckpt[1])
            start = None
        involved = (set(start.device_of if start else old.device_of) | set(new.device_of)) \
            - set(dead)
        try:
            record = self._run_switch(self.generation, start, new, "failure", involved, **kw)
        except SwitchFailed as e:
            self.metrics.observe_switch("failure", "aborted" if e.retryable else "failed",
                                        {}, 0)
            if e.superseded or (e.retryable and self._drop_unreachable(involved)):
                # A newer signal (another device lost, a notice on the target): recover again
                # at once over what is left; the snapshots are still there.
                self.log(f"recovery {_text(old)} -> {new.to_text()} superseded while "
                         f"preparing: {e}; recovering again")
                return None
            raise JobFailed(f"recovery {_text(old)} -> {new.to_text()} failed: {e}") from e
        record.from_layout = _text(old)
        record.phases["recovery_seconds"] = time.monotonic() - t0
        record.phases["restored_step"] = record.step
        record.phases["lost_steps"] = max(0, lost_from - record.step)
        record.phases["from_checkpoint"] = 0.0 if choice is not None else 1.0
        self._rewind(record.step)
        self._infer_unreported_reads(record.step)
        req = self.pending_request()
        if req is not None and not req.layout.same_shape(new):
            self._answer(req, "pending", f"superseded by the failure of devices "
                         f"{list(failed)} (recovered to {new.to_text()} at step "
                         f"{record.step}): re-requested after the recovery")
        self._after_switch(old, new, record)
        self.failed.clear()
        self.interrupted_since = None
        self.recoveries.append(record)
        return record

    def _previous_restore(self, new: Layout, holdings: dict):
        """Recovery from the generation before the running one, whose snapshots its members
        keep for two steps after a planned switch: (its layout, its devices that are gone,
        (step, proxies)), or None. The way back when the running generation holds no whole
        copy yet (a member that just joined and has not mirrored its state, a new stage)."""
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
        dead = tuple(sorted(d for d in prev.device_of if d not in held))
        choice = choose_restore(self.job.model, prev, new, dead, held,
                                devices_per_node=self._nodes_for(prev, new))
        return (prev, dead, choice) if choice is not None else None

    def _nodes_for(self, *layouts: Layout) -> dict[int, str] | int:
        """The node map to plan a switch between ``layouts`` on (:mod:`dynatrain.vps.topology`):
        the real nodes when every device of them has a known one, else ``devices_per_node``
        (a partial map would count each unknown device as a node of its own)."""
        devices = {d for layout in layouts for d in layout.device_of}
        if devices and devices <= self.device_nodes.keys():
            return {d: self.device_nodes[d] for d in sorted(devices)}
        return self.devices_per_node

    def _infer_unreported_reads(self, step: int) -> None:
        """The restored state is the result of every step up to ``step``, each of which
        all-reduced the gradients of its whole global batch: so every sample of those steps
        was read, whether or not its reader's report reached the controller (a device that
        died between finishing a step and the next Status poll takes its last records with
        it). Such samples are kept apart as *inferred* and named in the log."""
        for k, gaps in self.progress.infer(step, self.job.global_batch_size).items():
            self.log(f"step {k}: samples {gaps} were read by a device that failed before "
                     f"reporting them; counted from the restored state of step {step}")

    def _reconcile(self) -> bool:
        """A switch the controller saw fail may have completed on every survivor (the device
        that died had already done its part): then they run the new generation, and the
        recovery starts from that, not from the layout the controller last recorded."""
        from dynatrain.vps.layout import parse_layout

        seen = []
        for d in sorted(self.clients):
            try:
                st = self.clients[d].status(since_step=1 << 62,
                                            timeout_s=self.timeouts.status_s)
            except AgentCallError:
                continue
            if st.layout and st.state in (State.TRAINING, State.FINISHED, State.INTERRUPTED):
                seen.append((st.generation, st.layout, tuple(st.devices)))
        if not seen:
            return False
        generation, text, devices = max(seen)
        if generation > self.generation_running and self.layout is not None \
                and (text, devices) != (self.layout.to_text(), tuple(self.layout.device_of)):
            new = parse_layout(text).with_devices(devices)
            self.log(f"generation {generation} ({new.to_text()} on {list(devices)}) completed "
                     "on the survivors; recovering from it")
            self.failed = {d for d in self.failed if d in devices}
            for d in devices:                 # gone before it was a member on record
                if d not in self.clients and d not in self.failed:
                    self._mark_failed(d, "lost while the switch to generation "
                                         f"{generation} completed")
            self.previous_devices = tuple(self.layout.device_of)
            self.layout, self.generation_running = new, generation
            return True
        return False

    def _rewind(self, step: int) -> None:
        """Forget progress after ``step``: those steps are trained again."""
        p = self.progress
        p.retrained += max(0, p.step - step)
        p.step = step
        p.losses = {k: v for k, v in p.losses.items() if k <= step}
        p.reads = {k: v for k, v in p.reads.items() if k <= step}
        p.inferred = {k: v for k, v in p.inferred.items() if k <= step}
        p.loss = p.losses.get(step)
        self._seen = {d: min(v, step) for d, v in self._seen.items()}

    def _after_switch(self, old: Layout | None, new: Layout, record: SwitchRecord) -> None:
        # Read what leavers did up to the switch before they exit (their last Status).
        for d in sorted(set(old.device_of if old else ()) - set(new.device_of) - self.failed):
            try:
                if d in self.clients:
                    self._ingest(d, self.clients[d].status(since_step=self._seen.get(d, 0),
                                                           timeout_s=self.timeouts.status_s))
            except AgentCallError:
                pass
        self.previous_devices = tuple(old.device_of) if old is not None else ()
        self.layout = new
        self.generation_running = record.generation
        for d in new.device_of:          # a newcomer's first record is of the step after this
            self._seen.setdefault(d, record.step)
        self._last_step_at = time.monotonic()
        req = self.pending_request()
        if req is not None and req.layout.same_shape(new):
            self._answer(req, "applied", f"applied at step {record.step} ({record.reason})",
                         step=record.step)
        self.metrics.set_layout(new)
        self.metrics.set_generation(self.generation)
        self._report_workers()
        if old is not None:          # the first generation is a start, not a switch
            self.switches.append(record)
            self.metrics.observe_switch(record.reason, "success",
                                        {"prepare": record.prepare_seconds,
                                         "pause": record.pause_seconds,
                                         "transfer": record.transfer_seconds}, record.bytes)


def _text(layout: Layout | None) -> str:
    return layout.to_text() if layout else "nothing"

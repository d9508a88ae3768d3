"""The controller core: one job's devices, its running generation, and the switches between.

Both front ends drive a :class:`JobController` the same way: they push what they saw into its
inbox as typed events (:mod:`.inbox`: a device up, a notice, a device left or failed, a spec
edit, a layout request; :meth:`JobController.push`) and call :meth:`tick` often. The controller
takes its inbox in at points of its own (:meth:`JobController.take_in`): at the start of each
tick, and while a switch waits. A tick reads every member's progress over the agents' Status
(steps, losses, the samples each data reader consumed), asks the :class:`~.policy.Policy`
whether to switch, and runs the two-phase switch (:mod:`.orchestrator`) when it says so,
retrying a failed Prepare with a fresh generation. The controller never touches training state
itself; it only talks to agents.

Signals never wait behind a switch: while one is being prepared or committed, the controller
keeps reading progress, asks the front end to look again (:attr:`JobController.sense`, which
only pushes events) and takes its inbox in, and a Prepare whose target a newer signal made
wrong (a device lost, a notice on a device of the target, a user's request over a voluntary
switch) is aborted and re-planned at once; a signal that does not conflict is merged into the
next decision. Every requested layout is answered (:class:`LayoutRequest`): applied, waiting
for capacity with the reason, superseded, or refused with the solver's reason.

The controller keeps the job's state and its switch machinery here; three roles that work on
that state live beside it as functions of the controller: reading progress and the watchdog
(:mod:`.polling`), recovery after devices die without notice (:mod:`.recovery`), and taking
over a running job after a restart (:mod:`.adopt`). :class:`JobFailed` and
:class:`SuspendFailed` are defined in :mod:`.errors` and importable from here as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from dynatrain.agent.client import AgentCallError, AgentClient
from dynatrain.agent.metrics import REASONS, Metrics
from dynatrain.agent.v1 import agent_pb2 as pb
from dynatrain.vps.layout import Layout
from dynatrain.vps.topology import DEFAULT_DEVICES_PER_NODE

from . import decide, feedback, measured, polling, recovery, suspend
from . import inbox as ev
from .suspend import Parked
from dynatrain.spec.hardware import DeviceProfile
from dynatrain.spec.job import JobSpec
from .adopt import adopt as _adopt
from .errors import JobFailed, SuspendFailed, layout_text as _text
from .orchestrator import SwitchFailed, SwitchRecord, Timeouts, switch
from .costmodel import Estimate, SolverError, estimate
from .policy import Policy, estimate_kwargs
from .progress import Progress
from .share import Share

State = pb.StatusResponse.State
MAX_ATTEMPTS = 3


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
        self.slow: set[int] = set()
        """Devices left out for computing slower than their peers (:mod:`.straggler`): never
        usable again; the front ends stop their workers (the local runner) or delete their
        pods (the operator)."""
        self.layout: Layout | None = None
        self.generation = 0
        self.generation_running = 0
        """The generation of :attr:`layout` (``generation`` counts every one started)."""
        self.switches: list[SwitchRecord] = []
        self.progress = Progress()
        self._seen: dict[int, int] = {}
        self.share: Share | None = None
        """This job's share of a pool shared with other jobs (:mod:`.share`), where the front
        end divides one (the operator); None: nothing bounds it but its own spec."""
        self.device_speeds: dict[int, float] = {}
        """device -> FLOP/s of its GPU, where the front end knows it (:mod:`.mixed`)."""
        self.device_nodes: dict[int, str] = {}
        """device -> the node it runs on, where the front end knows it (a cluster's pods'
        ``spec.nodeName``): a rank's mirror goes to another node. A device never moves."""
        self.failed: set[int] = set()
        """Devices of the running layout that died without notice (recovery pending)."""
        self.lost: list[int] = []
        """Every device that ever failed (the operator replaces their pods), in order."""
        self.lost_why: dict[int, str] = {}
        """Why each device of :attr:`lost` was declared failed."""
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
        self.wait_below_minimum = False
        """True: notices that leave fewer devices than the minimum park the job at a
        checkpoint (:attr:`parked`) instead of failing it; set by a front end that can hold a
        job without workers and bring it back (the operator, with ``spec.checkpoint``)."""
        self.parked: Parked | None = None
        """The job parked: the front end removes its workers, clears this, and starts it again
        from that checkpoint once its minimum is back."""
        self.before_switch = None
        """Called with (old layout, new layout, reason) before a switch starts (the operator
        shows the job as Switching)."""
        self.inbox = ev.Inbox()
        """What the front end saw, as events (:mod:`.inbox`); taken in by :meth:`take_in`."""
        self.sense = None
        """The front end's ``sense()``: look at the world now and :meth:`push` what changed
        (notices, exits, joins, requests). Called while a switch waits, so that no signal
        waits behind it; it must only push (the controller takes the events in after it)."""
        self.costs = measured.StepCosts()
        """The running generation's measured step split, per device (:mod:`.measured`)."""
        self.measurements: dict[int, measured.Measurement] = {}
        """Generation -> its latest measurement against the cost model (refreshed each tick)."""
        self._predicted: tuple[int, Estimate | None] | None = None
        """(generation, the cost model's estimate for its layout), computed once."""
        self.feedback = feedback.Feedback()
        """The measured ratios fed back to the solver, and each shape's measured step."""
        self._last_pause_s = 1.0
        """The latest generation's pause (a start's included): what a switch is taken to cost
        the job, for the rebalance's payback (1 s before any)."""
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

    # -- the inbox -----------------------------------------------------------------------------
    def push(self, *events: ev.Event) -> None:
        """Report what the front end saw (:mod:`.inbox`); safe from any thread. Taken in at
        the next :meth:`take_in`: the next tick, or while a switch waits."""
        self.inbox.push(*events)

    def take_in(self) -> int:
        """Apply the inbox's events in the order they were pushed; returns how many. The
        controller does so at the start of each tick and while a switch waits; a front end
        may, between ticks, to read its own events' effect in the same pass."""
        events = self.inbox.take()
        for e in events:
            ev.apply(self, e)
        return len(events)

    # -- capacity ------------------------------------------------------------------------------
    def add_device(self, device: int, client: AgentClient) -> None:
        self.clients[device] = client
        self._last_answer[device] = time.monotonic()
        self._report_workers()

    def notice(self, device: int, seconds: float, *, at: float | None = None) -> None:
        """``device`` will be gone ``seconds`` after ``at`` (monotonic; default now): the
        running layout must leave it now."""
        self.doomed[device] = (time.monotonic() if at is None else at) + seconds
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
        self.lost_why[device] = why

    def restart_from(self, checkpoint: str, step: int) -> None:
        """Every worker was replaced (checkpoint-and-restart): start again from ``checkpoint``.
        What the inbox holds is taken in first: it is of the workers now gone."""
        self.take_in()
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
        """One checkpoint by every member, then no further training (``spec.suspend``, and a
        park): :func:`.suspend.suspend`."""
        return suspend.suspend(self)

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
    def leaving(self) -> frozenset[int]:
        """Members that the switch in flight takes out of the job. Their workers exit as their
        part ends, which a front end may see before the switch's record: they left, and are
        not to be replaced (if the switch then fails, :meth:`fail_device` counts the exit)."""
        if self._in_switch is None:
            return frozenset()
        return frozenset(self.members) - frozenset(self._in_switch[1].device_of)

    @property
    def usable(self) -> list[int]:
        return sorted(d for d in self.clients if d not in self.doomed and d not in self.slow)

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
        """Take over a job whose agents already run (the controller restarted): finish or abort
        a switch left between its phases. Returns what was found, for the log
        (:func:`.adopt.adopt`)."""
        return _adopt(self)

    # -- the loop --------------------------------------------------------------------------------
    def tick(self) -> SwitchRecord | None:
        """Read progress; act on what :func:`.decide.next_action` says. Returns the switch
        made, if any."""
        self.take_in()
        self.poll()
        self._measure()
        action = decide.next_action(self.view(), self.policy, self.job, self.decision_profile)
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
            return recovery.recover(self)
        if isinstance(action, decide.Park):
            suspend.park(self, action.why)
            return None
        if isinstance(action, decide.Refuse):
            self._refuse(req, action.why)
            return None
        if req is not None and isinstance(action, (decide.Idle, decide.Switch)) \
                and action.answer is not None:
            self._answer(req, action.answer.state, action.answer.text)
        if not isinstance(action, decide.Switch):
            return None
        decision = action.decision
        if decision.note:
            self.log(f"{decision.reason}: {decision.note}")
        record = self._switch(decision.layout, decision.reason)
        if record is not None and decision.reason in decide.VOLUNTARY:
            self.policy.record_voluntary()
        if record is not None and decision.left_out:
            self.slow.update(decision.left_out)          # never taken back (see usable)
        return record

    def _measure(self) -> None:
        """Refresh the running generation's measurement (:mod:`.measured`); log the first."""
        gen, layout = self.generation_running, self.layout
        if layout is None or self.costs.generation != gen:
            return
        if self._predicted is None or self._predicted[0] != gen:
            self._predicted = (gen, self._predict(layout))
        predicted = self._predicted[1]
        m = self.costs.measurement(layout, predicted.step_seconds if predicted else 0.0,
                                   predicted_memory=predicted.memory_bytes if predicted else 0)
        if m is None:
            return
        first = gen not in self.measurements
        self.measurements[gen] = m
        self.metrics.set_measured(m.step_seconds, m.predicted_seconds)
        self.feedback.add(gen, m, predicted)
        if first:
            self.log(str(m))
            if self.job.rebalance.enabled:     # once a generation: the figures move each step
                self.log(feedback.describe(self.feedback, gen))

    @property
    def decision_profile(self) -> DeviceProfile:
        """The profile decisions price layouts on: the job's, calibrated by its measurements
        when ``spec.parallelism.rebalance`` is on (:mod:`.feedback`)."""
        if not self.job.rebalance.enabled:
            return self.profile
        return feedback.calibrated(self.profile, self.feedback.factors)

    def _predict(self, layout: Layout) -> Estimate | None:
        """The cost model's estimate for ``layout`` on the job's profile (None: it has none,
        e.g. a layout the model cannot price)."""
        try:
            return estimate(self.job.model, layout, self.profile, **estimate_kwargs(self.job))
        except SolverError:
            return None

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
            wait_below_minimum=self.wait_below_minimum, speeds=dict(self.device_speeds),
            request=decide.Request(req.layout) if req is not None else None,
            measurement=self.measurements.get(self.generation_running),
            switch_cost_s=self._last_pause_s, measured_steps=dict(self.feedback.steps),
            share=self.share.workers if self.share is not None and self.share.contended
            else None)

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
        """While a switch waits: read progress, take in new signals (the front end pushes what
        it sees, then the inbox is taken in), and say whether the switch in flight is now
        wrong (its Prepare is then aborted and re-planned)."""
        self.poll(judge=False)
        if self.sense is not None:
            self.sense()
        self.take_in()
        if phase != "prepare" or self._in_switch is None:
            return None
        involved, new, reason = self._in_switch
        return decide.superseded(self.view(), decide.InFlight(frozenset(involved), new, reason),
                                 present=frozenset(self.clients))

    def poll(self, *, judge: bool = True) -> Progress:
        """Collect step records from every member, and declare failed the ones the watchdog
        finds stopped or hung; ``judge=False`` only reads progress (:func:`.polling.poll`)."""
        return polling.poll(self, judge=judge)

    def _ingest(self, device: int, st) -> None:
        polling.ingest(self, device, st)

    def _drop_unreachable(self, devices) -> bool:
        """Fail (members) or drop (others) the devices that do not answer Status
        (:func:`.polling.drop_unreachable`). True if any was gone."""
        return polling.drop_unreachable(self, devices)

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

    def _rewind(self, step: int) -> None:
        """Forget progress after ``step``: those steps are trained again."""
        self.progress.rewind(step)
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
        self._last_pause_s = record.pause_seconds
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

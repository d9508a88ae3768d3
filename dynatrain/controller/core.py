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

Decide, then execute: the job's state is one frozen value (:attr:`JobController.state`), and
only :func:`.jobstate.decide` changes it, one event at a time (:meth:`JobController._apply`).
The controller here is its executor: it keeps what is not a decision (the agents' connections,
progress and its audit, measurements) and does what the reducer returns: close a connection,
log, answer the front end, run a switch, a recovery or a park. Three roles of the executor
live beside it as functions of the controller: reading progress, whose Status answers and
failures go to the watchdog's rules as events (:mod:`.polling`), recovery after devices die
without notice (:mod:`.recovery`), and taking over a running job after a restart
(:mod:`.adopt`). :class:`JobFailed` and :class:`SuspendFailed` are defined in :mod:`.errors`
and importable from here as before.
"""

from __future__ import annotations

import time

from dynatrain.agent.client import AgentCallError, AgentClient
from dynatrain.agent.metrics import REASONS, Metrics
from dynatrain.agent.v1 import agent_pb2 as pb
from dynatrain.vps.layout import Layout
from dynatrain.vps.topology import DEFAULT_DEVICES_PER_NODE

from . import decide, feedback, measured, polling, recovery, suspend
from . import inbox as ev
from . import jobstate as js
from .jobstate import JobState, LayoutRequest  # noqa: F401 (importable from here as before)
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


class JobController:
    def __init__(self, job: JobSpec, *, rendezvous: str, profile: DeviceProfile,
                 metrics: Metrics | None = None, policy: Policy | None = None,
                 timeouts: Timeouts = Timeouts(),
                 devices_per_node: int = DEFAULT_DEVICES_PER_NODE, log=print):
        self.rendezvous, self.profile = rendezvous, profile
        self.state = JobState(job=job)
        """The job's state as one frozen value, changed only by :func:`.jobstate.decide`
        (:meth:`_apply`); front ends read it, and the properties below, as published."""
        self.metrics = metrics or Metrics(namespace=job.namespace, job=job.name,
                                          reasons=REASONS)
        self.policy = policy or Policy()
        self.timeouts, self.devices_per_node, self.log = timeouts, devices_per_node, log
        self.clients: dict[int, AgentClient] = {}
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
        self.decisions: list[dict] = []
        """Every switch or recovery started: the step it started at, why, and its target (how
        late a signal was acted on is read from these)."""
        self.on_answer = None
        """Called with a :class:`LayoutRequest` whenever its answer changes (the operator's
        condition and Event; the log line is written here)."""
        self._to_close: list[AgentClient] = []
        self.previous_devices: tuple[int, ...] = ()
        """Devices of the generation before the running one (their snapshots may be kept)."""
        self._last_step_at = time.monotonic()
        """When the job last trained a step (or switched): the give-up clock."""
        self._step_seconds = 0.0
        """The latest step's duration (the watchdog waits at least three of them)."""

    # -- the state, as published -----------------------------------------------------------------
    @property
    def job(self) -> JobSpec:
        return self.state.job

    @property
    def layout(self) -> Layout | None:
        return self.state.layout

    @property
    def doomed(self) -> dict[int, float]:
        """Device -> monotonic deadline by which it must have left the running layout."""
        return self.state.doomed

    @property
    def failed(self) -> frozenset[int]:
        """Devices of the running layout that died without notice (recovery pending)."""
        return self.state.failed

    @property
    def lost(self) -> list[int]:
        """Every device that ever failed (the operator replaces their pods), in order."""
        return [d for d, _ in self.state.lost]

    @property
    def lost_why(self) -> dict[int, str]:
        """Why each device of :attr:`lost` was declared failed."""
        return dict(self.state.lost)

    @property
    def slow(self) -> frozenset[int]:
        """Devices left out for computing slower than their peers (:mod:`.straggler`): never
        usable again; the front ends stop their workers (the local runner) or delete their
        pods (the operator)."""
        return self.state.slow

    @property
    def requests(self) -> tuple[LayoutRequest, ...]:
        return self.state.requests

    def pending_request(self) -> LayoutRequest | None:
        return self.state.pending_request

    @property
    def switching(self) -> bool:
        """A switch or recovery is in flight (signals are taken in meanwhile)."""
        return self.state.flight is not None

    @property
    def leaving(self) -> frozenset[int]:
        """Members that the switch in flight takes out of the job. Their workers exit as their
        part ends, which a front end may see before the switch's record: they left, and are
        not to be replaced (if the switch then fails, the exit counts as a failure)."""
        return self.state.leaving

    @property
    def usable(self) -> list[int]:
        return list(self.state.usable)

    @property
    def members(self) -> list[int]:
        return list(self.state.members)

    # -- decide, then execute ----------------------------------------------------------------------
    def _apply(self, event) -> tuple:
        """One event through :func:`.jobstate.decide`; the bookkeeping actions it returns are
        done here, the rest (a tick's decision, an abort) returned to the caller."""
        self.state, actions = js.decide(self.state, event)
        rest = []
        for a in actions:
            if isinstance(a, js.Close):
                client = self.clients.pop(a.device, None)
                if client is not None and a.later:
                    self._to_close.append(client)    # the switch in flight may still call it
                elif client is not None:
                    client.close()
            elif isinstance(a, js.Log):
                self.log(a.text)
            elif isinstance(a, js.Answered):
                if self.on_answer is not None:
                    self.on_answer(a.request)
            elif isinstance(a, js.Workers):
                self.metrics.set_workers(a.count)
            else:
                rest.append(a)
        return tuple(rest)

    def push(self, *events: ev.Event) -> None:
        """Report what the front end saw (:mod:`.inbox`); safe from any thread. Taken in at
        the next :meth:`take_in`: the next tick, or while a switch waits."""
        self.inbox.push(*events)

    def take_in(self) -> int:
        """Apply the inbox's events in the order they were pushed; returns how many. The
        controller does so at the start of each tick and while a switch waits; a front end
        may, between ticks, to read its own events' effect in the same pass."""
        events = self.inbox.take()
        if events:
            self._apply(js.Progressed(self.progress.step))
        for e in events:
            if not isinstance(e, ev.DeviceUp):
                self._apply(e)
                continue
            self.clients[e.device] = e.client    # the connection is the executor's to keep
            self._apply(e)
            self._apply(js.StatusAnswered(e.device, time.monotonic()))   # the watchdog's clock
        return len(events)

    def reconnect(self, fresh: dict[int, AgentClient]) -> list[AgentClient]:
        """Replace the connections to these devices' agents (new TLS material), changing
        nothing the job decides on; returns the old ones, for the caller to close once no
        switch holds them."""
        old = [self.clients[d] for d in fresh if d in self.clients]
        self.clients.update({d: cl for d, cl in fresh.items() if d in self.clients})
        return old

    def restart_from(self, checkpoint: str, step: int) -> None:
        """Every worker was replaced (checkpoint-and-restart): start again from ``checkpoint``.
        What the inbox holds is taken in first: it is of the workers now gone."""
        self.take_in()
        self._apply(js.Restarted())
        self.generation_running = 0          # none runs (the count goes on: ``generation``)
        self.interrupted_since = None
        self.resume_from = checkpoint
        self._rewind(step)
        self._seen.clear()

    def suspend(self) -> tuple[str, int]:
        """One checkpoint by every member, then no further training (``spec.suspend``, and a
        park): :func:`.suspend.suspend`."""
        return suspend.suspend(self)

    def reported_step(self) -> int:
        """The last step every live member has reported, its reads included. Members finish a
        step together but their records arrive one Status call apart, so a step after this one
        may still lack a reader's record: an audit stops here rather than call it unread."""
        live = [self._seen.get(d, 0) for d in self.members if d not in self.failed]
        return min([self.progress.step] + live)

    # -- taking over a running job ---------------------------------------------------------------
    def adopt(self) -> str:
        """Take over a job whose agents already run (the controller restarted): finish or abort
        a switch left between its phases. Returns what was found, for the log
        (:func:`.adopt.adopt`)."""
        return _adopt(self)

    # -- the loop --------------------------------------------------------------------------------
    def tick(self) -> SwitchRecord | None:
        """Read progress; act on what :func:`.jobstate.decide` makes of the tick (the rules of
        :func:`.decide.next_action`). Returns the switch made, if any."""
        self.take_in()
        self.poll()
        self._measure()
        self._apply(js.Progressed(self.progress.step))
        for action in self._apply(self._tick_event()):
            if isinstance(action, decide.GiveUp):
                raise JobFailed(action.why)
            if isinstance(action, decide.Recover):
                return recovery.recover(self)
            if isinstance(action, decide.Park):
                suspend.park(self, action.why)
                return None
            if isinstance(action, decide.Switch):
                decision = action.decision
                if decision.note:
                    self.log(f"{decision.reason}: {decision.note}")
                record = self._switch(decision.layout, decision.reason)
                if record is not None and decision.reason in decide.VOLUNTARY:
                    self.policy.record_voluntary()
                if record is not None and decision.left_out:
                    self._apply(js.LeftOut(frozenset(decision.left_out)))
                return record
        return None

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

    def _tick_event(self) -> js.Tick:
        """The executor's facts at this instant, for a decision (:class:`.jobstate.Tick`)."""
        return js.Tick(
            now=time.monotonic(), policy=self.policy, profile=self.decision_profile,
            finished=self.progress.finished, last_step_at=self._last_step_at,
            give_up_s=self.timeouts.give_up_s, interrupted_since=self.interrupted_since,
            recover_in_memory=self.recover_in_memory,
            wait_below_minimum=self.wait_below_minimum,
            speeds=tuple(sorted(self.device_speeds.items())),
            measurement=self.measurements.get(self.generation_running),
            switch_cost_s=self._last_pause_s,
            measured_steps=tuple(sorted(self.feedback.steps.items())),
            share=self.share.workers if self.share is not None and self.share.contended
            else None)

    def view(self) -> decide.View:
        """The controller's state as the values :mod:`.decide` reads."""
        return js.view(self.state, self._tick_event())

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
        if phase != "prepare":
            return None
        aborts = self._apply(js.Watch(time.monotonic()))
        return aborts[0].why if aborts else None

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
        self._apply(js.SwitchBegan(frozenset(involved), new, reason))
        ok = False
        try:
            record = switch(dict(self.clients), generation, old, new, self.rendezvous,
                            reason=reason, timeouts=self.timeouts,
                            devices_per_node=self.devices_per_node, watch=self._watch,
                            device_nodes=dict(self.device_nodes), **kw)
            ok = True
            return record
        finally:
            self._apply(js.SwitchEnded(ok))
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
        return decide.node_map(self.device_nodes, self.devices_per_node, *layouts)

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

    def _after_switch(self, old: Layout | None, new: Layout, record: SwitchRecord, *,
                      recovered: bool = False, displaced: str = "") -> None:
        """The job runs ``new`` (a switch, or a recovery: ``recovered``; ``displaced``, its
        answer to a pending request it did not meet)."""
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
        self._apply(js.Committed(new, record.step, record.reason, recovered, displaced))
        self.generation_running = record.generation
        for d in new.device_of:          # a newcomer's first record is of the step after this
            self._seen.setdefault(d, record.step)
        self._last_step_at = time.monotonic()
        self.metrics.set_layout(new)
        self.metrics.set_generation(self.generation)
        if old is not None:          # the first generation is a start, not a switch
            self.switches.append(record)
            self.metrics.observe_switch(record.reason, "success",
                                        {"prepare": record.prepare_seconds,
                                         "pause": record.pause_seconds,
                                         "transfer": record.transfer_seconds}, record.bytes)

"""The controller core: one job's devices, its running generation, and the switches between.

Both front ends drive a :class:`JobController` the same way: they report capacity
(:meth:`add_device`, :meth:`notice`, :meth:`remove_device`) and call :meth:`tick` often. A
tick reads every member's progress over the agents' Status (steps, losses, the samples each
data reader consumed), asks the :class:`~.policy.Policy` whether to switch, and runs the
two-phase switch (:mod:`.orchestrator`) when it says so, retrying a failed Prepare with a fresh
generation. The controller never touches training state itself; it only talks to agents.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from dynatrain.agent.client import AgentCallError, AgentClient
from dynatrain.agent.metrics import REASONS, Metrics
from dynatrain.agent.v1 import agent_pb2 as pb
from dynatrain.vps.layout import Layout

from .job import JobSpec
from .orchestrator import SwitchFailed, SwitchRecord, Timeouts, switch
from .policy import Policy
from .solver import DeviceProfile, SolverError

State = pb.StatusResponse.State
MAX_ATTEMPTS = 3


class JobFailed(RuntimeError):
    """The job cannot go on; the message says why and what was tried."""


@dataclass
class Progress:
    step: int = 0
    loss: float | None = None
    tokens_per_second: float = 0.0
    losses: dict[int, float] = field(default_factory=dict)
    samples: list[tuple[int, int]] = field(default_factory=list)
    """Every [begin, end) a data reader consumed, as reported (for exactly-once accounting)."""
    finished: bool = False


class JobController:
    def __init__(self, job: JobSpec, *, rendezvous: str, profile: DeviceProfile,
                 metrics: Metrics | None = None, policy: Policy | None = None,
                 timeouts: Timeouts = Timeouts(), devices_per_node: int = 8, log=print):
        self.job, self.rendezvous, self.profile = job, rendezvous, profile
        self.metrics = metrics or Metrics(reasons=REASONS)
        self.policy = policy or Policy()
        self.timeouts, self.devices_per_node, self.log = timeouts, devices_per_node, log
        self.clients: dict[int, AgentClient] = {}
        self.doomed: dict[int, float] = {}
        """Device -> monotonic deadline by which it must have left the running layout."""
        self.layout: Layout | None = None
        self.generation = 0
        self.switches: list[SwitchRecord] = []
        self.progress = Progress()
        self._seen: dict[int, int] = {}
        self.before_switch = None
        """Called with (old layout, new layout, reason) before a switch starts (the operator
        shows the job as Switching)."""

    # -- capacity ------------------------------------------------------------------------------
    def add_device(self, device: int, client: AgentClient) -> None:
        self.clients[device] = client
        self._report_workers()

    def notice(self, device: int, seconds: float) -> None:
        """``device`` will be gone in ``seconds``: the running layout must leave it now."""
        self.doomed[device] = time.monotonic() + seconds
        self._report_workers()

    def remove_device(self, device: int) -> None:
        client = self.clients.pop(device, None)
        if client is not None:
            client.close()
        self.doomed.pop(device, None)
        self._report_workers()

    def request_layout(self, layout: Layout) -> None:
        """A user asked for this layout (``parallelism.mode: fixed``)."""
        self.job = replace(self.job, mode="fixed", layout=layout)

    @property
    def usable(self) -> list[int]:
        return sorted(d for d in self.clients if d not in self.doomed)

    @property
    def members(self) -> list[int]:
        return list(self.layout.device_of) if self.layout else []

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
        self.generation = max([st.generation for st in statuses.values()]
                              + [st.prepared_generation for st in statuses.values()] + [0])
        if not running:
            return "no running generation: starting fresh"
        top = max(st.generation for st in running)
        lead = next(st for st in running if st.generation == top and st.layout)
        from dynatrain.vps.layout import parse_layout

        self.layout = parse_layout(lead.layout).with_devices(lead.devices)
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
        """Read progress; switch if the policy says so. Returns the switch made, if any."""
        self.poll()
        if self.progress.finished:
            return None
        try:
            decision = self.policy.decide(self.job, self.profile, self.layout, self.usable,
                                          set(self.doomed), self.progress.step)
        except SolverError as e:
            if self.layout is None or set(self.doomed) & set(self.members):
                raise JobFailed(f"no layout fits the devices left: {e}") from e
            return None
        if decision is None:
            return None
        record = self._switch(decision.layout, decision.reason)
        if decision.reason in ("scale-up", "better-layout"):
            self.policy.record_voluntary()
        return record

    def poll(self) -> Progress:
        """Collect step records from every member (each reports its own data reads)."""
        p = self.progress
        states = []
        for d in self.members:
            try:
                st = self.clients[d].status(since_step=self._seen.get(d, 0))
            except AgentCallError as e:
                raise JobFailed(f"device {d} stopped answering: {e}") from e
            if st.state == State.FAILED:
                raise JobFailed(f"device {d} failed: {st.error}")
            states.append(st.state)
            self._ingest(d, st)
        if states:
            p.finished = all(s == State.FINISHED for s in states)
        return p

    def _ingest(self, device: int, st) -> None:
        p = self.progress
        for rec in st.steps:
            if rec.step <= self._seen.get(device, 0):
                continue
            self._seen[device] = rec.step
            p.losses.setdefault(rec.step, rec.loss)
            if rec.sample_end > rec.sample_begin:
                p.samples.append((rec.sample_begin, rec.sample_end))
            if rec.step >= p.step:
                p.step, p.loss, p.tokens_per_second = rec.step, rec.loss, rec.tokens_per_second

    def _switch(self, new: Layout, reason: str) -> SwitchRecord:
        old = self.layout
        last_error = None
        if self.before_switch is not None:
            self.before_switch(old, new, reason)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            self.generation += 1
            try:
                record = switch(self.clients, self.generation, old, new, self.rendezvous,
                                reason=reason, timeouts=self.timeouts,
                                devices_per_node=self.devices_per_node)
            except SwitchFailed as e:
                last_error = e
                self.metrics.observe_switch(reason, "aborted" if e.retryable else "failed",
                                            {}, 0)
                if not e.retryable:
                    raise JobFailed(f"switch {_text(old)} -> {new.to_text()} ({reason}) "
                                    f"failed: {e}") from e
                self.log(f"switch to {new.to_text()} aborted (attempt {attempt} of "
                         f"{MAX_ATTEMPTS}): {e}")
                time.sleep(min(2.0, 0.25 * 2 ** attempt))
                continue
            record.attempts = attempt
            self._after_switch(old, new, record)
            return record
        raise JobFailed(f"switch {_text(old)} -> {new.to_text()} ({reason}) failed "
                        f"{MAX_ATTEMPTS} times; last error: {last_error}")

    def _after_switch(self, old: Layout | None, new: Layout, record: SwitchRecord) -> None:
        # Read what leavers did up to the switch before they exit (their last Status).
        for d in sorted(set(old.device_of if old else ()) - set(new.device_of)):
            try:
                self._ingest(d, self.clients[d].status(since_step=self._seen.get(d, 0)))
            except AgentCallError:
                pass
        self.layout = new
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

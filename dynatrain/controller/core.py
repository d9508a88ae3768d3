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

from .costmodel import SolverError
from .hardware import DeviceProfile
from .job import JobSpec
from .orchestrator import Restore, SwitchFailed, SwitchRecord, Timeouts, switch
from .policy import Policy

State = pb.StatusResponse.State
MAX_ATTEMPTS = 3
INTERRUPT_GRACE_S = 1.0
"""How long members may report INTERRUPTED before the controller recovers without knowing
which device failed (normally the runner or the cluster names it within milliseconds)."""


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
    first_step: int = 0
    """The step the job started from (a checkpoint's); samples before it are not this run's."""


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
        self.generation_running = 0
        """The generation of :attr:`layout` (``generation`` counts every one started)."""
        self.switches: list[SwitchRecord] = []
        self.progress = Progress()
        self._seen: dict[int, int] = {}
        self.failed: set[int] = set()
        """Devices of the running layout that died without notice (recovery pending)."""
        self.lost: list[int] = []
        """Every device that ever failed (the operator replaces their pods)."""
        self.interrupted_since: float | None = None
        self.recoveries: list[SwitchRecord] = []
        self.first_step_end: dict[int, float] = {}
        """Generation -> wall time at which its first step ended (recovery time is measured
        up to it)."""
        self.resume_from = ""
        """A checkpoint the job's first generation starts from (any layout)."""
        self.recover_in_memory = True
        """False: leave failures to the front end (the local runner's restart mode)."""
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

    def fail_device(self, device: int, why: str) -> None:
        """``device`` died without notice (a crash, a lost node): the next tick recovers."""
        if device in self.members and device not in self.failed:
            self.log(f"device {device} failed: {why}")
            self.failed.add(device)
            self.lost.append(device)
        self.remove_device(device)

    def restart_from(self, checkpoint: str, step: int) -> None:
        """Every worker was replaced (checkpoint-and-restart): start again from ``checkpoint``."""
        for client in self.clients.values():
            client.close()
        self.clients.clear()
        self.doomed.clear()
        self.failed.clear()
        self.layout = None
        self.interrupted_since = None
        self.resume_from = checkpoint
        self._rewind(step)
        self._seen.clear()
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
        """Read progress; switch if the policy says so. Returns the switch made, if any."""
        self.poll()
        if self.progress.finished:
            return None
        if self.failed or self._interrupted_long_enough():
            if not self.recover_in_memory:
                return None          # the front end restarts the job (checkpoint-and-restart)
            return self._recover()
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
            if d in self.failed:
                continue
            try:
                st = self.clients[d].status(since_step=self._seen.get(d, 0))
            except AgentCallError as e:
                self.fail_device(d, f"stopped answering: {e}")
                continue
            if st.state == State.FAILED:
                raise JobFailed(f"device {d} failed: {st.error}")
            states.append(st.state)
            self._ingest(d, st)
        if State.INTERRUPTED in states:
            if self.interrupted_since is None:
                self.interrupted_since = time.monotonic()
        else:
            self.interrupted_since = None
        if states and not self.failed:
            p.finished = all(s == State.FINISHED for s in states)
        return p

    def _interrupted_long_enough(self) -> bool:
        return (self.interrupted_since is not None
                and time.monotonic() - self.interrupted_since > INTERRUPT_GRACE_S)

    def _ingest(self, device: int, st) -> None:
        p = self.progress
        for rec in st.steps:
            if rec.step <= self._seen.get(device, 0):
                continue
            self._seen[device] = rec.step
            if rec.end_time:
                self.first_step_end.setdefault(rec.generation, rec.end_time)
            p.losses.setdefault(rec.step, rec.loss)
            if rec.sample_end > rec.sample_begin:
                p.samples.append((rec.sample_begin, rec.sample_end))
            if rec.step >= p.step:
                p.step, p.loss, p.tokens_per_second = rec.step, rec.loss, rec.tokens_per_second

    def _drop_unreachable(self, devices) -> bool:
        """Ask each device for its Status; fail (members) or drop (others) those that do not
        answer. True if any was gone."""
        gone = False
        for d in sorted(devices):
            client = self.clients.get(d)
            if client is None:
                gone = gone or d in self.failed
                continue
            try:
                client.status(since_step=1 << 62)
            except AgentCallError as e:
                gone = True
                if d in self.members:
                    self.fail_device(d, f"stopped answering during a switch: {e}")
                else:
                    self.log(f"device {d} is gone: {e}")
                    self.remove_device(d)
        return gone

    def _switch(self, new: Layout, reason: str) -> SwitchRecord | None:
        old = self.layout
        last_error = None
        if self.before_switch is not None:
            self.before_switch(old, new, reason)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            self.generation += 1
            kw = {"checkpoint": self.resume_from} if old is None and self.resume_from else {}
            try:
                record = switch(self.clients, self.generation, old, new, self.rendezvous,
                                reason=reason, timeouts=self.timeouts,
                                devices_per_node=self.devices_per_node, **kw)
            except SwitchFailed as e:
                last_error = e
                self.metrics.observe_switch(reason, "aborted" if e.retryable else "failed",
                                            {}, 0)
                if self._drop_unreachable(set(old.device_of if old else ()) | set(new.device_of)):
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
                if not self.progress.samples:
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
        holdings = {}
        for d in sorted(set(self.clients) & (set(old.device_of) | set(new.device_of))):
            try:
                holdings[d] = self.clients[d].status(since_step=self._seen.get(d, 0))
            except AgentCallError as e:
                raise JobFailed(f"recovering from the failure of devices {list(failed)}: "
                                f"device {d} does not answer either: {e}") from e
            if d in old.device_of:
                self._ingest(d, holdings[d])        # steps reported since the last poll
        choice = choose_restore(self.job.model, old, new, failed, holdings,
                                gpus_per_node=self.devices_per_node)
        lost_from = self.progress.step
        self.generation += 1
        if choice is not None:
            restore = Restore(choice[0], failed, choice[1])
            what = (f"restoring step {restore.step} from memory"
                    + (f" (mirrors of {sorted(restore.proxies)} on "
                       f"{[restore.proxies[k] for k in sorted(restore.proxies)]})"
                       if restore.proxies else ""))
            self.log(f"recovering: {_text(old)} -> {new.to_text()}, {what}")
            kw = dict(restore=restore)
            start = old
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
        try:
            record = switch(self.clients, self.generation, start, new, self.rendezvous,
                            reason="failure", timeouts=self.timeouts,
                            devices_per_node=self.devices_per_node, **kw)
        except SwitchFailed as e:
            self.metrics.observe_switch("failure", "failed", {}, 0)
            raise JobFailed(f"recovery {_text(old)} -> {new.to_text()} failed: {e}") from e
        record.from_layout = _text(old)
        record.phases["recovery_seconds"] = time.monotonic() - t0
        record.phases["restored_step"] = record.step
        record.phases["lost_steps"] = max(0, lost_from - record.step)
        record.phases["from_checkpoint"] = 0.0 if choice is not None else 1.0
        self._rewind(record.step)
        # The restored step (snapshot or checkpoint) includes every data reader's reads up
        # to it, whether or not their last reports reached the controller.
        self._account_unreported_reads(old, record.step)
        self._after_switch(old, new, record)
        self.failed.clear()
        self.interrupted_since = None
        self.recoveries.append(record)
        return record

    def _account_unreported_reads(self, old: Layout, step: int) -> None:
        """The restored state includes every step up to ``step``, so every data reader's reads
        of those steps happened, but not every step record reached the controller: a failed
        device's are gone with it, and a survivor can be interrupted between finishing a step
        (its snapshot exists) and publishing the step's record. Which samples a data reader
        reads is a function of the layout and the step alone (the first stage's TP rank 0 of
        DP index j reads its j-th share of the step's global batch), so the missing ones are
        accounted here exactly as the device would have reported them."""
        gbs = self.job.global_batch_size
        per_rank = gbs // old.dp
        for d in old.device_of:
            stage, j, t = old.coords(old.device_of.index(d))
            if stage != 0 or t != 0:
                continue
            for k in range(self._seen.get(d, 0) + 1, step + 1):
                start = (k - 1) * gbs + j * per_rank
                self.progress.samples.append((start, start + per_rank))
            self._seen[d] = step

    def _reconcile(self) -> bool:
        """A switch the controller saw fail may have completed on every survivor (the device
        that died had already done its part): then they run the new generation, and the
        recovery starts from that, not from the layout the controller last recorded."""
        from dynatrain.vps.layout import parse_layout

        seen = []
        for d in sorted(self.clients):
            try:
                st = self.clients[d].status(since_step=1 << 62)
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
            self.layout, self.generation_running = new, generation
            return True
        return False

    def _rewind(self, step: int) -> None:
        """Forget progress after ``step``: those steps are trained again."""
        p = self.progress
        p.step = step
        p.losses = {k: v for k, v in p.losses.items() if k <= step}
        end = step * self.job.global_batch_size
        p.samples = [(a, b) for a, b in p.samples if b <= end]
        p.loss = p.losses.get(step)
        self._seen = {d: min(v, step) for d, v in self._seen.items()}

    def _after_switch(self, old: Layout | None, new: Layout, record: SwitchRecord) -> None:
        # Read what leavers did up to the switch before they exit (their last Status).
        for d in sorted(set(old.device_of if old else ()) - set(new.device_of) - self.failed):
            try:
                if d in self.clients:
                    self._ingest(d, self.clients[d].status(since_step=self._seen.get(d, 0)))
            except AgentCallError:
                pass
        self.layout = new
        self.generation_running = record.generation
        self.metrics.set_layout(new)
        self.metrics.set_generation(self.generation)
        self._report_workers()
        if old is not None:          # the first generation is a start, not a switch
            self.switches.append(record)
            self.metrics.observe_switch(record.reason, "success",
                                        {"prepare": record.prepare_seconds,
                                         "pause": record.pause_seconds,
                                         "transfer": record.transfer_seconds}, record.bytes)


def choose_restore(model, old: Layout, new: Layout, failed: tuple[int, ...], holdings: dict,
                   *, gpus_per_node: int = 8) -> tuple[int, dict[int, int]] | None:
    """The newest step every survivor holds a snapshot of and from which ``new`` can be
    planned, with the mirrors (proxies) that make it whole; None if no step qualifies.

    ``holdings``: device -> its Status (snapshot_steps, mirror_of, mirror_steps). The planner
    itself decides whether a step is whole: it fails (PlanError) when some state of a failed
    device has neither a surviving replica nor a mirror.
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
            plan_switch(model, old, new, gpus_per_node=gpus_per_node, dead=failed,
                        proxies=proxies)
        except PlanError:
            continue
        return step, proxies
    return None


def _text(layout: Layout | None) -> str:
    return layout.to_text() if layout else "nothing"

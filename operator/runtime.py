"""One DynaTrainJob on a cluster, reconciled: its objects, its pods, its controller core.

A :class:`JobRuntime` is the cluster front end of :class:`~dynatrain.controller.core.JobController`,
as the local runner is the one-machine front end. It is *level-triggered*: each
:meth:`~JobRuntime.reconcile` compares what the job's spec asks for with what the cluster has
and closes the gap, and never gives up on the job. Each pass:

1. **takes the spec** when it changed: a spec the parser refuses becomes the ``SpecValid``
   condition naming the field (a running job runs on under its last valid spec); a fixed one
   is picked up on the next pass, with no operator restart;
2. **keeps the job's objects** (the token Secret, the spec ConfigMap, the headless Service,
   the workers' NetworkPolicy of :mod:`.netpol`) matching the spec: created when missing,
   updated when they differ, and replaced when they belong to a previous job of the same name
   (another UID), never adopted. A ``spec.agent.authSecret`` without the label
   ``dynatrain.io/agent-token: "true"`` fails the job (:mod:`.guard`: no confused deputy);
3. **reads the cluster** from the operator's shared :class:`~.informer.ClusterView` (watches,
   not lists): which of the job's pods are doomed (a termination taint or cordon on their node,
   ``DisruptionTarget``, deletion with a grace period) and by when, which are unhealthy (failed,
   exited, crash-looping, unpullable), and how many more workers fit on the healthy nodes;
4. gives the controller the agents of healthy Running workers, a notice for each doomed worker,
   and the failure or removal of workers whose pods are gone or unhealthy; **replaces**
   unhealthy pods (with back-off, in the ``WorkersHealthy`` condition) and **creates** pods up
   to the job's target while they fit, at most ``--max-pods-per-job``, and only of an image
   that ``--allowed-images`` admits (else the ``ImageAllowed`` condition and an Event, and the
   job waits, with no pod); a quota or admission
   rejection becomes the ``PodsCreated`` condition and an Event, retried with back-off; over
   the target (``kubectl scale`` down) it deletes pods that hold no part of the job;
5. lets the controller decide and switch (``tick``; a lower target is a ``scale-down``
   switch), records switches in the status and as Events, and deletes the pods switched off
   doomed nodes or out by a scale-down.

Notices that leave fewer workers than ``spec.elastic.minWorkers`` *park* a job with
``spec.checkpoint``: every worker writes one checkpoint, its pods go, and it starts again from
there once its minimum is up (condition ``Suspended``, reason ``BelowMinimum``).

Every error of a pass becomes the ``Reconciled`` condition (reason and message) and a retry
with capped exponential back-off. The job is ``Failed`` only by its own rule (the controller's
:class:`JobFailed`: no layout fits what is left, unrecoverable state), and then its pods are
deleted; ``Succeeded`` when every step is trained, and then too.

The operator talks to the agents over mutual TLS with the token as a second factor: the
job's objects include its two TLS Secrets (:mod:`.pki`: its own CAs, renewed in place before
they expire, or cert-manager's with ``spec.agent.issuerRef``), and new credentials re-make the
agents' clients. Only pods this job's operators created are trusted: their UIDs, from the
create calls, are kept in ``status.workerUIDs`` (which a job's owners cannot write); any other
pod with the job's labels gets no token and no client, and an Event names it.

The controller's rendezvous store is hosted by this process; the workers reach it at
``rendezvous_host``. If the operator restarts, the next one adopts the running job from its
agents (:meth:`JobController.adopt`), finishing or aborting a switch that was in flight.

:class:`JobRuntime` is the coordinator: it takes the spec, keeps the job's objects and runs
the pass. The rest lives in rooms of one role each, which it owns and hands what they use
(#32: one class did everything): :mod:`.status` (conditions, the status patch, the data
audit, Events), :mod:`.jobtls` (the TLS material, both kinds, and the agents' clients),
:mod:`.pods` (the worker pods: trust, creation, replacement, deletion), :mod:`.suspension`
(``spec.suspend`` and parking under the minimum), :mod:`.sharing` (the job's share of a
pool), :mod:`.objects`
(the Secret, ConfigMap, Service and NetworkPolicy) and :mod:`.basics` (settings, back-off). The names other modules import from here are re-exported.
"""

from __future__ import annotations

import copy
import time
import traceback
from dataclasses import replace

from kubernetes import client
from kubernetes.client.rest import ApiException

from dynatrain.agent.metrics import Metrics
from dynatrain.controller import decide
from dynatrain.controller import inbox as ev
from dynatrain.controller.core import JobController, JobFailed
from dynatrain.controller.orchestrator import Timeouts
from dynatrain.controller.policy import Policy
from dynatrain.controller.rendezvous import RendezvousServer
from dynatrain.spec.hardware import (GPU_PRODUCT_LABEL, PROFILES, DeviceProfile,
                                     profile_for_node_labels)
from dynatrain.spec.job import JobError, job_from_manifest

from . import cluster as k
from .basics import Backoff, JobContext, Settings, Waiting as _Waiting, api_message as _api_message
from .basics import now as _now
from .jobtls import JobTls
from .objects import JobObjects
from .pods import WorkerPods
from .sharing import Board, JobShare, Priorities
from .suspension import Suspension
from .status import (AUDIT_EVERY_S, GROUP, PLURAL, TERMINAL, VERSION, Conditions, Report,
                     seconds_to_expiry)

__all__ = ["GROUP", "VERSION", "PLURAL", "START_WAIT_S", "TERMINAL", "AUDIT_EVERY_S",
           "Settings", "Backoff", "Conditions", "JobRuntime", "profile_for", "hardware_of",
           "seconds_to_expiry"]
"""Re-exported: handlers.py and the tests import these from here."""

START_WAIT_S = 60.0
"""How long the first layout waits for every created worker to come up."""


def profile_for(job) -> DeviceProfile:
    """Before any worker is placed: ``spec.hardware.profile``, else the H100 preset for GPU
    workers (:func:`hardware_of` corrects it from the nodes); CPU workers: one core-sized
    device per pod."""
    if job.gpus_per_worker > 0:
        return PROFILES[_hardware_override(job) or "h100"]
    return replace(PROFILES["cpu"], shared_cores=0, memory_bytes=4 << 30)


def _hardware_override(job) -> str | None:
    """``spec.hardware.profile``, if the job sets one."""
    return (job.raw.get("spec", {}).get("hardware") or {}).get("profile")


def hardware_of(job, nodes: list[k.NodeInfo]) -> tuple[DeviceProfile, bool, str, str]:
    """The profile a GPU job's layouts are priced with, from the nodes its workers run on:
    (profile, ok, reason, message) for the ``Hardware`` condition. ``spec.hardware.profile``
    wins; else each node's GPU labels name a preset; workers on different GPU models are
    planned for the one with the least memory, so that every layout fits every device (and
    the condition says so); nodes whose labels name no known GPU are priced as H100s, which
    the condition says too."""
    override = _hardware_override(job)
    if override:
        return PROFILES[override], True, "Override", f"spec.hardware.profile {override}"
    found = {n.name: profile_for_node_labels(dict(n.gpu_labels)) for n in nodes}
    known = {p.name: p for p in found.values() if p is not None}
    unknown = sorted(name for name, p in found.items() if p is None)
    if not known:
        return (PROFILES["h100"], False, "NoGPULabels",
                f"node(s) {', '.join(unknown) or '-'} have no {GPU_PRODUCT_LABEL} label naming "
                "a GPU with a preset: planned as H100 80 GB; set spec.hardware.profile")
    smallest = min(known.values(), key=lambda p: (p.memory_bytes, p.flops_per_second))
    if len(known) > 1 or unknown:
        return (smallest, False, "MixedGPUs",
                f"workers run on {', '.join(sorted(known))}"
                + (f" and unlabelled node(s) {', '.join(unknown)}" if unknown else "")
                + f": planned for {smallest.name}, the one with the least memory; a pipeline "
                "gets stages of one GPU model each, layers in proportion to their speed")
    return smallest, True, "FromNodeLabels", f"{smallest.name} ({GPU_PRODUCT_LABEL})"


class JobRuntime:
    """One job's coordinator: the spec, the objects, the pass; the other rooms are its own
    (:attr:`report` the status and Events, :attr:`jobtls` the TLS material, :attr:`pods` the
    worker pods), each given what it uses."""

    def __init__(self, body: dict, *, api: client.ApiClient, view, rendezvous_host: str,
                 metrics: Metrics, log, settings: Settings = Settings(),
                 policy: Policy | None = None, timeouts: Timeouts = Timeouts(),
                 board: Board | None = None, priorities: Priorities | None = None):
        meta = body["metadata"]
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.view = view
        self.log = log
        self.body = body
        self.settings = settings
        self.rendezvous_host, self.metrics = rendezvous_host, metrics
        self.policy, self.timeouts = policy, timeouts
        self.job = None
        self.controller: JobController | None = None
        self.store = None
        self.seen_spec = None
        published = body.get("status") or {}
        self.report = Report(core=self.core, custom=self.custom, namespace=self.namespace,
                             name=self.name, body=lambda: self.body, log=log, settings=settings,
                             published_conditions=published.get("conditions"))
        self.conditions = self.report.conditions
        self.phase = "Pending"
        self.start_time: str | None = published.get("startTime")
        """When the job first trained (``status.startTime``), kept across operator restarts."""
        self.completion_time: str | None = published.get("completionTime")
        self.last_switch: dict | None = (body.get("status") or {}).get("lastSwitch")
        """As published; a restarted operator (or a replica taking over) keeps the last."""
        self.errors = Backoff(settings.backoff_first_s, settings.backoff_max_s)
        self.created = time.monotonic()
        self.adopted = False
        self.took_over = False
        """The job was already training when this operator adopted it (a restart, a new
        leader): its records start with the workers' recent windows, not the first step."""
        self.over = False
        """Succeeded or Failed: nothing is left to do but to keep its pods deleted."""
        self.noticed: set[int] = set()
        self.lost_reported: set[int] = set()
        """Devices whose failure a WorkerLost Event has told (see :meth:`_report_lost`)."""
        ctx = JobContext(core=self.core, namespace=self.namespace, name=self.name, uid=self.uid,
                         settings=settings, log=log, event=self.report.event,
                         conditions=self.conditions, job=lambda: self.job,
                         body=lambda: self.body, generation=self._generation,
                         controller=lambda: self.controller)
        self.objects = JobObjects(ctx, net=client.NetworkingV1Api(api),
                                  pki=lambda: self.jobtls)
        self.pods = WorkerPods(
            ctx, view=view, secret_name=lambda: self.objects.secret_name, publish=self._publish,
            worker_uids=set((body.get("status") or {}).get("workerUIDs") or []),
            kueue=self.custom)
        self.jobtls = JobTls(ctx, cert_manager=self.custom, token=lambda: self.objects.token,
                             ensure=self.objects.ensure_one)
        self.share = JobShare(ctx, board=board, priorities=priorities) if board else None
        """The job's share of a pool shared with other jobs (None: the job is alone)."""
        self.hold = Suspension(ctx, pods=self.pods, publish_phase=self._publish_phase,
                               published=published.get("suspension"))
        """``spec.suspend`` and parking under the minimum (the checkpoint it continues from)."""

    # -- the pass --------------------------------------------------------------------------------
    def reconcile(self, body: dict) -> float | None:
        """One pass; returns the seconds until the next, or None when the job is over."""
        self.body = body
        if self.over:
            return None
        try:
            if self.controller is None and (body.get("status") or {}).get("phase") in TERMINAL:
                self._finished_before(body["status"]["phase"])   # an operator restart
                return None
            self._take_spec(body)
            if self.job is not None:
                self.objects.ensure()
                self._tick()
            self.errors.reset()
            self.conditions.set("Reconciled", True, "Reconciled", "", self._generation())
            delay = self.settings.tick_s
        except JobFailed as e:
            self._fail(str(e))
            delay = None
        except _Waiting as e:
            delay = self.errors.fail()
            self._trouble("Waiting", str(e), delay)
        except JobError as e:          # e.g. the named authSecret has no token
            delay = self.errors.fail()
            self._trouble("InvalidSpec", str(e), delay)
        except ApiException as e:
            delay = self.errors.fail()
            self._trouble("APIError", f"{e.status} {e.reason}: {_api_message(e)}", delay)
        except Exception as e:  # a bug or the unforeseen: say so, retry, never give up
            delay = self.errors.fail()
            self.log(f"job {self.name}: pass failed:\n{traceback.format_exc()}")
            self._trouble("InternalError", f"{type(e).__name__}: {e}", delay)
        self._publish()
        return delay

    def _trouble(self, reason: str, message: str, delay: float) -> None:
        text = f"{message} (attempt {self.errors.failures}; retrying in {delay:.0f} s)"
        if self.conditions.set("Reconciled", False, reason, text, self._generation()):
            self._event("Warning", reason, text)
        self.log(f"job {self.name}: {reason}: {text}")

    def _generation(self) -> int:
        return int(self.body["metadata"].get("generation") or 0)

    # -- the spec --------------------------------------------------------------------------------
    def _take_spec(self, body: dict) -> None:
        spec = body.get("spec")
        if spec == self.seen_spec:
            return
        self.seen_spec = copy.deepcopy(spec)
        gen = self._generation()
        try:
            job = job_from_manifest(body, source=f"{self.namespace}/{self.name}")
            if self.job is not None:
                self._check_immutable(job)
        except JobError as e:
            running = self.controller is not None
            text = str(e) + ("; the job runs on under its last valid spec" if running
                             else "; nothing runs until the spec is fixed")
            self.conditions.set("SpecValid", False, "InvalidSpec", text, gen)
            self._event("Warning", "InvalidSpec", text)
            self.log(f"job {self.name}: {text}")
            return
        self.conditions.set("SpecValid", True, "Accepted", f"generation {gen}", gen)
        self.objects.checked = float("-inf")          # the ConfigMap follows the spec
        if self.job is None:
            self._start(job)
            return
        self.job = job
        self.controller.push(ev.SpecEdited(job))
        self.log(f"job {self.name}: spec changed (mode {job.mode}, layout "
                 f"{job.layout.to_text() if job.layout else '-'}, workers {job.workers})")

    def _check_immutable(self, job) -> None:
        """The CRD refuses these edits; an operator may still meet one (an older CRD)."""
        old = self.job
        changed = [f for f, a, b in (
            ("spec.model", old.model_ref, job.model_ref),
            ("spec.globalBatchSize", old.global_batch_size, job.global_batch_size),
            ("spec.training", old.training, job.training),
            ("spec.resources.gpus", old.gpus_per_worker, job.gpus_per_worker),
            ("spec.agent", (old.agent_port, old.auth_secret, old.issuer_ref),
             (job.agent_port, job.auth_secret, job.issuer_ref)),
        ) if a != b]
        if changed:
            raise JobError(f"{self.namespace}/{self.name}: {', '.join(changed)} cannot change "
                           "on a running job (create a new DynaTrainJob)")

    def _start(self, job) -> None:
        self.job = job
        if job.recovery.timeouts:                      # spec.recovery.timeouts
            self.timeouts = job.recovery.timeouts_config()
        self.store = RendezvousServer(self.rendezvous_host)
        self.controller = JobController(
            job, rendezvous=self.store.address,
            profile=profile_for(job), metrics=self.metrics,
            policy=self.policy or Policy(), timeouts=self.timeouts,
            devices_per_node=max(1, 8 // max(1, job.gpus_per_worker)), log=self.log)
        # spec.recovery.resumeFrom: the first generation starts from that checkpoint (on the
        # claim every worker mounts), under whatever layout fits the workers at hand.
        self.controller.resume_from = job.recovery.resume_from
        # With a checkpoint claim, a job pushed under its minimum (a higher priority, Kueue)
        # waits at a checkpoint for it to come back; without one it fails, as it must.
        self.controller.wait_below_minimum = bool(job.recovery.checkpoint_dir)
        held = self.hold.checkpoint      # suspended or parked before this operator started
        if held:
            self.controller.restart_from(held["checkpoint"], int(held["step"]))
        self.controller.before_switch = self._switching
        self.controller.on_answer = self._answered
        self.controller.sense = self._sense
        self.created = time.monotonic()

    # -- one tick ---------------------------------------------------------------------------------
    def _observe(self):
        """(nodes, this job's worker pods) from the shared watch: a cache read."""
        nodes = {n.metadata.name: k.read_node(n) for n in self.view.nodes()}
        return nodes, self.pods.workers(nodes, time.monotonic())

    def _sense(self) -> None:
        """The controller calls this while a switch waits: pods gone, notices and new agents
        are pushed into its inbox (it takes them in after), so no signal waits behind the
        switch. The Warning Events of what the previous look declared failed go out first."""
        self._report_lost()
        self._take_in(self._observe()[1])

    def _tick(self) -> None:
        nodes, workers = self._observe()
        held = self.hold.suspended(self.phase)
        if held == "suspended":
            self.phase, self.adopted = "Suspended", False
            self._unclaim()
            return
        if held == "resumed":
            self.phase, self.created = "Pending", time.monotonic()
        self._take_in(workers)
        c = self.controller
        c.take_in()               # what this pass saw, before it reads the controller again
        # A job in a Kueue queue is Kueue's to share (quota, cohorts, preemption): the
        # operator's own rule leaves it alone.
        queued = bool(self.body["spec"].get("queueName"))
        c.share = self.share.update(workers, self.pods) if self.share and not self.over \
            and not queued else None
        if queued:
            self._unclaim()
        if not self.over:
            self.pods.scale(workers, nodes, c.share)
            c.take_in()           # the pods scale let go
        # Where each worker runs (a pod never moves): the workers put each rank's mirror on
        # another node, so that losing a node loses no state that is not also elsewhere.
        c.device_nodes.update({w.device: w.node for w in workers.values() if w.node})
        self._price(workers, nodes)
        if not self.adopted:
            if not self._ready_to_start(workers):
                self.phase = "Pending"
                return
            self.adopted = True
            self.start_time = self.start_time or _now().isoformat()
            self.log(f"job {self.name}: {c.adopt()}")
            # A generation already running: this operator took the job over mid-flight.
            self.took_over = c.generation_running > 0
        record = c.tick()
        self._report_lost()
        if c.parked is not None:          # under its minimum: it waits at a checkpoint
            self.hold.park(c.parked)
            self.adopted, self.created = False, time.monotonic()
            return
        if record is not None:
            self._switched(record, workers)
        if c.progress.finished:
            self.over = True
            self.phase = "Succeeded"
            self.completion_time = _now().isoformat()
            self.conditions.set("Complete", True, "Succeeded",
                                f"trained {c.progress.step} steps", self._generation())
            self._event("Normal", "Succeeded", f"trained {c.progress.step} steps")
            self.pods.delete_all_pods("the job succeeded")
            self._unclaim()                  # its GPUs are the others' at once
        else:
            self.phase = "Running"

    def _take_in(self, workers) -> None:
        """Capacity signals from the worker pods: gone, unhealthy, doomed, newly up."""
        c = self.controller
        for d in sorted(c.state.agents):                # pods that are gone
            if d not in workers:
                self.log(f"worker {d}: pod gone")
                if decide.exit_is_failure(member=d in c.members, released=d in self.pods.left,
                                          code=None):               # without notice: recover
                    # The controller judges whether that is a failure (a leaver of the switch
                    # in flight may exit as its part ends): _report_lost says it if so.
                    c.push(ev.DeviceFailed(d, "its pod is gone without notice"))
                else:
                    c.push(ev.DeviceLeft(d))
        for d, w in list(workers.items()):
            if w.unhealthy:
                self.pods.replace(w)
                del workers[d]
                continue
            if w.doomed and d in c.state.agents and d not in self.noticed:
                self.noticed.add(d)
                if not decide.acts_on_notice(self.job):
                    self._event("Warning", "PreemptionIgnored", f"worker {d} ({w.name}) may be "
                                f"lost in {w.deadline_s:.0f} s: {w.why}; spec.preemptionPolicy "
                                "is Ignore: no switch (if it goes, it is recovered)")
                    continue
                c.push(ev.Notice(d, w.deadline_s))
                self._event("Warning", "Preemption", f"worker {d} ({w.name}) will be lost in "
                            f"{w.deadline_s:.0f} s: {w.why}")
            if (not w.doomed and d not in c.state.agents and d not in self.pods.left
                    and w.phase == "Running" and w.ip):
                agent = self.jobtls.agent(w.ip, w.name)
                if agent.health():
                    c.push(ev.DeviceUp(d, agent))
                    self.jobtls.agents_at[d] = (w.ip, w.name)
                    self.log(f"worker {d}: agent up at {w.ip}:{self.job.agent_port}")
                    self.pods.replacing.reset()
                    if self.conditions.get("WorkersHealthy") is None or self.pods.replaced == 0:
                        self.conditions.set("WorkersHealthy", True, "Healthy", "",
                                            self._generation())
                else:
                    agent.close()

    def _report_lost(self) -> None:
        """A Warning Event for each device the controller declared failed (a pod gone without
        notice, an unhealthy pod, a worker that stopped answering or hung): the controller
        judges that, not the pod's disappearance (a leaver exits as its switch ends)."""
        c = self.controller
        for d in c.lost:
            if d not in self.lost_reported:
                self.lost_reported.add(d)
                self._event("Warning", "WorkerLost", f"worker {d} failed: "
                            f"{c.lost_why.get(d, 'unknown')}; the job recovers without it")

    def _unclaim(self) -> None:
        if self.share is not None:
            self.share.drop()

    def _price(self, workers, nodes) -> None:
        """A GPU job's device profile, from the nodes its workers are placed on (the
        ``Hardware`` condition), for the solver's next decision."""
        if self.job.gpus_per_worker <= 0:
            return
        placed = [nodes[w.node] for w in workers.values()
                  if w.node in nodes and not w.doomed and w.device not in self.pods.left]
        if not placed:
            return
        profile, ok, reason, text = hardware_of(self.job, placed)
        # Each worker's own GPU speed where its node's labels name one (and the job does not
        # set spec.hardware.profile): workers on different GPU models get pipeline stages of
        # like devices, weighted by speed (controller/mixed.py).
        self.controller.device_speeds = {} if _hardware_override(self.job) else {
            w.device: found.flops_per_second for w in workers.values()
            if w.node in nodes and (found := profile_for_node_labels(
                dict(nodes[w.node].gpu_labels))) is not None}
        if self.controller.profile.name != profile.name:
            self.log(f"job {self.name}: layouts priced for {profile.name}: {text}")
        self.controller.profile = profile
        if self.conditions.set("Hardware", ok, reason, text, self._generation()) and not ok:
            self._event("Warning", reason, text)

    def _ready_to_start(self, workers) -> bool:
        healthy = [d for d in self.controller.clients]
        # Pods the scheduler has not placed are demand, not workers on their way.
        placed = [w for w in workers.values() if not w.doomed and w.node]
        if not healthy:
            return False
        if len(healthy) >= len(placed) or time.monotonic() - self.created > START_WAIT_S:
            return len(healthy) >= self.job.min_workers
        return False

    # -- after a switch ---------------------------------------------------------------------------
    def _answered(self, req) -> None:
        """A requested layout was applied, waits for capacity, or was superseded or refused:
        the ``LayoutRequest`` condition and an Event say which, and why."""
        ok = req.state == "applied"
        reason = {"applied": "Applied", "pending": "Pending", "waiting": "WaitingForCapacity",
                  "superseded": "Superseded", "refused": "Refused"}[req.state]
        text = f"layout {req.layout.to_text()}: {req.answer}"
        self.conditions.set("LayoutRequest", ok, reason, text, self._generation())
        self._event("Normal" if req.state in ("applied", "pending") else "Warning",
                    f"LayoutRequest{reason}", text)

    def _switching(self, old, new, reason) -> None:
        self.phase = "Switching" if old is not None else "Pending"
        self._publish(force=True)

    def _switched(self, r, workers) -> None:
        c = self.controller
        if r.from_layout:
            msg = (f"switched {r.from_layout} -> {r.to_layout} ({r.reason}) at step {r.step}: "
                   f"pause {r.pause_seconds:.3f} s, {r.bytes} bytes over the network")
            self.log(msg)
            self._event("Normal", "Switched", msg)
            self.last_switch = {
                "from": r.from_layout, "to": r.to_layout, "reason": r.reason,
                "result": r.result, "pauseSeconds": round(r.pause_seconds, 6),
                "bytes": r.bytes, "step": r.step, "time": _now().isoformat(),
                "summary": f"{r.reason} {r.pause_seconds:.2f}s"}
        else:
            self._event("Normal", "Started", f"started {r.to_layout} on workers "
                        f"{list(c.members)}")
            self.hold.started(len(c.members))
        for d, w in workers.items():
            if d in c.lost and d not in self.pods.left:    # died without notice: replace its pod
                self.pods.left.add(d)
                self.pods.delete_pod(w.name)
                continue
            switched_off = w.doomed or (r.reason in ("scale-down", "release", "rebalance")
                                         and r.from_layout)
            if d not in c.members and d in c.state.agents and switched_off:   # free its pod
                self.pods.left.add(d)
                c.push(ev.DeviceLeft(d))
                self.pods.delete_pod(w.name)
        c.take_in()

    # -- the end ---------------------------------------------------------------------------------
    def _fail(self, message: str) -> None:
        self.log(f"job {self.name} failed: {message}")
        self.over = True
        self.phase = "Failed"
        self.conditions.set("Failed", True, "JobFailed", message,
                            self._generation())
        self._event("Warning", "Failed", message)
        try:   # grace 0: a failed job's workers would train on for their grace period
            self.pods.delete_all_pods("the job failed", grace=0)
        except ApiException as e:
            self.log(f"job {self.name}: deleting its pods failed ({e.status} {e.reason}); "
                     "the garbage collector removes them with the job")

    def _finished_before(self, phase: str) -> None:
        """A job that ended before this operator started: keep its pods deleted."""
        self.over = True
        self.phase = phase
        self.pods.delete_all_pods(f"the job is {phase}")

    def stop_workers(self) -> None:
        """The job was deleted: its pods are deleted with grace 0
        (:meth:`.pods.WorkerPods.stop_workers`)."""
        self.pods.stop_workers()

    # -- what the job shows ---------------------------------------------------------------------
    def status(self) -> dict:
        c = self.controller
        st = {"phase": self.phase, "selector": f"{k.JOB_LABEL}={self.name}",
              "observedGeneration": self._generation(),
              "workers": len(c.members) if c else 0,
              "generation": c.generation if c else 0,
              "layout": c.layout.to_text() if c and c.layout else "",
              "step": c.progress.step if c else 0,
              "tokensPerSecond": round(c.progress.tokens_per_second, 3) if c else 0.0,
              "gpus": len(c.members) * self.job.gpus_per_worker if c else 0,
              "replacedWorkers": self.pods.replaced,
              "hardware": c.profile.name if c else "",
              "workerUIDs": sorted(self.pods.worker_uids)}
        if self.start_time:
            st["startTime"] = self.start_time
        if self.completion_time:
            st["completionTime"] = self.completion_time
        # None once resumed: the status is merge-patched, where null removes the field.
        st["suspension"] = self.hold.checkpoint
        self.report.running_condition(self.phase, self._generation())
        st["conditions"] = self.conditions.as_list()
        if c is not None and c.progress.loss is not None:
            st["loss"] = round(c.progress.loss, 6)
        if self.last_switch:
            st["lastSwitch"] = self.last_switch
        if c is not None and c.layout is not None:
            st["data"] = self.report.audit(c, self.job, self.took_over)
        return st

    def _publish(self, force: bool = False) -> None:
        """Patch the status when it changed; the step alone at most every status_every_s."""
        self.report.publish(self.status(), force)

    def _publish_phase(self, phase: str) -> None:
        self.phase = phase
        self._publish(force=True)

    def _event(self, kind: str, reason: str, message: str) -> None:
        self.report.event(kind, reason, message)

    def close(self) -> None:
        self._unclaim()
        if self.controller is not None:
            for cl in self.controller.clients.values():
                cl.close()
        self.jobtls.close()
        if self.store is not None:
            self.store.close()

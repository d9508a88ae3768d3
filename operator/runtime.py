"""One DynaTrainJob on a cluster, reconciled: its objects, its pods, its controller core.

A :class:`JobRuntime` is the cluster front end of :class:`~dynatrain.controller.core.JobController`,
as the local runner is the one-machine front end. It is *level-triggered*: each
:meth:`~JobRuntime.reconcile` compares what the job's spec asks for with what the cluster has
and closes the gap, and never gives up on the job. Each pass:

1. **takes the spec** when it changed: a spec the parser refuses becomes the ``SpecValid``
   condition naming the field (a running job runs on under its last valid spec); a fixed one
   is picked up on the next pass, with no operator restart;
2. **keeps the job's objects** (the token Secret, the spec ConfigMap, the headless Service)
   matching the spec: created when missing, updated when they differ, and replaced when they
   belong to a previous job of the same name (another UID), never adopted;
3. **reads the cluster** from the operator's shared :class:`~.informer.ClusterView` (watches,
   not lists): which of the job's pods are doomed (a termination taint or cordon on their node,
   ``DisruptionTarget``, deletion with a grace period) and by when, which are unhealthy (failed,
   exited, crash-looping, unpullable), and how many more workers fit on the healthy nodes;
4. gives the controller the agents of healthy Running workers, a notice for each doomed worker,
   and the failure or removal of workers whose pods are gone or unhealthy; **replaces**
   unhealthy pods (with back-off, in the ``WorkersHealthy`` condition) and **creates** pods up
   to the job's target while they fit, at most ``--max-pods-per-job``; a quota or admission
   rejection becomes the ``PodsCreated`` condition and an Event, retried with back-off; over
   the target (``kubectl scale`` down) it deletes pods that hold no part of the job;
5. lets the controller decide and switch (``tick``; a lower target is a ``scale-down``
   switch), records switches in the status and as Events, and deletes the pods switched off
   doomed nodes or out by a scale-down.

Every error of a pass becomes the ``Reconciled`` condition (reason and message) and a retry
with capped exponential back-off. The job is ``Failed`` only by its own rule (the controller's
:class:`JobFailed`: no layout fits what is left, unrecoverable state), and then its pods are
deleted; ``Succeeded`` when every step is trained, and then too.

The controller's rendezvous store is hosted by this process; the workers reach it at
``rendezvous_host``. If the operator restarts, the next one adopts the running job from its
agents (:meth:`JobController.adopt`), finishing or aborting a switch that was in flight.
"""

from __future__ import annotations

import base64
import copy
import json
import datetime
import secrets
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta

import torch.distributed as dist
from kubernetes import client
from kubernetes.client.rest import ApiException

from dynatrain.agent.client import AgentClient
from dynatrain.agent.metrics import Metrics
from dynatrain.controller.core import JobController, JobFailed
from dynatrain.controller.hardware import PROFILES, DeviceProfile
from dynatrain.controller.job import JobError, job_from_manifest
from dynatrain.controller.orchestrator import Timeouts
from dynatrain.controller.policy import Policy

from . import cluster as k

GROUP, VERSION, PLURAL = "dynatrain.io", "v1alpha1", "dynatrainjobs"
START_WAIT_S = 60.0
"""How long the first layout waits for every created worker to come up."""
TERMINAL = ("Succeeded", "Failed")
AUDIT_EVERY_S = 5.0
"""How often the data audit in ``status.data`` is recomputed."""


@dataclass(frozen=True)
class Settings:
    """Operator-wide settings (``dynatrain operator`` flags, Helm chart values)."""

    tick_s: float = 0.5
    """Longest wait between passes while all is well (a watched change wakes a pass early)."""
    max_pods_per_job: int = 256
    """No job gets more worker pods than this, whatever its maxWorkers."""
    create_batch: int = 16
    """Pods created per pass at most (the rest follow on the next passes)."""
    worker_cpu: str = k.DEFAULT_WORKER_CPU
    worker_memory: str = k.DEFAULT_WORKER_MEMORY
    """Requests and limits of workers whose job sets none."""
    backoff_first_s: float = 1.0
    backoff_max_s: float = 60.0
    replace_backoff_first_s: float = 10.0
    replace_backoff_max_s: float = 300.0
    status_every_s: float = 5.0
    """The status is patched at once when phase, layout, workers or a condition change; the
    step alone is refreshed at most this often (it changes every training step)."""
    objects_every_s: float = 60.0
    """How often the job's Secret, ConfigMap and Service are checked when nothing changed."""


class Backoff:
    """Capped exponential back-off: ``first``, ``2 first``, ... ``cap``; ``reset`` on success."""

    def __init__(self, first: float, cap: float):
        self.first, self.cap, self.failures, self.until = first, cap, 0, 0.0

    def fail(self) -> float:
        delay = min(self.cap, self.first * 2 ** self.failures)
        self.failures += 1
        self.until = time.monotonic() + delay
        return delay

    def reset(self) -> None:
        self.failures, self.until = 0, 0.0

    @property
    def waiting(self) -> float:
        return max(0.0, self.until - time.monotonic())


class Conditions:
    """The job's status conditions by type, with transition times kept across passes."""

    def __init__(self):
        self.items: dict[str, dict] = {}

    def set(self, kind: str, ok: bool, reason: str, message: str = "",
            generation: int = 0) -> bool:
        """Returns whether the condition changed (status, reason or message)."""
        status = "True" if ok else "False"
        old = self.items.get(kind)
        if old and (old["status"], old["reason"], old["message"]) == (status, reason,
                                                                       message[:4000]):
            return False
        self.items[kind] = {
            "type": kind, "status": status, "reason": reason, "message": message[:4000],
            "observedGeneration": generation,
            "lastTransitionTime": old["lastTransitionTime"] if old and old["status"] == status
            else _now().isoformat()}
        return True

    def get(self, kind: str) -> dict | None:
        return self.items.get(kind)

    def as_list(self) -> list[dict]:
        return [self.items[t] for t in sorted(self.items)]


def profile_for(job) -> DeviceProfile:
    """GPU workers: the H100 preset; CPU workers: one core-sized device per pod."""
    if job.gpus_per_worker > 0:
        return PROFILES["h100"]
    return replace(PROFILES["cpu"], shared_cores=0, memory_bytes=4 << 30)


class JobRuntime:
    def __init__(self, body: dict, *, api: client.ApiClient, view, rendezvous_host: str,
                 metrics: Metrics, log, settings: Settings = Settings(),
                 policy: Policy | None = None, timeouts: Timeouts = Timeouts()):
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
        self.token, self.secret_name = "", ""
        self.conditions = Conditions()
        self.phase = "Pending"
        self.last_switch: dict | None = (body.get("status") or {}).get("lastSwitch")
        """As published; a restarted operator (or a replica taking over) keeps the last."""
        self.data_audit: dict | None = None
        self.audited_at = float("-inf")
        self.published: dict | None = None
        self.published_at = 0.0
        self.errors = Backoff(settings.backoff_first_s, settings.backoff_max_s)
        self.creation = Backoff(settings.backoff_first_s * 5, settings.backoff_max_s)
        self.replacing = Backoff(settings.replace_backoff_first_s, settings.replace_backoff_max_s)
        self.replaced = 0
        self.objects_checked = float("-inf")
        self.created = time.monotonic()
        self.adopted = False
        self.took_over = False
        """The job was already training when this operator adopted it (a restart, a new
        leader): its records start with the workers' recent windows, not the first step."""
        self.over = False
        """Succeeded or Failed: nothing is left to do but to keep its pods deleted."""
        self.noticed: set[int] = set()
        self.left: set[int] = set()
        self.expected: dict[str, float] = {}
        """Pods created and not yet seen by the watch: name -> when."""
        self.deleting: dict[str, float] = {}
        """Pods this runtime deleted, until the watch sees them go."""
        self.warned: set[str] = set()
        self.next_device = 0
        """Device ids are never reused within a job (a restarted operator starts after the
        highest id it finds)."""

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
                self._ensure_objects()
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
        self.objects_checked = float("-inf")          # the ConfigMap follows the spec
        if self.job is None:
            self._start(job)
            return
        self.job = job
        self.controller.set_job(job)
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
            ("spec.agent", (old.agent_port, old.auth_secret), (job.agent_port, job.auth_secret)),
        ) if a != b]
        if changed:
            raise JobError(f"{self.namespace}/{self.name}: {', '.join(changed)} cannot change "
                           "on a running job (create a new DynaTrainJob)")

    def _start(self, job) -> None:
        self.job = job
        if job.recovery.timeouts:                      # spec.recovery.timeouts
            self.timeouts = job.recovery.timeouts_config()
        self.store = dist.TCPStore(self.rendezvous_host, 0, is_master=True,
                                   wait_for_workers=False,
                                   timeout=timedelta(seconds=self.timeouts.group_s))
        self.controller = JobController(
            job, rendezvous=f"{self.rendezvous_host}:{self.store.port}",
            profile=profile_for(job), metrics=self.metrics,
            policy=self.policy or Policy(), timeouts=self.timeouts,
            devices_per_node=max(1, 8 // max(1, job.gpus_per_worker)), log=self.log)
        # spec.recovery.resumeFrom: the first generation starts from that checkpoint (on the
        # claim every worker mounts), under whatever layout fits the workers at hand.
        self.controller.resume_from = job.recovery.resume_from
        self.controller.before_switch = self._switching
        self.controller.on_answer = self._answered
        self.controller.intake = self._intake
        self.created = time.monotonic()

    # -- objects the job needs -------------------------------------------------------------------
    def _ensure_objects(self) -> None:
        if time.monotonic() - self.objects_checked < self.settings.objects_every_s:
            return
        ns, body, names = self.namespace, self.body, k.names(self.name)
        secret = self.job.auth_secret
        if secret is None:
            secret = names["secret"]
            self._ensure(self.core.read_namespaced_secret, self.core.create_namespaced_secret,
                         self.core.delete_namespaced_secret, None, "Secret", secret,
                         lambda: k.token_secret(body, secrets.token_urlsafe(32)), None)
        self.secret_name = secret
        data = self.core.read_namespaced_secret(secret, ns).data or {}
        if "token" not in data:
            raise JobError(f"secret {ns}/{secret} (spec.agent.authSecret) has no key 'token'")
        self.token = base64.b64decode(data["token"]).decode().strip()
        self._ensure(self.core.read_namespaced_config_map, self.core.create_namespaced_config_map,
                     self.core.delete_namespaced_config_map,
                     self.core.patch_namespaced_config_map, "ConfigMap", names["configmap"],
                     lambda: k.spec_configmap(body), lambda obj, want: obj.data != want["data"])
        self._ensure(self.core.read_namespaced_service, self.core.create_namespaced_service,
                     self.core.delete_namespaced_service, self.core.patch_namespaced_service,
                     "Service", names["service"],
                     lambda: k.headless_service(body, self.job.agent_port),
                     lambda obj, want: sorted((p.name, p.port) for p in obj.spec.ports or [])
                     != sorted((p["name"], p["port"]) for p in want["spec"]["ports"]))
        self.conditions.set("ObjectsReady", True, "Ready", "", self._generation())
        self.objects_checked = time.monotonic()

    def _ensure(self, read, create, delete, patch, kind: str, name: str, manifest, differs):
        """Make the object ``name`` this job's and as ``manifest()`` says.

        One of a previous job of the same name (its owner is another UID: the old job was
        deleted and this one created before the garbage collector got to it) is deleted and
        created anew; adopting it would let the collector delete it under this job. One that
        no DynaTrainJob owns is somebody else's: the job waits, with a condition saying so.
        """
        ns = self.namespace
        try:
            obj = read(name, ns)
        except ApiException as e:
            if e.status != 404:
                raise
            obj = None
        if obj is not None:
            owner = k.foreign_owner(obj, self.uid)
            if owner.startswith("a previous DynaTrainJob"):
                self.log(f"job {self.name}: {kind} {name} belongs to {owner}: replacing it")
                try:
                    delete(name, ns, body=client.V1DeleteOptions(
                        preconditions=client.V1Preconditions(uid=obj.metadata.uid)))
                except ApiException as e:
                    if e.status not in (404, 409):
                        raise
                obj = None
            elif owner:
                text = (f"{kind} {ns}/{name} exists and belongs to {owner}; the job needs "
                        "that name: delete the object or rename the job")
                if self.conditions.set("ObjectsReady", False, "NameTaken", text,
                                       self._generation()):
                    self._event("Warning", "NameTaken", text)
                raise _Waiting(text)
        want = manifest()
        if obj is None:
            create(ns, want)          # a 409 here (deletion not finished) retries the pass
            self.log(f"job {self.name}: {kind} {name} created")
        elif differs is not None and differs(obj, want):
            patch(name, ns, want)
            self.log(f"job {self.name}: {kind} {name} updated to the spec")

    # -- one tick ---------------------------------------------------------------------------------
    def _observe(self):
        """(nodes, this job's worker pods) from the shared watch: a cache read."""
        nodes = {n.metadata.name: k.read_node(n) for n in self.view.nodes()}
        return nodes, self._workers(nodes, time.monotonic())

    def _intake(self) -> None:
        """The controller calls this while a switch waits: pods gone, notices and new agents,
        so no signal waits behind the switch."""
        self._take_in(self._observe()[1])

    def _tick(self) -> None:
        nodes, workers = self._observe()
        self._take_in(workers)
        if not self.over:
            self._scale(workers, nodes)
        c = self.controller
        if not self.adopted:
            if not self._ready_to_start(workers):
                self.phase = "Pending"
                return
            self.adopted = True
            self.log(f"job {self.name}: {c.adopt()}")
            # A generation already running: this operator took the job over mid-flight.
            self.took_over = c.generation_running > 0
        record = c.tick()
        if record is not None:
            self._switched(record, workers)
        if c.progress.finished:
            self.over = True
            self.phase = "Succeeded"
            self._event("Normal", "Succeeded", f"trained {c.progress.step} steps")
            self._delete_all_pods("the job succeeded")
        else:
            self.phase = "Running"

    def _take_in(self, workers) -> None:
        """Capacity signals from the worker pods: gone, unhealthy, doomed, newly up."""
        c = self.controller
        for d in list(c.clients):                       # pods that are gone
            if d not in workers:
                self.log(f"worker {d}: pod gone")
                if d in c.members and d not in self.left:  # without notice: recover
                    self._event("Warning", "WorkerLost", f"worker {d} is gone without notice; "
                                "recovering from the in-memory copies")
                    c.fail_device(d, "its pod is gone")
                else:
                    c.remove_device(d)
        for d, w in list(workers.items()):
            if w.unhealthy:
                self._replace(w)
                del workers[d]
                continue
            if w.doomed and d in c.clients and d not in self.noticed:
                self.noticed.add(d)
                if self.job.preemption_policy == "Ignore":
                    self._event("Warning", "PreemptionIgnored", f"worker {d} ({w.name}) may be "
                                f"lost in {w.deadline_s:.0f} s: {w.why}; spec.preemptionPolicy "
                                "is Ignore: no switch (if it goes, it is recovered)")
                    continue
                c.notice(d, w.deadline_s)
                self._event("Warning", "Preemption", f"worker {d} ({w.name}) will be lost in "
                            f"{w.deadline_s:.0f} s: {w.why}")
            if (not w.doomed and d not in c.clients and d not in self.left
                    and w.phase == "Running" and w.ip):
                agent = AgentClient(f"{w.ip}:{self.job.agent_port}", token=self.token,
                                    timeout_s=5.0)
                if agent.health():
                    c.add_device(d, agent)
                    self.log(f"worker {d}: agent up at {w.ip}:{self.job.agent_port}")
                    self.replacing.reset()
                    if self.conditions.get("WorkersHealthy") is None or self.replaced == 0:
                        self.conditions.set("WorkersHealthy", True, "Healthy", "",
                                            self._generation())
                else:
                    agent.close()

    def _workers(self, nodes, now: float) -> dict[int, k.WorkerPod]:
        """This job's worker pods by device, from the watch (pods of a previous job of the
        same name are deleted, never counted)."""
        workers: dict[int, k.WorkerPod] = {}
        seen = set()
        for p in self.view.job_pods(self.namespace, self.name):
            name = p.metadata.name
            seen.add(name)
            if not k.owned_by(p, self.uid):
                owner = k.foreign_owner(p, self.uid)
                if owner.startswith("a previous DynaTrainJob") and name not in self.deleting:
                    self.log(f"job {self.name}: pod {name} belongs to {owner}: deleting it")
                    self._delete_pod(name, grace=0)
                elif not owner.startswith("a previous") and name not in self.warned:
                    self.warned.add(name)
                    self.log(f"job {self.name}: pod {name} has the job's label but belongs "
                             f"to {owner}: ignored")
                continue
            device = k.device_of(p)
            if device is None:
                if name not in self.warned:
                    self.warned.add(name)
                    self.log(f"job {self.name}: pod {name} has no valid {k.DEVICE_LABEL} "
                             "label: ignored")
                continue
            self.next_device = max(self.next_device, device + 1)
            if name in self.deleting:
                continue
            workers[device] = k.read_worker(p, nodes)
        for name, when in list(self.expected.items()):
            if name in seen or now - when > 60:
                del self.expected[name]
        for name, when in list(self.deleting.items()):
            if name not in seen or now - when > 600:
                del self.deleting[name]
        return workers

    def _replace(self, w: k.WorkerPod) -> None:
        """An unhealthy worker pod: its device is failed (recovered from memory if it was a
        member) or forgotten, the pod deleted, and the next pod created after a back-off."""
        c = self.controller
        d = w.device
        if d in c.members and d not in self.left:
            c.fail_device(d, f"its pod is unhealthy: {w.unhealthy}")
        elif d in c.clients:
            c.remove_device(d)
        self.left.add(d)
        self._delete_pod(w.name)
        self.replaced += 1
        delay = self.replacing.fail()
        text = (f"worker {d} (pod {w.name}) was unhealthy: {w.unhealthy}; deleted and "
                f"replaced ({self.replaced} so far); the next worker pod in {delay:.0f} s")
        self.conditions.set("WorkersHealthy", False, "WorkerReplaced", text, self._generation())
        self._event("Warning", "WorkerReplaced", text)
        self.log(f"job {self.name}: {text}")

    def _ready_to_start(self, workers) -> bool:
        healthy = [d for d in self.controller.clients]
        alive = [w for w in workers.values() if not w.doomed]
        if not healthy:
            return False
        if len(healthy) >= len(alive) or time.monotonic() - self.created > START_WAIT_S:
            return len(healthy) >= self.job.min_workers
        return False

    def _scale(self, workers, nodes) -> None:
        """Create pods while the job is below its target and there is room for them."""
        gen, s = self._generation(), self.settings
        shape = k.WorkerShape.of(self.body["spec"], (s.worker_cpu, s.worker_memory))
        unfit = k.no_node_fits(nodes, shape)
        if unfit:
            if self.conditions.set("Schedulable", False, "NoNodeFits", unfit, gen):
                self._event("Warning", "NoNodeFits", unfit)
            return
        self.conditions.set("Schedulable", True, "Fits", "", gen)
        target = self.job.workers or self.job.max_workers
        want = min(target, s.max_pods_per_job)
        alive = [w for w in workers.values() if not w.doomed and w.device not in self.left]
        if len(alive) > want:
            self._shed(alive, len(alive) - want)
        pending = [w for w in alive if w.phase == "Pending" and not w.node]
        if pending or self.expected or len(alive) >= want:
            return
        if self.replacing.waiting or self.creation.waiting:
            return
        room = k.free_slots(nodes, self.view.pods_on_nodes(), shape)
        count = min(want - len(alive), room, s.create_batch)
        capped = (f"; capped at the operator's {s.max_pods_per_job} pods per job "
                  f"(--max-pods-per-job)" if target > s.max_pods_per_job else "")
        for _ in range(max(0, count)):
            device = self.next_device
            pod = k.worker_pod(self.body, device, secret=self.secret_name,
                               agent_port=self.job.agent_port,
                               defaults=(s.worker_cpu, s.worker_memory))
            try:
                self.core.create_namespaced_pod(self.namespace, pod)
            except ApiException as e:
                if e.status not in (403, 422, 409):
                    raise
                delay = self.creation.fail()
                reason = ("QuotaExceeded" if "quota" in _api_message(e).lower() else
                          "Invalid" if e.status == 422 else
                          "AlreadyExists" if e.status == 409 else "Forbidden")
                text = (f"creating worker pod {pod['metadata']['name']} was refused: "
                        f"{_api_message(e)}; retrying in {delay:.0f} s")
                if self.conditions.set("PodsCreated", False, reason, text, gen):
                    self._event("Warning", reason, text)
                self.log(f"job {self.name}: {text}")
                if e.status == 409:       # a pod of that name exists: take the next id
                    self.next_device += 1
                return
            self.next_device += 1
            self.expected[pod["metadata"]["name"]] = time.monotonic()
            self.log(f"worker {device}: pod created")
        if count > 0 or not capped:
            self.creation.reset()
            self.conditions.set("PodsCreated", True, "Created" if not capped else "Capped",
                                f"{len(alive) + max(0, count)} worker pods{capped}", gen)

    def _shed(self, alive, surplus: int) -> None:
        """More worker pods than wanted (``kubectl scale`` down): delete pods that hold no
        part of the job, newest first. Members are left to the policy, which switches them
        out live (keeping the devices that move the fewest bytes); their pods are deleted once
        the switch is done (:meth:`_switched`)."""
        c = self.controller
        idle = sorted((w for w in alive if w.device not in c.members),
                      key=lambda w: -w.device)
        for w in idle[:surplus]:
            self.log(f"worker {w.device}: pod {w.name} deleted: the job wants "
                     f"{self.job.workers} workers")
            self.left.add(w.device)
            if w.device in c.clients:
                c.remove_device(w.device)
            self._delete_pod(w.name)

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
        for d, w in workers.items():
            if d in c.lost and d not in self.left:    # died without notice: replace its pod
                self.left.add(d)
                self._delete_pod(w.name)
                continue
            switched_off = w.doomed or (r.reason == "scale-down" and r.from_layout)
            if d not in c.members and d in c.clients and switched_off:   # free its pod
                self.left.add(d)
                c.remove_device(d)
                self._delete_pod(w.name)

    # -- the end ---------------------------------------------------------------------------------
    def _fail(self, message: str) -> None:
        self.log(f"job {self.name} failed: {message}")
        self.over = True
        self.phase = "Failed"
        self.conditions.set("Failed", True, "JobFailed", message,
                            self._generation())
        self._event("Warning", "Failed", message)
        try:   # grace 0: a failed job's workers would train on for their grace period
            self._delete_all_pods("the job failed", grace=0)
        except ApiException as e:
            self.log(f"job {self.name}: deleting its pods failed ({e.status} {e.reason}); "
                     "the garbage collector removes them with the job")

    def _finished_before(self, phase: str) -> None:
        """A job that ended before this operator started: keep its pods deleted."""
        self.over = True
        self.phase = phase
        self._delete_all_pods(f"the job is {phase}")

    def stop_workers(self) -> None:
        """The job was deleted: its workers have nothing left to hand over, and would train
        on (SIGTERM is notice) until their grace period ends. Delete their pods with grace 0
        (also those the garbage collector is deleting already: a shorter grace wins)."""
        try:
            for p in self.view.job_pods(self.namespace, self.name):
                if k.owned_by(p, self.uid):
                    self.log(f"job {self.name} deleted: stopping pod {p.metadata.name}")
                    self._delete_pod(p.metadata.name, grace=0)
        except ApiException as e:
            self.log(f"job {self.name}: stopping its pods failed ({e.status} {e.reason}); "
                     "they stop when their grace period ends")

    def _delete_all_pods(self, why: str, grace: int | None = None) -> None:
        for p in self.view.job_pods(self.namespace, self.name):
            if k.owned_by(p, self.uid) and p.metadata.deletion_timestamp is None:
                self.log(f"job {self.name}: deleting pod {p.metadata.name}: {why}")
                self._delete_pod(p.metadata.name, grace=grace)

    def _delete_pod(self, name: str, grace: int | None = None) -> None:
        """With the pod's grace period: its worker gets SIGTERM and exits cleanly (one that
        left has nothing to lose; a standby one holds no state)."""
        self.deleting[name] = time.monotonic()
        try:
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=grace)
        except ApiException as e:
            if e.status != 404:
                raise

    # -- what the job shows ---------------------------------------------------------------------
    def status(self) -> dict:
        c = self.controller
        st = {"phase": self.phase, "selector": f"{k.JOB_LABEL}={self.name}",
              "observedGeneration": self._generation(),
              "conditions": self.conditions.as_list(),
              "workers": len(c.members) if c else 0,
              "generation": c.generation if c else 0,
              "layout": c.layout.to_text() if c and c.layout else "",
              "step": c.progress.step if c else 0,
              "gpus": len(c.members) * self.job.gpus_per_worker if c else 0,
              "replacedWorkers": self.replaced}
        if self.last_switch:
            st["lastSwitch"] = self.last_switch
        if c is not None and c.layout is not None:
            st["data"] = self._audit()
        return st

    def _audit(self) -> dict:
        """``status.data``: whether every step's batch was read exactly once (from the
        workers' own reports of their reads) and how many steps were trained twice. Over the
        steps this controller has records of (an adopted job: the workers' recent ones);
        recomputed at most every ``AUDIT_EVERY_S``."""
        now = time.monotonic()
        if self.data_audit is not None and now - self.audited_at < AUDIT_EVERY_S:
            return self.data_audit
        p = self.controller.progress
        known = set(p.reads) | set(p.inferred)
        # A job taken over mid-flight knows only each worker's window of recent reads, and
        # the windows need not start at the same step, so its earliest known step can be
        # partial: audit from the step after it. A job this operator started has every record.
        first = min(known) if known else p.step + 1
        since = first if self.took_over else first - 1
        problems = p.audit(self.job.global_batch_size, p.step, since=since)
        self.data_audit = {"auditedFrom": since + 1, "auditedStep": p.step,
                           "exactlyOnce": not problems, "retrainedSteps": p.retrained,
                           "problems": problems[:3]}
        self.audited_at = now
        return self.data_audit

    def _publish(self, force: bool = False) -> None:
        """Patch the status when it changed; the step alone at most every status_every_s."""
        st = self.status()
        if st == self.published:
            return
        only_step = (self.published is not None and
                     {**st, "step": 0} == {**self.published, "step": 0})
        if (only_step and not force
                and time.monotonic() - self.published_at < self.settings.status_every_s):
            return
        try:
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.name, {"status": st})
        except ApiException as e:
            if e.status != 404:
                self.log(f"status update failed: {e.status} {e.reason}")
            return
        self.published, self.published_at = st, time.monotonic()

    def _event(self, kind: str, reason: str, message: str) -> None:
        meta = self.body["metadata"]
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{self.name}."),
            involved_object=client.V1ObjectReference(
                api_version=f"{GROUP}/{VERSION}", kind="DynaTrainJob", name=self.name,
                namespace=self.namespace, uid=meta.get("uid")),
            reason=reason, message=message[:1000], type=kind,
            first_timestamp=_now(), last_timestamp=_now(), count=1,
            source=client.V1EventSource(component="dynatrain-operator"))
        try:
            self.core.create_namespaced_event(self.namespace, event)
        except ApiException as e:
            self.log(f"event not recorded: {e.reason}")

    def close(self) -> None:
        if self.controller is not None:
            for cl in self.controller.clients.values():
                cl.close()


class _Waiting(Exception):
    """The pass cannot go on until somebody acts (the condition says what); retried with
    back-off like an API error."""


def _api_message(e: ApiException) -> str:
    """The apiserver's message from an error's Status body, else its reason."""
    try:
        return json.loads(e.body).get("message") or str(e.reason)
    except (TypeError, ValueError, AttributeError):
        return str(e.body or e.reason)


def _now():
    return datetime.datetime.now(datetime.timezone.utc)

"""One DynaTrainJob on a cluster: its pods, its capacity signals, and its controller core.

A :class:`JobRuntime` is the cluster front end of :class:`~dynatrain.controller.core.JobController`,
as the local runner is the one-machine front end. Every tick it:

1. reads the Nodes and the job's worker pods (:mod:`.cluster`): free GPU slots on healthy
   nodes; which workers are doomed (a spot / impending-termination taint or a cordon on their
   node, a ``DisruptionTarget`` condition, deletion with a grace period) and by when;
2. gives the controller the agents of workers that are Running and answer their health check
   (joiners stand by until a switch includes them), a notice for each doomed worker, and the
   removal of workers whose pods are gone;
3. creates worker pods up to the job's maximum while there is room for them (new capacity is
   used as soon as it appears);
4. lets the controller decide and switch (``tick``), then records the switch in the job's
   status and as a Kubernetes Event, and deletes pods that were switched off doomed nodes.

The controller's rendezvous store is hosted by this process; the workers reach it at
``rendezvous_host``. If the operator restarts, the next one adopts the running job from its
agents (:meth:`JobController.adopt`), finishing or aborting a switch that was in flight.
"""

from __future__ import annotations

import base64
import datetime
import secrets
import time
from dataclasses import replace
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


def profile_for(job) -> DeviceProfile:
    """GPU workers: the H100 preset; CPU workers: one core-sized device per pod."""
    if job.gpus_per_worker > 0:
        return PROFILES["h100"]
    return replace(PROFILES["cpu"], shared_cores=0, memory_bytes=4 << 30)


class JobRuntime:
    def __init__(self, body: dict, *, api: client.ApiClient, rendezvous_host: str,
                 metrics: Metrics, log, policy: Policy | None = None,
                 timeouts: Timeouts = Timeouts()):
        self.namespace = body["metadata"]["namespace"]
        self.name = body["metadata"]["name"]
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.log = log
        self.body = body
        self.job = job_from_manifest(body, source=f"{self.namespace}/{self.name}")
        self.store = dist.TCPStore(rendezvous_host, 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeouts.group_s))
        self.metrics = metrics
        self.controller = JobController(
            self.job, rendezvous=f"{rendezvous_host}:{self.store.port}",
            profile=profile_for(self.job), metrics=metrics,
            policy=policy or Policy(), timeouts=timeouts,
            devices_per_node=max(1, 8 // max(1, self.job.gpus_per_worker)), log=log)
        self.controller.before_switch = self._switching
        self.token = ""
        self.created = time.monotonic()
        self.adopted = False
        self.finished = False
        self.noticed: set[int] = set()
        self.left: set[int] = set()
        self.next_device = 0
        """Device ids are never reused within a job (a restarted operator starts after the
        highest id it finds)."""

    # -- objects the job needs -------------------------------------------------------------------
    def ensure_objects(self) -> None:
        ns, body = self.namespace, self.body
        secret = self.job.auth_secret
        if secret is None:
            secret = k.names(self.name)["secret"]
            try:
                self.core.create_namespaced_secret(ns, k.token_secret(
                    body, secrets.token_urlsafe(32)))
            except ApiException as e:
                if e.status != 409:
                    raise
        self.secret_name = secret
        data = self.core.read_namespaced_secret(secret, ns).data or {}
        if "token" not in data:
            raise JobError(f"secret {ns}/{secret} (spec.agent.authSecret) has no key 'token'")
        self.token = base64.b64decode(data["token"]).decode().strip()
        for create, manifest in (
                (self.core.create_namespaced_config_map, k.spec_configmap(body)),
                (self.core.create_namespaced_service,
                 k.headless_service(body, self.job.agent_port))):
            try:
                create(ns, manifest)
            except ApiException as e:
                if e.status != 409:
                    raise

    def update(self, body: dict) -> None:
        """The job object changed (kubectl edit / scale): the controller follows the new spec
        (a fixed layout is switched to, a new worker count is aimed at)."""
        if body.get("spec") == self.body.get("spec"):
            return
        job = job_from_manifest(body, source=f"{self.namespace}/{self.name}")
        self.body, self.job = body, job
        self.controller.job = job
        self.log(f"job {self.name}: spec changed (mode {job.mode}, layout "
                 f"{job.layout.to_text() if job.layout else '-'}, workers {job.workers})")

    # -- one tick ---------------------------------------------------------------------------------
    def tick(self) -> None:
        nodes = {n.metadata.name: k.read_node(n) for n in self.core.list_node().items}
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{k.JOB_LABEL}={self.name}").items
        workers = {w.device: w for w in (k.read_worker(p, nodes) for p in pods)}
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
        for d, w in workers.items():
            if w.doomed and d in c.clients and d not in self.noticed:
                self.noticed.add(d)
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
                else:
                    agent.close()

        if not self.finished:
            self._scale(workers, nodes)
        if not self.adopted:
            if not self._ready_to_start(workers):
                return
            self.adopted = True
            self.log(f"job {self.name}: {c.adopt()}")
        if self.finished:
            return
        try:
            record = c.tick()
        except JobFailed as e:
            self._status(phase="Failed", message=str(e))
            self._event("Warning", "Failed", str(e))
            raise
        if record is not None:
            self._switched(record, workers)
        if c.progress.finished:
            self.finished = True
            self._status(phase="Succeeded")
            self._event("Normal", "Succeeded", f"trained {c.progress.step} steps")
            for w in workers.values():
                self._delete_pod(w.name)
        else:
            self._status(phase="Running")

    def _ready_to_start(self, workers) -> bool:
        healthy = [d for d in self.controller.clients]
        alive = [w for w in workers.values() if not w.doomed]
        if not healthy:
            return False
        if len(healthy) >= len(alive) or time.monotonic() - self.created > START_WAIT_S:
            return len(healthy) >= self.job.min_workers
        return False

    def _scale(self, workers, nodes) -> None:
        """Create pods while the job is below its maximum and there is room for them."""
        want = self.job.workers or self.job.max_workers
        alive = [w for w in workers.values() if not w.doomed and w.device not in self.left]
        pending = [w for w in alive if w.phase == "Pending" and not w.node]
        if pending or len(alive) >= want:
            return
        all_pods = self.core.list_pod_for_all_namespaces(
            field_selector="spec.nodeName!=").items
        room = k.free_slots(nodes, all_pods, self.job.gpus_per_worker)
        count = min(want - len(alive), room)
        self.next_device = max([self.next_device] + [d + 1 for d in workers]
                               + [d + 1 for d in self.controller.clients])
        for _ in range(count):
            device = self.next_device
            self.next_device += 1
            pod = k.worker_pod(self.body, device, secret=self.secret_name,
                               agent_port=self.job.agent_port)
            self.core.create_namespaced_pod(self.namespace, pod)
            self.log(f"worker {device}: pod created")

    # -- after a switch ---------------------------------------------------------------------------
    def _switching(self, old, new, reason) -> None:
        self._status(phase="Switching" if old is not None else "Pending")

    def _switched(self, r, workers) -> None:
        c = self.controller
        if r.from_layout:
            msg = (f"switched {r.from_layout} -> {r.to_layout} ({r.reason}) at step {r.step}: "
                   f"pause {r.pause_seconds:.3f} s, {r.bytes} bytes over the network")
            self.log(msg)
            self._event("Normal", "Switched", msg)
            now = datetime.datetime.now(datetime.timezone.utc).isoformat()
            self._status(phase="Running", last_switch={
                "from": r.from_layout, "to": r.to_layout, "reason": r.reason,
                "result": r.result, "pauseSeconds": round(r.pause_seconds, 6),
                "bytes": r.bytes, "step": r.step, "time": now,
                "summary": f"{r.reason} {r.pause_seconds:.2f}s"})
        else:
            self._event("Normal", "Started", f"started {r.to_layout} on workers "
                        f"{list(c.members)}")
        for d, w in workers.items():
            if d in c.lost and d not in self.left:    # died without notice: replace its pod
                self.left.add(d)
                self._delete_pod(w.name)
                continue
            if d not in c.members and d in c.clients and w.doomed:   # switched off: free it
                self.left.add(d)
                c.remove_device(d)
                self._delete_pod(w.name)

    def _delete_pod(self, name: str) -> None:
        """With the pod's grace period: its worker gets SIGTERM and exits cleanly (one that
        left has nothing to lose; a standby one holds no state)."""
        try:
            self.core.delete_namespaced_pod(name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise

    def _status(self, *, phase: str, last_switch: dict | None = None,
                message: str = "") -> None:
        c = self.controller
        status = {"phase": phase, "workers": len(c.members), "generation": c.generation,
                  "layout": c.layout.to_text() if c.layout else "",
                  "selector": f"{k.JOB_LABEL}={self.name}", "step": c.progress.step,
                  "gpus": len(c.members) * self.job.gpus_per_worker,
                  "observedGeneration": self.body["metadata"].get("generation", 0)}
        if last_switch:
            status["lastSwitch"] = last_switch
        if message:
            status["conditions"] = [{"type": "Failed", "status": "True", "reason": "JobFailed",
                                     "message": message[:1000],
                                     "lastTransitionTime": _now()}]
        try:
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.name, {"status": status})
        except ApiException as e:
            if e.status != 404:
                self.log(f"status update failed: {e.reason}")

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
        for cl in self.controller.clients.values():
            cl.close()


def _now():
    return datetime.datetime.now(datetime.timezone.utc)


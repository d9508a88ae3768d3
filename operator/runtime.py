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
"""

from __future__ import annotations

import base64
import copy
import json
import datetime
import secrets
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch.distributed as dist
from kubernetes import client
from kubernetes.client.rest import ApiException

from dynatrain.agent.auth import ClientTls
from dynatrain.agent.client import AgentClient
from dynatrain.agent.metrics import Metrics
from dynatrain.controller import decide
from dynatrain.controller.core import JobController, JobFailed, SuspendFailed
from dynatrain.controller.hardware import (GPU_PRODUCT_LABEL, PROFILES, DeviceProfile,
                                           profile_for_node_labels)
from dynatrain.controller.job import JobError, job_from_manifest
from dynatrain.controller.orchestrator import Timeouts
from dynatrain.controller.policy import Policy

from . import cluster as k
from . import pki
from . import guard, netpol

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
    cert_lifetime_s: float = pki.DEFAULT_CERT_LIFETIME_S
    """Lifetime of the agents' serving and the operator's client certificates (--cert-lifetime);
    each is renewed when a third of it is left (operator/pki.py)."""
    objects_every_s: float = 60.0
    """How often the job's Secret, ConfigMap and Service are checked when nothing changed."""
    allowed_images: tuple[str, ...] = ()
    """Image prefixes a job's spec.image must start with (--allowed-images); () = any."""
    network_policy: bool = True
    """Create each job's NetworkPolicy (:mod:`.netpol`; --network-policy)."""
    operator_namespace: str = "default"
    operator_pod_labels: dict = field(
        default_factory=lambda: dict(netpol.DEFAULT_OPERATOR_POD_LABELS))
    """Where the operator's pods run and their labels: the policies admit them to the agents."""
    metrics_namespaces: dict = field(default_factory=dict)
    """matchLabels of the namespaces that may scrape workers' metrics ({} = every one)."""


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

    def __init__(self, published: list[dict] | None = None):
        # The published ones, so a restarted operator keeps their transition times (and a
        # finished job its Complete or Failed).
        self.items: dict[str, dict] = {c["type"]: dict(c) for c in published or []
                                       if c.get("type")}

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
                + f": planned for {smallest.name}, the one with the least memory")
    return smallest, True, "FromNodeLabels", f"{smallest.name} ({GPU_PRODUCT_LABEL})"


class JobRuntime:
    def __init__(self, body: dict, *, api: client.ApiClient, view, rendezvous_host: str,
                 metrics: Metrics, log, settings: Settings = Settings(),
                 policy: Policy | None = None, timeouts: Timeouts = Timeouts()):
        meta = body["metadata"]
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.cert_manager = self.custom
        """For cert-manager's Certificates (spec.agent.issuerRef): a rule of their own in the
        chart; tests/k8s/test_operator_rbac.py lists these calls (CERT_MANAGER)."""
        self.net = client.NetworkingV1Api(api)
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
        published = body.get("status") or {}
        self.conditions = Conditions(published.get("conditions"))
        self.phase = "Pending"
        self.start_time: str | None = published.get("startTime")
        """When the job first trained (``status.startTime``), kept across operator restarts."""
        self.completion_time: str | None = published.get("completionTime")
        self.suspension: dict | None = published.get("suspension")
        """``status.suspension`` ({checkpoint, step, time}): the checkpoint a suspend wrote,
        which the job continues from when resumed; kept in the status (a restarted operator
        reads it back) until the resumed job has started from it."""
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
        self.worker_uids: set[str] = set((body.get("status") or {}).get("workerUIDs") or [])
        """UIDs of the pods this job's operators created (``status.workerUIDs``, which the
        job's owners cannot write): only these pods get the token and a client."""
        self.uid_born: dict[str, float] = {}
        """UIDs created by this runtime -> when: kept while the watch has not shown them."""
        self.untrusted: set[str] = set()
        self.tls: tuple[bytes, bytes, bytes] | None = None
        """(CA bundle the agents' certificates chain to, client certificate, client key)."""
        self.pki_due: datetime.datetime | None = None
        """When the TLS material needs a look before the next objects pass (a renewal)."""
        self.agents_at: dict[int, tuple[str, str]] = {}
        """Device -> (pod IP, pod name) its client dials (to re-make it with new TLS)."""
        self.retired: list[AgentClient] = []
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
        if self.suspension:              # suspended before this operator started
            self.controller.restart_from(self.suspension["checkpoint"],
                                         int(self.suspension["step"]))
        self.controller.before_switch = self._switching
        self.controller.on_answer = self._answered
        self.controller.intake = self._intake
        self.created = time.monotonic()

    # -- objects the job needs -------------------------------------------------------------------
    def _ensure_objects(self) -> None:
        if (time.monotonic() - self.objects_checked < self.settings.objects_every_s
                and not (self.pki_due is not None and _now() >= self.pki_due)):
            return
        ns, body, names = self.namespace, self.body, k.names(self.name)
        secret = self.job.auth_secret
        if secret is None:
            secret = names["secret"]
            self._ensure(self.core.read_namespaced_secret, self.core.create_namespaced_secret,
                         self.core.delete_namespaced_secret, None, "Secret", secret,
                         lambda: k.token_secret(body, secrets.token_urlsafe(32)), None)
        self.secret_name = secret
        token_secret = self.core.read_namespaced_secret(secret, ns)
        # A Secret the job names must be labelled for it; the operator's own (made above,
        # labelled since, unlabelled if an older operator made it) is this job's already.
        refused = guard.check_auth_secret(token_secret, ns) if self.job.auth_secret else ""
        if refused:                # never mounted, never read: the job fails (the Secret's
            #                        label is its owner's consent; spec.agent cannot change)
            if self.conditions.set("AuthSecretAllowed", False, "SecretNotLabelled", refused,
                                   self._generation()):
                self._event("Warning", "SecretNotLabelled", refused)
            raise JobFailed(refused)
        self.conditions.set("AuthSecretAllowed", True, "Labelled",
                            f"{guard.AGENT_TOKEN_LABEL}=true", self._generation())
        data = token_secret.data or {}
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
        if self.settings.network_policy:     # who may reach the workers (operator/netpol.py)
            s = self.settings
            self._ensure(self.net.read_namespaced_network_policy,
                         self.net.create_namespaced_network_policy,
                         self.net.delete_namespaced_network_policy,
                         self.net.patch_namespaced_network_policy,
                         "NetworkPolicy", netpol.policy_name(self.name),
                         lambda: netpol.worker_policy(
                             body, agent_port=self.job.agent_port,
                             operator_namespace=s.operator_namespace,
                             operator_pod_labels=s.operator_pod_labels,
                             metrics_namespaces=s.metrics_namespaces),
                         netpol.spec_differs)
        self._ensure_pki()
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

    # -- mutual TLS and whom to trust --------------------------------------------------------------
    def _ensure_pki(self) -> None:
        """The job's TLS material: its own two CAs and certificates, made and renewed here
        (:mod:`.pki`), or, with ``spec.agent.issuerRef``, cert-manager's. When the client
        certificate or the CAs the operator trusts change, the agents' clients are re-made
        (a gRPC channel keeps the credentials it was made with)."""
        if self.job.issuer_ref is None:
            material = self._own_pki()
        else:
            material = self._issued_pki()
        if material != self.tls:
            renewed = self.tls is not None
            self.tls = material
            if renewed:
                self._retls()

    def _own_pki(self) -> tuple[bytes, bytes, bytes]:
        ns, body, now = self.namespace, self.body, _now()
        name = pki.pki_secret_name(self.name)
        try:
            obj = self.core.read_namespaced_secret(name, ns)
        except ApiException as e:
            if e.status != 404:
                raise
            obj = None
        current = None
        if obj is not None and not k.foreign_owner(obj, self.uid):   # else _ensure says why
            try:
                current = pki.from_secret(pki.secret_bytes(obj.data), f"secret {ns}/{name}")
            except pki.PkiError as e:      # edited by hand: start over (the workers follow)
                self.log(f"job {self.name}: {e}; making the job's CAs anew")
        want, changes = pki.advance(current, job=self.name, namespace=ns, now=now,
                                    lifetime_s=self.settings.cert_lifetime_s)
        stored, mounted = pki.pki_secret(body, want), pki.tls_secret(body, want)
        for manifest in (stored, mounted):
            # Rotation patches the Secrets in place: a kubelet updates a running pod's
            # mounted copy, and the agent re-reads its files for new connections.
            self._ensure(self.core.read_namespaced_secret, self.core.create_namespaced_secret,
                         self.core.delete_namespaced_secret, self.core.patch_namespaced_secret,
                         "Secret", manifest["metadata"]["name"], lambda m=manifest: m,
                         lambda obj, want: (obj.data or {}) != want["data"])
        self.pki_due = pki.next_change(want)
        if changes:
            text = "; ".join(changes)
            self.log(f"job {self.name}: TLS: {text}")
            if current is not None:
                self._event("Normal", "CertificatesRenewed", text)
        self.conditions.set("CertificatesReady", True, "Issued",
                            f"the job's own CAs; next renewal {self.pki_due.isoformat()}",
                            self._generation())
        return want.serving_ca_bundle, want.client.cert, want.client.key

    def _issued_pki(self) -> tuple[bytes, bytes, bytes]:
        """cert-manager's certificates (``spec.agent.issuerRef``): the two ``Certificate``
        objects made, and the Secrets it fills read (the job waits until it has)."""
        ns, gen = self.namespace, self._generation()
        group, version, plural = pki.CERT_MANAGER
        api = self.cert_manager

        def waiting(reason: str, text: str):
            if self.conditions.set("CertificatesReady", False, reason, text, gen):
                self._event("Warning", reason, text)
            return _Waiting(text)

        for cert in pki.certificates(self.body, self.job.issuer_ref,
                                     self.settings.cert_lifetime_s):
            name = cert["metadata"]["name"]
            try:
                obj = api.get_namespaced_custom_object(group, version, ns, plural, name)
            except ApiException as e:
                if e.status != 404:      # 404: no such Certificate, or no such API at all
                    raise
                obj = None
            owners = [r.get("uid") for r in (obj or {}).get("metadata", {}).get(
                "ownerReferences") or []]
            if obj is not None and self.uid not in owners:
                raise waiting("NameTaken", f"Certificate {ns}/{name} exists and does not "
                              "belong to this job; delete it or rename the job")
            try:
                if obj is None:
                    api.create_namespaced_custom_object(group, version, ns, plural, cert)
                    self.log(f"job {self.name}: Certificate {name} created")
                elif any(obj.get("spec", {}).get(f) != v for f, v in cert["spec"].items()):
                    api.patch_namespaced_custom_object(group, version, ns, plural, name,
                                                       {"spec": cert["spec"]})
            except ApiException as e:
                if e.status != 404:
                    raise
                raise waiting("CertManagerMissing", (
                    f"spec.agent.issuerRef names {self.job.issuer_ref['kind']} "
                    f"{self.job.issuer_ref['name']!r}, but this cluster has no cert-manager "
                    f"Certificate API ({group}/{version}): install cert-manager, or remove "
                    "spec.agent.issuerRef (on a new job) to let the operator make the job's "
                    "CAs")) from None
        found = {}
        for name, keys in ((pki.tls_secret_name(self.name), ("ca.crt", "tls.crt", "tls.key")),
                           (pki.client_secret_name(self.name), ("tls.crt", "tls.key"))):
            try:
                data = pki.secret_bytes(self.core.read_namespaced_secret(name, ns).data)
            except ApiException as e:
                if e.status != 404:
                    raise
                data = {}
            missing = [key for key in keys if not data.get(key)]
            if missing == ["ca.crt"]:
                raise waiting("IssuerHasNoCA", (
                    f"Secret {ns}/{name} from {self.job.issuer_ref['kind']} "
                    f"{self.job.issuer_ref['name']!r} has no ca.crt: the workers must trust "
                    "the CA that signs the operator's certificate; use a CA Issuer"))
            if missing:
                raise waiting("Issuing", (
                    f"waiting for cert-manager to issue Certificate {ns}/{name} (its Secret "
                    f"lacks {', '.join(missing)}; see `kubectl describe certificate -n {ns} "
                    f"{name}`)"))
            found[name] = data
        serving = found[pki.tls_secret_name(self.name)]
        client_ = found[pki.client_secret_name(self.name)]
        # Re-read when cert-manager renews the operator's certificate (a third of its
        # lifetime before it ends), else at the next objects pass.
        due = pki.renewal_time(client_["tls.crt"]) + timedelta(seconds=10)
        self.pki_due = due if due > _now() else None
        self.conditions.set("CertificatesReady", True, "Issued",
                            f"by {self.job.issuer_ref['kind']} {self.job.issuer_ref['name']}",
                            gen)
        return serving["ca.crt"], client_["tls.crt"], client_["tls.key"]

    def _agent(self, ip: str, pod: str) -> AgentClient:
        """A client of the agent in ``pod``: mutual TLS (the name verified is the pod's name
        under the job's Service, which the serving certificate carries) and the token, read
        at every call (a rotated authSecret is used at once)."""
        ca, cert, key = self.tls
        tls = ClientTls(ca, cert, key, server_name=pki.server_name(pod, self.name,
                                                                   self.namespace))
        return AgentClient(f"{ip}:{self.job.agent_port}", token=lambda: self.token, tls=tls,
                           timeout_s=5.0)

    def _retls(self) -> None:
        """New TLS material: every agent's client is re-made with it. The old clients are
        closed at the next rotation, once no switch runs (a switch in flight holds them)."""
        c = self.controller
        if self.retired and not c.switching:
            for old in self.retired:
                old.close()
            self.retired = []
        for d, old in list(c.clients.items()):
            if d in self.agents_at:
                c.clients[d] = self._agent(*self.agents_at[d])
                self.retired.append(old)
        self.log(f"job {self.name}: TLS credentials changed: {len(c.clients)} agent clients "
                 "re-made")

    def _distrust(self, pod) -> None:
        """A pod with the job's labels and owner that this job's operators did not create
        (its UID is not in ``status.workerUIDs``): no token, no client, never added. Said
        once per pod, in the log and as an Event."""
        name = pod.metadata.name
        if name in self.untrusted:
            return
        self.untrusted.add(name)
        text = (f"pod {name} (uid {pod.metadata.uid}) has the job's labels but the operator "
                "did not create it: it gets no token and is never a worker; delete it")
        self.log(f"job {self.name}: {text}")
        self._event("Warning", "UntrustedPod", text)

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
        if self._suspended():
            return
        self._take_in(workers)
        if not self.over:
            self._scale(workers, nodes)
        c = self.controller
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
        if record is not None:
            self._switched(record, workers)
        if c.progress.finished:
            self.over = True
            self.phase = "Succeeded"
            self.completion_time = _now().isoformat()
            self.conditions.set("Complete", True, "Succeeded",
                                f"trained {c.progress.step} steps", self._generation())
            self._event("Normal", "Succeeded", f"trained {c.progress.step} steps")
            self._delete_all_pods("the job succeeded")
        else:
            self.phase = "Running"

    def _suspended(self) -> bool:
        """``spec.suspend``: a training job writes a checkpoint at a step every member agrees
        on (to its claim) and its pods are removed; a job that had not started just loses its
        pods. Set back to false, the job creates pods again and continues from that
        checkpoint under whatever layout fits them. True while suspended (the pass ends)."""
        c, gen = self.controller, self._generation()
        if not self.job.suspend:
            if self.phase == "Suspended":
                text = (f"continuing from the checkpoint of step {self.suspension['step']}"
                        if self.suspension else "starting")
                self.conditions.set("Suspended", False, "Resumed", text, gen)
                self._event("Normal", "Resumed", text)
                self.log(f"job {self.name}: resumed: {text}")
                self.phase, self.created = "Pending", time.monotonic()
            return False
        if c.layout is not None:          # training: its state goes to the claim first
            if not self.job.recovery.checkpoint_dir:
                text = ("spec.suspend is set, but the job has no spec.checkpoint claim to "
                        "write its state to, so suspending would lose its training: it trains "
                        "on (delete the job, or run it again with spec.checkpoint)")
                if self.conditions.set("Suspended", False, "NoCheckpointClaim", text, gen):
                    self._event("Warning", "NoCheckpointClaim", text)
                return False
            try:
                path, step = c.suspend()
            except SuspendFailed as e:
                text = f"the checkpoint of the suspend was not written: {e}; trying again"
                if self.conditions.set("Suspended", False, "CheckpointFailed", text, gen):
                    self._event("Warning", "CheckpointFailed", text)
                self.log(f"job {self.name}: {text}")
                return False
            self.suspension = {"checkpoint": path, "step": step, "time": _now().isoformat()}
            c.restart_from(path, step)    # the clients go; resumed, it starts from there
            wrote = True
        else:
            wrote = False
        self.phase = "Suspended"
        text = ("no worker pods while spec.suspend is true" + (
            f"; the job continues from the checkpoint of step {self.suspension['step']} "
            f"({self.suspension['checkpoint']}) when it is set to false"
            if self.suspension else ""))
        changed = self.conditions.set("Suspended", True, "Suspended", text, gen)
        if wrote:
            # Kept before the pods go (nothing else holds it), and in one status with the
            # phase and the condition: a reader never sees the one without the other.
            self._publish(force=True)
        if changed:
            self._event("Normal", "Suspended", text)
            self.log(f"job {self.name}: suspended: {text}")
        for d in list(c.clients):         # pods not yet members (standby, joining)
            c.remove_device(d)
        self.adopted = False
        # The default grace: a suspended worker holds nothing the checkpoint does not and
        # stops at once on SIGTERM.
        self._delete_all_pods("the job is suspended")
        return True

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
                if not decide.acts_on_notice(self.job):
                    self._event("Warning", "PreemptionIgnored", f"worker {d} ({w.name}) may be "
                                f"lost in {w.deadline_s:.0f} s: {w.why}; spec.preemptionPolicy "
                                "is Ignore: no switch (if it goes, it is recovered)")
                    continue
                c.notice(d, w.deadline_s)
                self._event("Warning", "Preemption", f"worker {d} ({w.name}) will be lost in "
                            f"{w.deadline_s:.0f} s: {w.why}")
            if (not w.doomed and d not in c.clients and d not in self.left
                    and w.phase == "Running" and w.ip):
                agent = self._agent(w.ip, w.name)
                if agent.health():
                    c.add_device(d, agent)
                    self.agents_at[d] = (w.ip, w.name)
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
        seen, seen_uids = set(), set()
        for p in self.view.job_pods(self.namespace, self.name):
            name = p.metadata.name
            seen.add(name)
            seen_uids.add(p.metadata.uid)
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
            if p.metadata.uid not in self.worker_uids:
                self._distrust(p)
                continue
            workers[device] = k.read_worker(p, nodes)
        for name, when in list(self.expected.items()):
            if name in seen or now - when > 60:
                del self.expected[name]
        for name, when in list(self.deleting.items()):
            if name not in seen or now - when > 600:
                del self.deleting[name]
        for uid in list(self.uid_born):          # shown by the watch, or long gone
            if uid in seen_uids or now - self.uid_born[uid] > 60:
                del self.uid_born[uid]
        # UIDs of pods that are gone (not those just created: the watch may not show them yet)
        self.worker_uids -= self.worker_uids - seen_uids - set(self.uid_born)
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

    def _price(self, workers, nodes) -> None:
        """A GPU job's device profile, from the nodes its workers are placed on (the
        ``Hardware`` condition), for the solver's next decision."""
        if self.job.gpus_per_worker <= 0:
            return
        placed = [nodes[w.node] for w in workers.values()
                  if w.node in nodes and not w.doomed and w.device not in self.left]
        if not placed:
            return
        profile, ok, reason, text = hardware_of(self.job, placed)
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

    def _scale(self, workers, nodes) -> None:
        """Create the worker pods the job could use, up to its target and the per-job cap; the
        scheduler places them. A pod it cannot place stays Pending: the job's unmet demand,
        which a cluster autoscaler sees, while the job trains on the pods that run (and grows
        live when the others do). Capacity is never counted here: the scheduler knows the
        taints, selectors, affinity and priorities, and says why a pod waits."""
        gen, s = self._generation(), self.settings
        refused = guard.check_image(self.job.image, s.allowed_images)
        if refused:        # before any pod: the job waits (an admin may widen the list)
            if self.conditions.set("ImageAllowed", False, "ImageNotAllowed", refused, gen):
                self._event("Warning", "ImageNotAllowed", refused)
            return
        self.conditions.set("ImageAllowed", True, "Allowed", "any image" if not
                            s.allowed_images else "matches --allowed-images", gen)
        target = self.job.workers or self.job.max_workers
        want = min(target, s.max_pods_per_job)
        alive = [w for w in workers.values() if not w.doomed and w.device not in self.left]
        if len(alive) > want:
            self._shed(alive, len(alive) - want)
        self._report_unscheduled(alive, gen)
        if self.expected or len(alive) >= want:
            return
        if self.replacing.waiting or self.creation.waiting:
            return
        count = min(want - len(alive), s.create_batch)
        capped = (f"; capped at the operator's {s.max_pods_per_job} pods per job "
                  f"(--max-pods-per-job)" if target > s.max_pods_per_job else "")
        for _ in range(max(0, count)):
            device = self.next_device
            pod = k.worker_pod(self.body, device, secret=self.secret_name,
                               agent_port=self.job.agent_port,
                               defaults=(s.worker_cpu, s.worker_memory),
                               tls_items=pki.CERT_MANAGER_TLS_ITEMS if self.job.issuer_ref
                               else None)
            try:
                made = self.core.create_namespaced_pod(self.namespace, pod)
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
            # Trusted by the UID the apiserver gave it, kept where a restarted operator (or
            # a new leader) reads it back: the status, at once.
            self.worker_uids.add(made.metadata.uid)
            self.uid_born[made.metadata.uid] = time.monotonic()
            self._publish(force=True)
            self.log(f"worker {device}: pod created")
        if count > 0 or not capped:
            self.creation.reset()
            self.conditions.set("PodsCreated", True, "Created" if not capped else "Capped",
                                f"{len(alive) + max(0, count)} worker pods{capped}", gen)

    def _report_unscheduled(self, alive, gen: int) -> None:
        """The ``Schedulable`` condition: False, with the scheduler's own message, while some
        worker pods wait for a node; an Event when they start to wait."""
        waiting = [w for w in alive if w.unschedulable]
        if not waiting:
            self.conditions.set("Schedulable", True, "Scheduled", "every worker pod is placed",
                                gen)
            return
        text = (f"{len(waiting)} of {len(alive)} worker pods wait for a node (the job trains "
                f"on the others): {waiting[0].name}: {waiting[0].unschedulable}")
        was = self.conditions.get("Schedulable")
        self.conditions.set("Schedulable", False, "Unschedulable", text, gen)
        if not was or was["status"] == "True":      # one Event when pods start to wait
            self._event("Warning", "Unschedulable", text)

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
            self.suspension = None        # started from it: the checkpoints go on as usual
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
            if (k.owned_by(p, self.uid) and p.metadata.deletion_timestamp is None
                    and (grace is not None or p.metadata.name not in self.deleting)):
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
              "workers": len(c.members) if c else 0,
              "generation": c.generation if c else 0,
              "layout": c.layout.to_text() if c and c.layout else "",
              "step": c.progress.step if c else 0,
              "tokensPerSecond": round(c.progress.tokens_per_second, 3) if c else 0.0,
              "gpus": len(c.members) * self.job.gpus_per_worker if c else 0,
              "replacedWorkers": self.replaced,
              "hardware": c.profile.name if c else "",
              "workerUIDs": sorted(self.worker_uids)}
        if self.start_time:
            st["startTime"] = self.start_time
        if self.completion_time:
            st["completionTime"] = self.completion_time
        # None once resumed: the status is merge-patched, where null removes the field.
        st["suspension"] = self.suspension
        self._running_condition()
        st["conditions"] = self.conditions.as_list()
        if c is not None and c.progress.loss is not None:
            st["loss"] = round(c.progress.loss, 6)
        if self.last_switch:
            st["lastSwitch"] = self.last_switch
        if c is not None and c.layout is not None:
            st["data"] = self._audit()
        return st

    def _running_condition(self) -> None:
        """``Running``: True while the job trains (a switch included), False with the phase
        as the reason otherwise; with ``Complete`` and ``Failed`` (set when the job ends),
        what ``kubectl wait --for=condition=...`` waits on."""
        training = self.phase in ("Running", "Switching")
        self.conditions.set("Running", training, self.phase,
                            "training" if training else
                            "waiting for workers" if self.phase == "Pending" else
                            "suspended (spec.suspend)" if self.phase == "Suspended" else "ended",
                            self._generation())

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
        last = self.controller.reported_step()
        problems = p.audit(self.job.global_batch_size, last, since=since)
        self.data_audit = {"auditedFrom": since + 1, "auditedStep": last,
                           "exactlyOnce": not problems, "retrainedSteps": p.retrained,
                           "problems": problems[:3]}
        self.audited_at = now
        return self.data_audit

    def _publish(self, force: bool = False) -> None:
        """Patch the status when it changed; the step alone at most every status_every_s."""
        st = self.status()
        if st == self.published:
            return
        # Progress alone (step, loss, tokens/s) is patched at most
        # every status_every_s; anything else at once.
        progress = {"step": 0, "loss": 0, "tokensPerSecond": 0}
        only_step = (self.published is not None and
                     {**st, **progress} == {**self.published, **progress})
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
        for cl in self.retired:
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


def seconds_to_expiry(body: dict, now: datetime.datetime | None = None) -> float | None:
    """Seconds until a finished job's ``spec.ttlSecondsAfterFinished`` passes (<= 0: due),
    counted from its Complete or Failed condition's transition, as for a batch Job; None for
    a job that has not finished or sets no TTL."""
    ttl = (body.get("spec") or {}).get("ttlSecondsAfterFinished")
    status = body.get("status") or {}
    end = next((c for c in status.get("conditions") or []
                if c.get("type") in ("Complete", "Failed") and c.get("status") == "True"),
               None)
    if ttl is None or status.get("phase") not in TERMINAL or end is None:
        return None
    ended = datetime.datetime.fromisoformat(end["lastTransitionTime"].replace("Z", "+00:00"))
    return (ended + timedelta(seconds=ttl) - (now or _now())).total_seconds()


def _now():
    return datetime.datetime.now(datetime.timezone.utc)

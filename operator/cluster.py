"""What the operator reads from and writes to the cluster for one job, as plain data.

Reading: which nodes can host workers and which are doomed (a spot / impending-termination
taint, a cordon), how many GPUs are free on each, and each worker pod's state (its device id,
address, and whether it is doomed: being deleted, marked ``DisruptionTarget``, or on a doomed
node, with the deadline by which it will be gone).

Writing: the manifests of a job's worker pods, its headless Service, the ConfigMap that carries
the job manifest to the workers, and the Secret with the agents' token when the job names none.
Worker pods are owned by the job (owner references), named ``<job>-worker-<device>`` (or
``<job>-w<device>`` where that would pass the 63 characters of a DNS label) and labelled
``dynatrain.io/job`` and ``dynatrain.io/device``; device ids are never reused within a job, so
a device id names one process for the job's whole life. Every object is owned through the job's
UID: an object of a deleted job of the same name is recognised as another job's, never adopted.

Health: a worker pod that failed, exited, or whose container cannot start (crash loop, image
pull back-off, bad config) is *unhealthy*; the runtime replaces it. Capacity is the scheduler's
to decide: the operator creates the pods a job could use and never counts allocatable itself
(it would ignore taints, selectors, affinity and priorities); a pod the scheduler cannot place
carries its reason (:func:`unschedulable`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import yaml
from kubernetes.utils import parse_quantity

GPU = "nvidia.com/gpu"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""Kueue's label naming the LocalQueue that admits a pod (``spec.queueName``)."""
KUEUE_GATE = "kueue.x-k8s.io/admission"
"""The scheduling gate Kueue's pod webhook puts on a queued pod until it is admitted."""
KUEUE_STOP_CONDITION = "TerminationTarget"
"""The pod condition Kueue sets (reason, message) before it deletes a pod it evicts."""
KUEUE_WORKLOADS = ("kueue.x-k8s.io", "v1beta2", "workloads")
"""Kueue's Workload (group, version, plural): one per queued worker pod, which says why it
waits (its ``QuotaReserved`` condition)."""
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
"""The label on a Workload naming the UID of the pod (job) it admits."""
JOB_LABEL = "dynatrain.io/job"
DEVICE_LABEL = "dynatrain.io/device"
METRICS_PORT = 9400
HEALTH_PORT = 9401
"""The worker's plaintext port serving only the gRPC health service: the kubelet's readiness
probe cannot present the client certificate the agent's own (mutual-TLS) port requires."""
TLS_DIR = "/var/run/secrets/dynatrain-tls"
"""Where a worker mounts its job's ``<job>-agent-tls`` Secret (``--tls-dir``; operator/pki.py).
Beside the token's volume, not inside it: a mount point inside a read-only Secret volume
depends on the kubelet creating it there, and the root file system is read-only too."""
JOB_FILE = "/etc/dynatrain/job.yaml"
TOKEN_FILE = "/var/run/secrets/dynatrain/token"
WORKER_UID = 10001
"""The image's user (Dockerfile: useradd --uid 10001); workers run as it, never as root."""
SCRATCH_TMP = "/tmp"
SCRATCH_HOME = "/home/dynatrain"
"""The worker's writable scratch directories (emptyDir volumes; the root file system is
read-only): ``$TMPDIR`` and ``$HOME`` (the image's home directory, so its own files are
shadowed by an empty one: it holds nothing the worker needs)."""
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": WORKER_UID, "runAsGroup": WORKER_UID,
                "fsGroup": WORKER_UID, "seccompProfile": {"type": "RuntimeDefault"},
                # Re-own a volume only when its root is not already the group's: a large
                # dataset or checkpoint claim is not walked at every mount.
                "fsGroupChangePolicy": "OnRootMismatch"}
SHM_DIR = "/dev/shm"
"""A memory-backed emptyDir: a container runtime's own /dev/shm is 64 MiB, too small for NCCL's
shared-memory transport and for data loader workers."""
TEMPLATE_POD_FIELDS = ("nodeSelector", "affinity", "tolerations", "priorityClassName",
                       "schedulerName", "runtimeClassName", "serviceAccountName",
                       "automountServiceAccountToken", "imagePullSecrets",
                       "topologySpreadConstraints")
"""What ``spec.template.spec`` may set on the worker pod as it is; its ``volumes`` are added to
the operator's, and its worker container's ``env``, ``envFrom``, ``volumeMounts`` and extra
``resources`` to the worker's. The CRD refuses the rest, saying why."""
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                      "readOnlyRootFilesystem": True, "runAsNonRoot": True}
"""What the ``restricted`` Pod Security Standard asks, and a read-only root file system."""

DOOM_TAINTS = (
    "aws-node-termination-handler/spot-itn",          # AWS spot interruption notice
    "cloud.google.com/impending-node-termination",    # GCE preemption
    "karpenter.sh/disrupted",                         # Karpenter consolidation/interruption
    "dynatrain.io/impending-termination",             # ours, for anything else
    "node.kubernetes.io/unschedulable",               # cordon (also spec.unschedulable)
)
"""Taint keys that mean a node will go away soon: workers on it must be switched off."""
UNHEALTHY_WAITING = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                     "CreateContainerConfigError", "CreateContainerError", "RunContainerError")
"""Container waiting reasons that do not resolve by waiting: the pod is replaced."""
DNS_LABEL_MAX = 63
DEFAULT_WORKER_CPU = "1"
DEFAULT_WORKER_MEMORY = "4Gi"
"""Requests and limits of a worker whose job sets no ``spec.resources.cpu`` / ``memory``
(the operator's ``--worker-cpu`` / ``--worker-memory`` override them)."""
DEFAULT_NOTICE_S = 30.0
"""Time assumed left when a signal carries no deadline (a taint, a cordon)."""


@dataclass(frozen=True)
class NodeInfo:
    name: str
    gpus: int
    """Allocatable GPUs."""
    ready: bool
    doomed: bool
    why: str = ""
    cpu: float = 0.0
    """Allocatable CPU cores."""
    memory: int = 0
    """Allocatable memory, bytes."""
    gpu_labels: tuple[tuple[str, str], ...] = ()
    """The node's ``nvidia.com/gpu.*`` labels (product, memory...): what GPU it has."""


@dataclass(frozen=True)
class WorkerPod:
    name: str
    device: int
    node: str | None
    ip: str | None
    phase: str
    doomed: bool
    deadline_s: float
    """Seconds until it is gone (when doomed)."""
    why: str = ""
    gpus: int = 0
    unhealthy: str = ""
    """Why the pod will never serve (failed, exited, cannot start its container); "" if
    it may still."""
    uid: str = ""
    """The pod's UID: the operator trusts only pods whose UID it got from its own create
    call (``status.workerUIDs``)."""
    unschedulable: str = ""
    """The scheduler's message while it cannot place the pod (``PodScheduled=False``,
    reason ``Unschedulable``): why the job's demand is unmet."""
    queued: bool = False
    """Kueue holds it (its admission scheduling gate) until the queue's quota admits it."""


def read_node(node) -> NodeInfo:
    taints = [t.key for t in (node.spec.taints or [])]
    doom = [k for k in taints if k in DOOM_TAINTS]
    if node.spec.unschedulable:
        doom.append("cordoned")
    ready = any(c.type == "Ready" and c.status == "True"
                for c in (node.status.conditions or []))
    alloc = node.status.allocatable or {}
    gpus = int(alloc.get(GPU, "0"))
    return NodeInfo(node.metadata.name, gpus, ready, bool(doom), ", ".join(doom),
                    cpu=float(parse_quantity(alloc.get("cpu", "0"))),
                    memory=int(parse_quantity(alloc.get("memory", "0"))),
                    gpu_labels=tuple(sorted((key, value) for key, value in (
                        node.metadata.labels or {}).items() if key.startswith("nvidia.com/gpu."))))


def pod_gpus(pod) -> int:
    total = 0
    for c in pod.spec.containers:
        limits = (c.resources.limits or {}) if c.resources else {}
        total += int(limits.get(GPU, "0"))
    return total


def pod_requests(pod) -> tuple[float, int]:
    """CPU cores and memory bytes the pod's containers request (what the scheduler counts)."""
    cpu, memory = 0.0, 0
    for c in pod.spec.containers:
        req = (c.resources.requests or {}) if c.resources else {}
        cpu += float(parse_quantity(req.get("cpu", "0")))
        memory += int(parse_quantity(req.get("memory", "0")))
    return cpu, memory


def unhealthy_reason(pod) -> str:
    """Why a worker pod will never serve, or "": it failed or exited (workers run until the
    job ends, and their restartPolicy is Never), or a container waits for a reason that
    waiting does not cure (a crash loop, an image that cannot be pulled, a bad config)."""
    status = pod.status
    if status is None:
        return ""
    if status.phase in ("Failed", "Succeeded"):
        return f"pod {status.phase}" + (f" ({status.reason})" if status.reason else "")
    for c in status.container_statuses or []:
        waiting = c.state.waiting if c.state else None
        if waiting is not None and waiting.reason in UNHEALTHY_WAITING:
            return f"container {c.name}: {waiting.reason}" + (
                f": {waiting.message}" if waiting.message else "")
        term = c.state.terminated if c.state else None
        if term is not None and pod.spec.restart_policy == "Never":
            return f"container {c.name} exited with code {term.exit_code}"
    return ""


def owned_by(obj, uid: str) -> bool:
    """Whether ``obj`` (a client model object) is controlled by the job with this UID."""
    return any(r.uid == uid and r.controller for r in obj.metadata.owner_references or [])


def foreign_owner(obj, uid: str) -> str:
    """"" if ``obj`` belongs to the job with this UID; else who owns it, in words."""
    refs = obj.metadata.owner_references or []
    if any(r.uid == uid for r in refs):
        return ""
    for r in refs:
        if r.kind == "DynaTrainJob":
            return f"a previous DynaTrainJob {r.name} (uid {r.uid})"
    return ", ".join(f"{r.kind} {r.name}" for r in refs) or "nobody (created by hand)"


def device_of(pod) -> int | None:
    """The pod's device id from its label, or None when it has none or not a number."""
    value = (pod.metadata.labels or {}).get(DEVICE_LABEL, "")
    return int(value) if value.isdigit() else None


def read_worker(pod, nodes: dict[str, NodeInfo], now: datetime.datetime | None = None
                ) -> WorkerPod:
    now = now or datetime.datetime.now(datetime.timezone.utc)
    doomed, why, deadline = False, "", DEFAULT_NOTICE_S
    meta = pod.metadata
    if meta.deletion_timestamp is not None:
        doomed, why = True, "pod deleted"
        deadline = max(0.0, (meta.deletion_timestamp - now).total_seconds())
    for c in (pod.status.conditions or []) if pod.status else []:
        if c.type == "DisruptionTarget" and c.status == "True":
            doomed, why = True, why or f"DisruptionTarget ({c.reason})"
        if c.type == KUEUE_STOP_CONDITION and c.status == "True":
            # Kueue evicts (a preemption, a reclaim): it says why before it deletes the pod.
            doomed = True
            why = f"Kueue: {c.reason}: {c.message}" if not why or why == "pod deleted" \
                else why
    node = nodes.get(pod.spec.node_name) if pod.spec.node_name else None
    unhealthy = unhealthy_reason(pod)
    if node is not None and node.doomed:
        doomed, why = True, why or f"node {node.name}: {node.why}"
    if pod.spec.node_name and pod.spec.node_name not in nodes:
        doomed, why, deadline = True, why or f"node {pod.spec.node_name} is gone", 0.0
    return WorkerPod(meta.name, int(meta.labels[DEVICE_LABEL]), pod.spec.node_name,
                     pod.status.pod_ip if pod.status else None,
                     (pod.status.phase if pod.status else None) or "Pending", doomed, deadline,
                     why, pod_gpus(pod), unhealthy, meta.uid or "", unschedulable(pod),
                     queued=any(g.name == KUEUE_GATE for g in pod.spec.scheduling_gates or []))


def kueue_waits(workloads) -> dict[str, str]:
    """Pod UID -> why Kueue has not admitted it (the message of its Workload's
    ``QuotaReserved`` condition while False, e.g. "couldn't assign flavors to pod set main:
    insufficient unused quota for nvidia.com/gpu in flavor default, 1 more needed"), from a
    list of Workloads (dicts, as the custom-objects API returns them)."""
    out = {}
    for wl in workloads:
        uid = ((wl.get("metadata") or {}).get("labels") or {}).get(KUEUE_JOB_UID_LABEL)
        for c in (wl.get("status") or {}).get("conditions") or []:
            if uid and c.get("type") == "QuotaReserved" and c.get("status") == "False":
                out[uid] = c.get("message") or c.get("reason") or ""
    return out


def unschedulable(pod) -> str:
    """The scheduler's own reason a pod waits ("0/5 nodes are available: 3 Insufficient
    nvidia.com/gpu, 2 node(s) had untolerated taint ..."), or "" once it is placed."""
    if pod.spec.node_name or not pod.status:
        return ""
    for c in pod.status.conditions or []:
        if c.type == "PodScheduled" and c.status == "False" and c.reason != "SchedulingGated":
            return c.message or c.reason or "not scheduled"
    return ""


def worker_resources(spec: dict, defaults: tuple[str, str]) -> tuple[str, str]:
    res = spec.get("resources", {})
    return (str(res.get("cpu") or defaults[0]), str(res.get("memory") or defaults[1]))


def owner_reference(body) -> dict:
    return {"apiVersion": body["apiVersion"], "kind": body["kind"],
            "name": body["metadata"]["name"], "uid": body["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True}


def names(job: str) -> dict[str, str]:
    return {"service": f"{job}-workers", "configmap": f"{job}-spec",
            "secret": f"{job}-agent-token"}


def pod_name(job: str, device: int) -> str:
    """``<job>-worker-<device>``; ``<job>-w<device>`` where that would not be a DNS label
    (the CRD keeps job names to 52 characters, so device ids up to 10^9 fit)."""
    name = f"{job}-worker-{device}"
    return name if len(name) <= DNS_LABEL_MAX else f"{job}-w{device}"


def spec_configmap(body) -> dict:
    n = body["metadata"]["name"]
    manifest = {"apiVersion": body["apiVersion"], "kind": body["kind"],
                "metadata": {"name": n, "namespace": body["metadata"]["namespace"]},
                "spec": dict(body["spec"])}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": names(n)["configmap"], "labels": {JOB_LABEL: n},
                         "ownerReferences": [owner_reference(body)]},
            "data": {"job.yaml": yaml.safe_dump(manifest, sort_keys=False)}}


def token_secret(body, token: str) -> dict:
    n = body["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Secret",
            # The label a job-named Secret needs (operator/guard.py), here for uniformity.
            "metadata": {"name": names(n)["secret"],
                         "labels": {JOB_LABEL: n, "dynatrain.io/agent-token": "true"},
                         "ownerReferences": [owner_reference(body)]},
            "type": "Opaque", "stringData": {"token": token}}


def headless_service(body, agent_port: int) -> dict:
    n = body["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": names(n)["service"], "labels": {JOB_LABEL: n},
                         "ownerReferences": [owner_reference(body)]},
            "spec": {"clusterIP": "None", "selector": {JOB_LABEL: n},
                     "ports": [{"name": "agent", "port": agent_port},
                               {"name": "metrics", "port": METRICS_PORT}]}}


def worker_pod(body, device: int, *, secret: str, agent_port: int,
               defaults: tuple[str, str] = (DEFAULT_WORKER_CPU, DEFAULT_WORKER_MEMORY),
               tls_items: dict[str, str] | None = None) -> dict:
    """A worker pod; requests equal limits (a Guaranteed pod: what a quota can count, and
    the node's other tenants are safe from it).

    Hardened to the ``restricted`` Pod Security Standard: user and group 10001, no
    capabilities, no privilege escalation, the runtime's default seccomp profile, and a
    read-only root file system. What a worker writes, and where it may:

    - checkpoints (``spec.checkpoint``) and the trained model (``spec.output.hf``, written
      beside it): on the job's claim, mounted read-write at ``spec.checkpoint.path``; an
      ``output.hf`` elsewhere must be on a volume the image or ``spec`` provides;
    - temporary files (Python's ``tempfile``, torch inductor's cache
      ``/tmp/torchinductor_<user>``): ``/tmp`` (``TMPDIR``), an emptyDir;
    - caches under ``$HOME`` (``~/.cache/dynatrain`` of tokenised text data, triton's
      ``~/.triton``, Hugging Face and torch hub under ``~/.cache``): ``/home/dynatrain``
      (``HOME``, ``XDG_CACHE_HOME=$HOME/.cache``), an emptyDir;
    - no bytecode (``PYTHONDONTWRITEBYTECODE=1``; the image's modules are compiled when it
      is built).

    Both emptyDirs live as long as the pod (on the node's disk; no size limit, since a
    compile cache that hit one would get the pod evicted mid-training). ``fsGroup``: volumes
    whose ownership the kubelet manages (most block-backed claims) are made writable by group
    10001; a shared file system claim (NFS) must be writable by that user or group itself.
    """
    n = body["metadata"]["name"]
    spec = body["spec"]
    res = spec.get("resources", {})
    cpu, memory = worker_resources(spec, defaults)
    requests = {"cpu": cpu, "memory": memory}
    limits = dict(requests)
    if res.get("gpus"):
        limits[GPU] = requests[GPU] = str(res["gpus"])
    # Metrics on every address of the pod: the kubelet's port-forward connects to the pod's
    # loopback, and the metrics are no secret (the agent stays on the pod IP, behind mTLS).
    args = ["--job", JOB_FILE, "--device", str(device), "--host", "$(POD_IP)",
            "--metrics-host", "0.0.0.0",
            "--agent-port", str(agent_port), "--metrics-port", str(METRICS_PORT),
            "--token-file", TOKEN_FILE,
            # Mutual TLS on the agent port (the token stays a second factor); the kubelet's
            # probe asks the health service on its own plaintext port.
            "--tls-dir", TLS_DIR, "--health-port", str(HEALTH_PORT),
            # NCCL on the pod's GPU when the job asks for nvidia.com/gpu, gloo when not; a
            # GPU pod without CUDA fails at start (spec.args may override, e.g. gloo).
            "--backend", "auto"]
    if spec.get("checkpoint"):
        # Written to the claim's mount point (named here, not only in the job file, so that a
        # runner that maps mount paths, like the dev cluster's, maps it too).
        args += ["--checkpoint-dir", spec["checkpoint"].get("path", "/checkpoints")]
    args += spec.get("args", [])
    mounts = [{"name": "job", "mountPath": "/etc/dynatrain", "readOnly": True},
              {"name": "token", "mountPath": "/var/run/secrets/dynatrain", "readOnly": True}]
    volumes = [{"name": "job", "configMap": {"name": names(n)["configmap"]}},
               {"name": "token", "secret": {"secretName": secret,
                                            "items": [{"key": "token", "path": "token"}]}}]
    # The agent's serving certificate and the client CA (``tls_items``: Secret key -> file;
    # a cert-manager Secret's ca.crt becomes client-ca.crt). Under the token's mount: the
    # kubelet makes mount points inside Secret volumes itself.
    # Mode 0440: the private key readable by the worker's group (fsGroup 10001), no one else.
    mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    volumes.append({"name": "tls", "secret": {
        "secretName": f"{n}-agent-tls", "defaultMode": 0o440, "items": [
            {"key": key, "path": path} for key, path in (tls_items or {
                "client-ca.crt": "client-ca.crt", "tls.crt": "tls.crt",
                "tls.key": "tls.key"}).items()]}})
    if spec.get("checkpoint"):       # the last-resort checkpoints (every worker writes its part)
        mounts.append({"name": "checkpoints",
                       "mountPath": spec["checkpoint"].get("path", "/checkpoints")})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {
            "claimName": spec["checkpoint"]["claimName"]}})
    # Writable scratch on a read-only root file system (see the docstring).
    mounts += [{"name": "tmp", "mountPath": SCRATCH_TMP},
               {"name": "home", "mountPath": SCRATCH_HOME},
               {"name": "dshm", "mountPath": SHM_DIR}]
    shm = {"medium": "Memory"}
    if res.get("shmSize"):
        shm["sizeLimit"] = str(res["shmSize"])
    volumes += [{"name": "tmp", "emptyDir": {}}, {"name": "home", "emptyDir": {}},
                {"name": "dshm", "emptyDir": shm}]
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name(n, device),
                     "labels": {JOB_LABEL: n, DEVICE_LABEL: str(device),
                                "app.kubernetes.io/name": "dynatrain-worker",
                                "app.kubernetes.io/managed-by": "dynatrain-operator"},
                     "ownerReferences": [owner_reference(body)]},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "hostname": pod_name(n, device), "subdomain": names(n)["service"],
            "securityContext": dict(POD_SECURITY),
            "containers": [{
                "name": "worker", "image": spec["image"],
                "command": spec.get("command") or ["dynatrain", "worker"], "args": args,
                "securityContext": dict(CONTAINER_SECURITY),
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {
                            "fieldPath": "status.podIP"}}},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {
                            "fieldPath": "metadata.name"}}},
                        {"name": "DYNATRAIN_DEVICE", "value": str(device)},
                        # The scratch volumes, for the libraries that read these.
                        {"name": "TMPDIR", "value": SCRATCH_TMP},
                        {"name": "HOME", "value": SCRATCH_HOME},
                        {"name": "XDG_CACHE_HOME", "value": f"{SCRATCH_HOME}/.cache"},
                        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
                "ports": [{"name": "agent", "containerPort": agent_port},
                          {"name": "metrics", "containerPort": METRICS_PORT},
                          {"name": "health", "containerPort": HEALTH_PORT}],
                "resources": {"limits": limits, "requests": requests},
                "volumeMounts": mounts,
                "readinessProbe": {"grpc": {"port": HEALTH_PORT}, "periodSeconds": 5},
            }],
            "volumes": volumes,
            "tolerations": [],
            # Workers never call the Kubernetes API (the template may ask for a token).
            "automountServiceAccountToken": False,
        },
    }
    pod = with_template(pod, spec.get("template") or {})
    if spec.get("queueName"):          # Kueue admits the pod against the queue's quota
        pod["metadata"]["labels"][KUEUE_QUEUE_LABEL] = spec["queueName"]
    return pod


def with_template(pod: dict, template: dict) -> dict:
    """``pod`` with ``spec.template`` merged onto it (see :data:`TEMPLATE_POD_FIELDS`). Only
    what a template may set is read, so a field the CRD refuses can never reach a pod even
    from an object stored before a rule existed; the operator's labels, volumes, mounts and
    environment win over the template's."""
    meta, tspec = template.get("metadata") or {}, template.get("spec") or {}
    pod["metadata"]["labels"] = {**(meta.get("labels") or {}), **pod["metadata"]["labels"]}
    if meta.get("annotations"):
        pod["metadata"]["annotations"] = dict(meta["annotations"])
    ps = pod["spec"]
    for key in TEMPLATE_POD_FIELDS:
        if key in tspec:
            ps[key] = tspec[key]
    ours = {v["name"] for v in ps["volumes"]}
    ps["volumes"] += [v for v in tspec.get("volumes") or [] if v.get("name") not in ours]
    worker = ps["containers"][0]
    extra = next((c for c in tspec.get("containers") or [] if c.get("name") == "worker"), {})
    set_env = {e["name"] for e in worker["env"]}
    worker["env"] += [e for e in extra.get("env") or [] if e.get("name") not in set_env]
    if extra.get("envFrom"):
        worker["envFrom"] = list(extra["envFrom"])
    taken = {m["mountPath"].rstrip("/") for m in worker["volumeMounts"]}
    worker["volumeMounts"] += [m for m in extra.get("volumeMounts") or []
                               if m.get("mountPath", "").rstrip("/") not in taken]
    res = extra.get("resources") or {}
    own = {"cpu", "memory", GPU}
    for kind in ("limits", "requests"):
        for name, value in (res.get(kind) or {}).items():
            if name not in own:
                worker["resources"][kind][name] = str(value)
    # An extended resource (an RDMA device) is given by its limit; its request must equal it.
    for name, value in (res.get("limits") or {}).items():
        if name not in own:
            worker["resources"]["requests"].setdefault(name, str(value))
    return pod


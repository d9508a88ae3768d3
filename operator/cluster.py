"""What the operator reads from and writes to the cluster for one job, as plain data.

Reading: which nodes can host workers and which are doomed (a spot / impending-termination
taint, a cordon), how many GPUs are free on each, and each worker pod's state (its device id,
address, and whether it is doomed: being deleted, marked ``DisruptionTarget``, or on a doomed
node, with the deadline by which it will be gone).

Writing: the manifests of a job's worker pods, its headless Service, the ConfigMap that carries
the job manifest to the workers, and the Secret with the agents' token when the job names none.
Worker pods are owned by the job (owner references), named ``<job>-worker-<device>`` and
labelled ``dynatrain.io/job`` and ``dynatrain.io/device``; device ids are never reused within a
job, so a device id names one process for the job's whole life.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import yaml

GPU = "nvidia.com/gpu"
JOB_LABEL = "dynatrain.io/job"
DEVICE_LABEL = "dynatrain.io/device"
METRICS_PORT = 9400
JOB_FILE = "/etc/dynatrain/job.yaml"
TOKEN_FILE = "/var/run/secrets/dynatrain/token"

DOOM_TAINTS = (
    "aws-node-termination-handler/spot-itn",          # AWS spot interruption notice
    "cloud.google.com/impending-node-termination",    # GCE preemption
    "karpenter.sh/disrupted",                         # Karpenter consolidation/interruption
    "dynatrain.io/impending-termination",             # ours, for anything else
    "node.kubernetes.io/unschedulable",               # cordon (also spec.unschedulable)
)
"""Taint keys that mean a node will go away soon: workers on it must be switched off."""
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


def read_node(node) -> NodeInfo:
    taints = [t.key for t in (node.spec.taints or [])]
    doom = [k for k in taints if k in DOOM_TAINTS]
    if node.spec.unschedulable:
        doom.append("cordoned")
    ready = any(c.type == "Ready" and c.status == "True"
                for c in (node.status.conditions or []))
    gpus = int((node.status.allocatable or {}).get(GPU, "0"))
    return NodeInfo(node.metadata.name, gpus, ready, bool(doom), ", ".join(doom))


def pod_gpus(pod) -> int:
    total = 0
    for c in pod.spec.containers:
        limits = (c.resources.limits or {}) if c.resources else {}
        total += int(limits.get(GPU, "0"))
    return total


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
    node = nodes.get(pod.spec.node_name) if pod.spec.node_name else None
    if node is not None and node.doomed:
        doomed, why = True, why or f"node {node.name}: {node.why}"
    if pod.spec.node_name and pod.spec.node_name not in nodes:
        doomed, why, deadline = True, why or f"node {pod.spec.node_name} is gone", 0.0
    return WorkerPod(meta.name, int(meta.labels[DEVICE_LABEL]), pod.spec.node_name,
                     pod.status.pod_ip if pod.status else None,
                     (pod.status.phase if pod.status else None) or "Pending", doomed, deadline,
                     why, pod_gpus(pod))


def free_slots(nodes: dict[str, NodeInfo], all_pods, gpus_per_worker: int) -> int:
    """Workers that could still be placed on healthy nodes (GPU requests of every pod on a
    node count against it)."""
    if gpus_per_worker <= 0:
        return 1 << 20
    used: dict[str, int] = {}
    for p in all_pods:
        if p.spec.node_name and (p.status is None or p.status.phase not in ("Succeeded",
                                                                             "Failed")):
            used[p.spec.node_name] = used.get(p.spec.node_name, 0) + pod_gpus(p)
    return sum(max(0, n.gpus - used.get(n.name, 0)) // gpus_per_worker
               for n in nodes.values() if n.ready and not n.doomed)


def owner_reference(body) -> dict:
    return {"apiVersion": body["apiVersion"], "kind": body["kind"],
            "name": body["metadata"]["name"], "uid": body["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True}


def names(job: str) -> dict[str, str]:
    return {"service": f"{job}-workers", "configmap": f"{job}-spec",
            "secret": f"{job}-agent-token"}


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
            "metadata": {"name": names(n)["secret"], "labels": {JOB_LABEL: n},
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


def worker_pod(body, device: int, *, secret: str, agent_port: int) -> dict:
    n = body["metadata"]["name"]
    spec = body["spec"]
    res = spec.get("resources", {})
    limits, requests = {}, {}
    if res.get("gpus"):
        limits[GPU] = str(res["gpus"])
    for key in ("cpu", "memory"):
        if res.get(key) is not None:
            requests[key] = str(res[key])
    args = ["--job", JOB_FILE, "--device", str(device), "--host", "$(POD_IP)",
            "--agent-port", str(agent_port), "--metrics-port", str(METRICS_PORT),
            "--token-file", TOKEN_FILE, *spec.get("args", [])]
    mounts = [{"name": "job", "mountPath": "/etc/dynatrain", "readOnly": True},
              {"name": "token", "mountPath": "/var/run/secrets/dynatrain", "readOnly": True}]
    volumes = [{"name": "job", "configMap": {"name": names(n)["configmap"]}},
               {"name": "token", "secret": {"secretName": secret,
                                            "items": [{"key": "token", "path": "token"}]}}]
    if spec.get("checkpoint"):       # the last-resort checkpoints (every worker writes its part)
        mounts.append({"name": "checkpoints",
                       "mountPath": spec["checkpoint"].get("path", "/checkpoints")})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {
            "claimName": spec["checkpoint"]["claimName"]}})
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{n}-worker-{device}",
                     "labels": {JOB_LABEL: n, DEVICE_LABEL: str(device),
                                "app.kubernetes.io/name": "dynatrain-worker",
                                "app.kubernetes.io/managed-by": "dynatrain-operator"},
                     "ownerReferences": [owner_reference(body)]},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "hostname": f"{n}-worker-{device}", "subdomain": names(n)["service"],
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
            "containers": [{
                "name": "worker", "image": spec["image"],
                "command": spec.get("command") or ["dynatrain", "worker"], "args": args,
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {
                            "fieldPath": "status.podIP"}}},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {
                            "fieldPath": "metadata.name"}}},
                        {"name": "DYNATRAIN_DEVICE", "value": str(device)}],
                "ports": [{"name": "agent", "containerPort": agent_port},
                          {"name": "metrics", "containerPort": METRICS_PORT}],
                "resources": {"limits": limits, "requests": requests},
                "volumeMounts": mounts,
                "readinessProbe": {"grpc": {"port": agent_port}, "periodSeconds": 5},
            }],
            "volumes": volumes,
            "tolerations": [],
        },
    }


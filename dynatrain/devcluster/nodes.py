"""Simulated GPU nodes and the capacity signals the operator reacts to.

Nodes are ordinary Node objects created through the real apiserver; kwok
(which manages every node carrying the :data:`KWOK_ANNOTATION`) plays their
kubelet: it marks them Ready and moves pods bound to them to Running with a
pod IP. The manifests come from pure ``build_*`` functions; the helpers below
them act on a live cluster through the official ``kubernetes`` client and
produce exactly the signals a cloud would: cordon, a termination taint, node
deletion, and a pod's ``DisruptionTarget`` condition.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI's --help imports this module without the client installed
    from kubernetes import client

GPU_RESOURCE = "nvidia.com/gpu"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_PRODUCTS = {"p5.48xlarge": "NVIDIA-H100-80GB-HBM3", "p5e.48xlarge": "NVIDIA-H200",
                "p4d.24xlarge": "NVIDIA-A100-SXM4-40GB", "p4de.24xlarge": "NVIDIA-A100-SXM4-80GB",
                "g6e.48xlarge": "NVIDIA-L40S", "g6.48xlarge": "NVIDIA-L4"}
"""The GPU of a cloud instance type, as NVIDIA's GPU feature discovery labels a node of it:
a GPU pool's nodes carry that label unless the pool's ``labels`` set one."""
NODE_INDEX_LABEL = "dynatrain.io/node-index"
# kwok is started with --manage-nodes-with-annotation-selector on this
# annotation (the kwok convention), so that a real node joined to the same
# apiserver one day would not be hijacked.
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")

# Taints that clouds put on a node shortly before taking it away.
SPOT_INTERRUPTION_TAINT = "aws-node-termination-handler/spot-itn"
GCE_IMPENDING_TERMINATION_TAINT = "cloud.google.com/impending-node-termination"

_STRATEGIC = "application/strategic-merge-patch+json"
_MERGE = "application/merge-patch+json"
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|M|G|T)?$")
_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True, kw_only=True)
class Taint:
    """A node taint, as in ``kubectl taint KEY=VALUE:EFFECT``."""

    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def __post_init__(self) -> None:
        if self.effect not in _TAINT_EFFECTS:
            raise ValueError(f"taint {self.key}: effect={self.effect!r} is not one of "
                             f"{_TAINT_EFFECTS}")

    def to_dict(self) -> dict[str, str]:
        return {"key": self.key, "value": self.value, "effect": self.effect}


@dataclass(frozen=True, kw_only=True)
class NodePool:
    """A set of identical simulated nodes."""

    count: int = 2
    """How many nodes."""
    gpus_per_node: int = 8
    """``nvidia.com/gpu`` capacity of each node; 0 makes CPU-only nodes."""
    cpu: str = "96"
    """CPU capacity (a Kubernetes quantity)."""
    memory: str = "1Ti"
    """Memory capacity (a Kubernetes quantity)."""
    max_pods: int = 110
    """Pod capacity, as a kubelet's --max-pods."""
    instance_type: str = "p5.48xlarge"
    """Value of the ``node.kubernetes.io/instance-type`` label."""
    name_prefix: str = "gpu-node"
    """Nodes are named ``<prefix>-<index>``."""
    first_index: int = 0
    """Index of the first node (``dynatrain.io/node-index``)."""
    labels: dict[str, str] = field(default_factory=dict)
    """Extra labels on every node."""
    taints: tuple[Taint, ...] = ()
    """Taints on every node from the start."""

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"NodePool.count={self.count} must be >= 0")
        if self.gpus_per_node < 0:
            raise ValueError(f"NodePool.gpus_per_node={self.gpus_per_node} must be >= 0")
        for name in ("cpu", "memory"):
            value = getattr(self, name)
            if not _QUANTITY.match(value):
                raise ValueError(f"NodePool.{name}={value!r} is not a Kubernetes quantity")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.name_prefix):
            raise ValueError(f"NodePool.name_prefix={self.name_prefix!r} is not a DNS label")

    def node_names(self) -> list[str]:
        return [f"{self.name_prefix}-{i}"
                for i in range(self.first_index, self.first_index + self.count)]


def build_node_manifest(pool: NodePool, index: int) -> dict:
    """The Node object for node ``index`` of ``pool`` (pure)."""
    name = f"{pool.name_prefix}-{index}"
    capacity = {"cpu": pool.cpu, "memory": pool.memory, "pods": str(pool.max_pods)}
    if pool.gpus_per_node:
        capacity[GPU_RESOURCE] = str(pool.gpus_per_node)
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        INSTANCE_TYPE_LABEL: pool.instance_type,
        NODE_INDEX_LABEL: str(index),
        **pool.labels,
    }
    if pool.gpus_per_node and pool.instance_type in GPU_PRODUCTS:
        labels.setdefault(GPU_PRODUCT_LABEL, GPU_PRODUCTS[pool.instance_type])
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1]},
        },
        "spec": {"taints": [t.to_dict() for t in pool.taints]},
        # A kubelet reports capacity when it registers; kwok keeps what is
        # here and only adds conditions, addresses and node info.
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }


def add_nodes(core: client.CoreV1Api, pool: NodePool) -> list[str]:
    """Create the nodes of ``pool``; return their names."""
    names = []
    for index in range(pool.first_index, pool.first_index + pool.count):
        node = core.create_node(body=build_node_manifest(pool, index))
        names.append(node.metadata.name)
    return names


def node_is_ready(node: client.V1Node) -> bool:
    conditions = (node.status.conditions if node.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def cordon(core: client.CoreV1Api, name: str, *, unschedulable: bool = True) -> None:
    """Mark node ``name`` unschedulable (``kubectl cordon``), or undo it."""
    core.patch_node(name=name, body={"spec": {"unschedulable": unschedulable}},
                    _content_type=_STRATEGIC)


def uncordon(core: client.CoreV1Api, name: str) -> None:
    cordon(core, name, unschedulable=False)


def taint(core: client.CoreV1Api, name: str, new: Taint) -> None:
    """Add ``new`` to node ``name``, replacing a taint with the same key and effect."""
    node = core.read_node(name=name)
    # Node taints have no merge key, so the whole list is replaced; the
    # resourceVersion makes that a compare-and-swap against concurrent edits.
    taints = _taints_json(core, [t for t in (node.spec.taints or [])
                                 if not (t.key == new.key and t.effect == new.effect)])
    core.patch_node(name=name, body={
        "metadata": {"resourceVersion": node.metadata.resource_version},
        "spec": {"taints": taints + [new.to_dict()]},
    }, _content_type=_MERGE)


def untaint(core: client.CoreV1Api, name: str, key: str) -> None:
    """Remove every taint with ``key`` from node ``name``."""
    node = core.read_node(name=name)
    taints = _taints_json(core, [t for t in (node.spec.taints or []) if t.key != key])
    core.patch_node(name=name, body={
        "metadata": {"resourceVersion": node.metadata.resource_version},
        "spec": {"taints": taints},
    }, _content_type=_MERGE)


def _taints_json(core: client.CoreV1Api, taints: list) -> list[dict]:
    # The API's own field names (timeAdded, not time_added), so that taints
    # kept in the list come back unchanged.
    return [core.api_client.sanitize_for_serialization(t) for t in taints]


def delete_node(core: client.CoreV1Api, name: str) -> None:
    """Delete node ``name``, as a cloud does when it reclaims the machine.

    Its pods are left to the pod garbage collector of kube-controller-manager,
    which deletes pods bound to a node that no longer exists once the node has
    been gone for its quarantine time (40 s, fixed in Kubernetes). The pod
    runner (:mod:`.pods`) stops their processes at once: the machine is gone.
    """
    core.delete_node(name=name)


NODE_LEASE_NAMESPACE = "kube-node-lease"
STOPPED_HOLDER = "dynatrain-devcluster/heartbeat-stopped"
"""The holder a stopped node's lease is given: kwok renews only leases it holds."""
_FOREVER_S = 10 * 365 * 24 * 3600


def stop_heartbeat(coordination: client.CoordinationV1Api, name: str) -> None:
    """Make node ``name`` fall silent, as a machine that crashed or lost its network does.

    A node's heartbeat is its Lease in ``kube-node-lease``, which kwok renews
    while it holds it. This hands the lease to another holder for good, without
    renewing it, so kwok stops renewing it and stops playing the node's kubelet
    (it acts only on nodes whose lease it holds). Everything after that is
    kube-controller-manager's own doing: after the node monitor grace period
    the node lifecycle controller marks the node NotReady (Unknown) and taints
    it ``node.kubernetes.io/unreachable``, and the taint-eviction controller
    evicts its pods (``DisruptionTarget``) once their toleration ends. The pod
    runner treats the node's machine as gone and stops its processes at once.
    Evicted pods stay Terminating, as on a real cluster, until the node comes
    back or is deleted.
    """
    _retry_conflicts(lambda: _set_holder(coordination, name, STOPPED_HOLDER, _FOREVER_S))


def resume_heartbeat(coordination: client.CoordinationV1Api, name: str) -> None:
    """Undo :func:`stop_heartbeat`: the lease expires at once and kwok takes it back."""
    _retry_conflicts(lambda: _set_holder(coordination, name, STOPPED_HOLDER, 1))


def heartbeat_stopped(lease: client.V1Lease) -> bool:
    """Whether ``lease`` (a node's) was stopped by :func:`stop_heartbeat`."""
    return (lease.spec.holder_identity == STOPPED_HOLDER
            and (lease.spec.lease_duration_seconds or 0) > 1)


def _set_holder(coordination, name: str, holder: str, duration_s: int) -> None:
    lease = coordination.read_namespaced_lease(name, NODE_LEASE_NAMESPACE)
    lease.spec.holder_identity = holder
    lease.spec.lease_duration_seconds = duration_s
    # replace, not patch: the resourceVersion makes it a compare-and-swap against kwok's
    # renewal, and the renew time stays the last real heartbeat.
    coordination.replace_namespaced_lease(name, NODE_LEASE_NAMESPACE, lease)


def _retry_conflicts(fn, attempts: int = 10) -> None:
    from kubernetes.client.rest import ApiException

    for attempt in range(attempts):
        try:
            return fn()
        except ApiException as e:
            if e.status != 409 or attempt == attempts - 1:
                raise


def set_disruption_target(
    core: client.CoreV1Api, namespace: str, pod: str, *,
    reason: str = "TerminationByKubelet", message: str = "node is shutting down",
) -> None:
    """Set condition ``DisruptionTarget=True`` on a pod, via the status subresource.

    This is how Kubernetes announces that a pod is about to be disrupted
    (preemption, eviction, node shutdown): the condition comes before the
    deletion, which gives the operator its chance to move state away.
    """
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    # Pod conditions merge on `type`, so a strategic merge patch adds or
    # updates this one condition and keeps the others.
    body = {"status": {"conditions": [{
        "type": "DisruptionTarget", "status": "True", "reason": reason,
        "message": message, "lastTransitionTime": now,
    }]}}
    core.patch_namespaced_pod_status(name=pod, namespace=namespace, body=body,
                                     _content_type=_STRATEGIC)

"""A real Kubernetes control plane on loopback for tests and for trying the operator.

``dynatrain.devcluster`` builds etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kubectl and kwok from pinned Go modules (:mod:`.build`), starts
them on 127.0.0.1 with a throw-away PKI (:mod:`.certs`, :mod:`.cluster`),
simulates GPU nodes with kwok (:mod:`.nodes`), including the signals the
operator reacts to (cordon, termination taints, node deletion, a node whose
heartbeat stops, a pod's DisruptionTarget condition), and runs pods' commands
as local processes (:mod:`.pods`). Nothing here imitates the Kubernetes API: every call goes to a
real apiserver.

Typical use::

    from dynatrain.devcluster import ClusterConfig, DevCluster, NodePool

    with DevCluster(ClusterConfig(pools=(NodePool(count=4, gpus_per_node=8),))) as cluster:
        core = cluster.core()
        ...
"""

from .errors import DevClusterError
from .nodes import NodePool, Taint

__all__ = ["ClusterConfig", "DevCluster", "DevClusterError", "NodePool", "Taint"]


def __getattr__(name: str):
    # The cluster module needs the `kubernetes` client; importing it lazily
    # keeps `dynatrain dev cluster --help` working where it is not installed.
    if name in ("ClusterConfig", "DevCluster"):
        from . import cluster
        return getattr(cluster, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

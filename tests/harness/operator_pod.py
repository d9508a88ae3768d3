"""The operator as the chart deploys it: its Deployment, in the slim operator image, on a real node.

:class:`~harness.operator_process.Operator` runs `dynatrain operator` as a host process from
`.venv-operator` (the slim image's environment). This runs the real thing on the dev cluster's
kubelet-run node (test_real_node.py): the chart's own Deployment, rendered by the real helm
(the chart's RBAC applied by :func:`~harness.chart_rbac.chart_identity`), its pod in a container
of ``localhost/dynatrain-operator:dev`` (:func:`dynatrain.devcluster.images.operator_image`: no
torch), as the chart's ServiceAccount with the token the kubelet projects, a read-only root file
system, the chart's probes against kopf's liveness endpoint.

What differs from a cluster, and why, each an explicit change to the rendered Deployment:

- ``hostNetwork: true`` and ``KUBERNETES_SERVICE_HOST``/``PORT`` set to the apiserver's
  address: the dev cluster has no kube-proxy, so the ``kubernetes`` Service's ClusterIP leads
  nowhere, and its apiserver listens on loopback only. In the node's network namespace the pod
  reaches it there; the pod IP is then the node's (the bridge's gateway), where the workers
  reach the job's rendezvous store (the chart's ``POD_IP``) and where the operator reaches
  their agents.
- The health and metrics ports are free ports of this host (in the node's network namespace
  they are the host's); one replica; a short operator tick, as the host-process tests use.
"""

from __future__ import annotations

import copy
import subprocess
import time
from urllib.parse import urlparse

import yaml

from dynatrain.ports import free_port
from harness.chart_rbac import CHART, RELEASE, RELEASE_NAMESPACE, _helm, chart_identity

def operator_deployment(cluster, image: str, node: str, *, tick_s: float = 0.3,
                        health_port: int | None = None, metrics_port: int | None = None) -> dict:
    """The chart's Deployment (release :data:`RELEASE` in :data:`RELEASE_NAMESPACE`) running
    ``image`` on ``node``, changed only as the module's docstring says."""
    repository, _, tag = image.rpartition(":")
    health_port = health_port or free_port()
    metrics_port = metrics_port or free_port()
    server = urlparse(cluster.server)
    values = ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
              "--set", "image.pullPolicy=Never", "--set", "operator.replicas=1",
              "--set", f"operator.healthPort={health_port}",
              "--set", f"operator.metricsPort={metrics_port}"]
    out = _helm(cluster, "template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
                *values)
    (deploy,) = [d for d in yaml.safe_load_all(out) if d and d.get("kind") == "Deployment"]
    deploy = copy.deepcopy(deploy)
    pod = deploy["spec"]["template"]["spec"]
    pod["hostNetwork"] = True
    pod["nodeSelector"] = {"kubernetes.io/hostname": node}
    (container,) = pod["containers"]
    container["env"] += [
        {"name": "KUBERNETES_SERVICE_HOST", "value": server.hostname},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(server.port)},
        {"name": "DYNATRAIN_OPERATOR_TICK_S", "value": str(tick_s)},
    ]
    return deploy


class OperatorPod:
    """The chart's operator Deployment on a real node: :meth:`start`, :meth:`stop`,
    :meth:`logs` (through the kubelet, as `kubectl logs` reads them)."""

    def __init__(self, cluster, kubectl, image: str, node: str, workdir):
        chart_identity(cluster)            # the chart's RBAC and the release namespace
        self.cluster, self.kubectl, self.workdir = cluster, kubectl, workdir
        self.deployment = operator_deployment(cluster, image, node)
        self.name = self.deployment["metadata"]["name"]
        self.selector = ",".join(f"{k}={v}" for k, v in
                                 self.deployment["spec"]["selector"]["matchLabels"].items())
        self._last_logs = ""

    def start(self, timeout: float = 180.0) -> dict:
        """Apply the Deployment; return its pod once it is Ready (the startup and readiness
        probes passed: kopf's liveness endpoint answers)."""
        path = self.workdir / "operator-deployment.yaml"
        path.write_text(yaml.safe_dump(self.deployment))
        self.kubectl("apply", "-f", str(path))
        core = self.cluster.core()
        deadline = time.monotonic() + timeout
        while True:
            pods = core.list_namespaced_pod(RELEASE_NAMESPACE, label_selector=self.selector).items
            ready = [p for p in pods if p.status.phase == "Running" and any(
                c.type == "Ready" and c.status == "True" for c in p.status.conditions or ())]
            if ready:
                return ready[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"the operator's pod did not become Ready in "
                                     f"{timeout:.0f} s:\n{self.describe()}\n{self.logs()}")
            time.sleep(1)

    def describe(self) -> str:
        """The operator's pods, one line each (an evicted or crashing one says so)."""
        pods = self.cluster.core().list_namespaced_pod(RELEASE_NAMESPACE,
                                                       label_selector=self.selector).items
        return "\n".join(
            f"operator pod {p.metadata.name}: {p.status.phase} {p.status.reason or ''} "
            f"{p.status.message or ''} restarts "
            f"{[c.restart_count for c in p.status.container_statuses or ()]}"
            for p in pods) or "no operator pod"

    def logs(self) -> str:
        try:
            self._last_logs = self.kubectl("logs", "-n", RELEASE_NAMESPACE,
                                           f"deployment/{self.name}", "--tail", "400")
        except (AssertionError, subprocess.SubprocessError):
            pass                           # gone: the last logs read
        return self._last_logs

    def stop(self) -> None:
        self.logs()
        self.kubectl("delete", "deployment", "-n", RELEASE_NAMESPACE, self.name,
                     "--ignore-not-found", "--wait=true", "--timeout=60s")

"""A dev cluster node run by a real kubelet with containerd: pods in real containers.

The other k8s tests use kwok's simulated nodes, whose pods the pod runner starts as local
processes. Here one node is the real thing (:mod:`dynatrain.devcluster.kubelet`): the kubelet
built from the pinned Kubernetes module registers it, containerd and runc run its pods from the
images built with debootstrap (:mod:`dynatrain.devcluster.images`), each with its own network
namespace on the node's bridge and its own cgroup. `kubectl logs` (``--previous``, ``-f``),
`exec` and `port-forward` reach its pods through the kubelet, with the checks the simulated
nodes' endpoints pass (pod_endpoints.py). The operator test runs a whole job there:
`kubectl apply`, workers in containers, a pod deleted as `kubectl delete pod` does (SIGTERM from
the kubelet), the recovery, and the job's deletion through the garbage collector.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess

import pytest
import yaml
from kubernetes import client

from dynatrain.devcluster import ClusterConfig, DevCluster
from dynatrain.devcluster.cluster import CONTROLLERS
from dynatrain.devcluster.kubelet import (REAL_NODE_LABEL, RealNodeConfig, bridge_name,
                                          preflight)
from harness.operator_pod import OperatorPod
from harness.operator_process import wait

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
GROUP, VERSION, PLURAL = "dynatrain.io", "v1alpha1", "dynatrainjobs"
NODE = "real-node-0"


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory):
    """A dev cluster whose only node is kubelet-run (the worker image is built on first use)."""
    missing = preflight()
    if missing:
        reason = "this host cannot run a real node: it lacks " + "; ".join(missing)
        # CI installs containerd, runc and the CNI plugins (make test) and runs as root.
        if os.environ.get("CI"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("realcluster")
    # A bridge left by an earlier run killed in a work directory of the same path (a bridge's
    # name comes from it): the node removes it and starts. Before, it stopped with "RTNETLINK
    # answers: File exists" (a CI run here, after /tmp/pytest-of-root was emptied).
    subprocess.run(["ip", "link", "add", bridge_name(workdir / "nodes" / NODE), "type",
                    "bridge"], capture_output=True)      # (or it is there already)
    # The operator runs here as the chart deploys it, a Deployment (harness/operator_pod.py):
    # this cluster also runs the two controllers that make its pod, which the others leave out.
    config = ClusterConfig(pools=(), real_nodes=(RealNodeConfig(
        name=NODE, pod_images=("worker", "operator")),), workdir=workdir,
        controllers=CONTROLLERS + ("deployment-controller", "replicaset-controller"))
    with DevCluster(config) as cluster:
        yield cluster


@pytest.fixture
def real_namespace(real_cluster):
    core = real_cluster.core()
    name = f"r-{os.urandom(4).hex()}"
    core.create_namespace(body={"metadata": {"name": name}})
    wait(f"the default ServiceAccount of {name}", lambda: any(
        sa.metadata.name == "default"
        for sa in core.list_namespaced_service_account(name).items), timeout=30)
    yield name
    core.delete_namespace(name)


def _kubectl_argv(cluster) -> list[str]:
    from dynatrain.devcluster.build import ensure_built

    return [str(ensure_built().path("kubectl")), "--kubeconfig", str(cluster.kubeconfig)]


def _kubectl(cluster, *args: str) -> str:
    """kubectl as the cluster's admin; fails the test, with kubectl's message, if it fails."""
    out = subprocess.run([*_kubectl_argv(cluster), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
    return out.stdout


def test_the_real_node_registers_itself(real_cluster):
    node = real_cluster.core().read_node(NODE)
    assert node.metadata.labels[REAL_NODE_LABEL] == "true"
    assert node.status.node_info.container_runtime_version.startswith("containerd://")
    assert node.status.node_info.kubelet_version.startswith("v")
    addresses = {a.type: a.address for a in node.status.addresses}
    assert addresses["InternalIP"] == real_cluster.real_nodes[0].node_ip


def test_a_pod_runs_in_a_container_with_its_volumes_limits_and_exit_code(real_cluster,
                                                                          real_namespace):
    core = real_cluster.core()
    ns = real_namespace
    core.create_namespaced_config_map(ns, {"metadata": {"name": "settings"},
                                           "data": {"greeting": "hello from a ConfigMap"}})
    image = real_cluster.real_nodes[0].images["worker"]
    script = (
        "import os, pathlib, socket\n"
        "print('greeting:', pathlib.Path('/etc/settings/greeting').read_text())\n"
        "print('uid:', os.getuid(), 'pod:', os.environ['POD_NAME'])\n"
        "print('hostname:', socket.gethostname())\n"
        "limit = pathlib.Path('/sys/fs/cgroup/memory/memory.limit_in_bytes')\n"
        "print('memory limit:', limit.read_text().strip() if limit.exists() else"
        " pathlib.Path('/sys/fs/cgroup/memory.max').read_text().strip())\n"
        "raise SystemExit(3)\n")
    core.create_namespaced_pod(ns, {
        "metadata": {"name": "probe"},
        "spec": {"restartPolicy": "Never",
                 "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
                 "containers": [{
                     "name": "main", "image": image, "command": ["python", "-c", script],
                     "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {
                         "fieldPath": "metadata.name"}}}],
                     "resources": {"limits": {"memory": "256Mi", "cpu": "500m"}},
                     "volumeMounts": [{"name": "settings", "mountPath": "/etc/settings"}]}],
                 "volumes": [{"name": "settings", "configMap": {"name": "settings"}}]}})
    pod = wait("the probe pod to finish", lambda: (lambda p: p if p.status.phase in (
        "Succeeded", "Failed") else None)(core.read_namespaced_pod("probe", ns)), timeout=120)
    # The kubelet reports what runc saw: the exit code, the container's id in containerd.
    assert pod.status.phase == "Failed"
    state = pod.status.container_statuses[0]
    assert state.state.terminated.exit_code == 3
    assert state.container_id.startswith("containerd://")
    assert ipaddress.ip_address(pod.status.pod_ip) in real_cluster.real_nodes[0].subnet
    log = _kubectl(real_cluster, "logs", "-n", ns, "probe")   # apiserver -> kubelet
    assert "greeting: hello from a ConfigMap" in log
    assert "uid: 10001 pod: probe" in log
    assert "hostname: probe" in log
    assert f"memory limit: {256 * 2**20}" in log


def test_kubectl_logs_previous_exec_and_port_forward_reach_a_container(real_cluster,
                                                                      real_namespace):
    """The checks the simulated nodes' kubelet endpoint (kwok's server) passes
    (test_pod_endpoints.py), against the kubelet, where `kubectl exec` runs in the container."""
    import datetime

    from dynatrain.devcluster.build import ensure_built
    from harness.pod_endpoints import check_pod_endpoints, endpoint_pod

    core = real_cluster.core()
    core.create_namespaced_pod(real_namespace, endpoint_pod(
        "talker", "python", node_selector={"kubernetes.io/hostname": NODE},
        image=real_cluster.real_nodes[0].images["worker"]))
    kubectl = [str(ensure_built().path("kubectl")), "--kubeconfig", str(real_cluster.kubeconfig)]
    # The kubelet's first restart back-off is 10 s.
    check_pod_endpoints(kubectl, core, real_namespace, "talker", exec_refusal=None,
                        timeout=datetime.timedelta(seconds=120))


def _job(name: str, image: str) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "DynaTrainJob",
        "metadata": {"name": name},
        "spec": {
            "image": image,
            "model": {"preset": "gpt-tiny"},
            "resources": {"gpus": 0, "cpu": "250m", "memory": "1Gi"},
            "elastic": {"minWorkers": 1, "maxWorkers": 2},
            "parallelism": {"mode": "auto"},
            "globalBatchSize": 12,
            "training": {"steps": 100000, "seqLen": 32, "learningRate": 0.0003},
            "agent": {"port": 50051},
        }}


@pytest.mark.timeout(600)
def test_the_operator_trains_and_recovers_in_real_containers(real_cluster, real_namespace,
                                                             tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ns = real_namespace
    _kubectl(real_cluster, "apply", "--server-side", "--force-conflicts",
             "-f", f"{root}/crds/dynatrainjob.yaml")
    real_cluster.wait_established("dynatrainjobs.dynatrain.io")
    node = real_cluster.real_nodes[0]
    # The chart's operator Deployment in the slim operator image, on the real node; it hosts
    # the job's rendezvous store at its pod IP, the node's (harness/operator_pod.py).
    op = OperatorPod(real_cluster, lambda *a: _kubectl(real_cluster, *a),
                     node.images["operator"], NODE, tmp_path)
    core = real_cluster.core()
    custom = client.CustomObjectsApi(real_cluster.api_client())

    def status() -> dict:
        return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL,
                                                   "real").get("status", {})

    operator_pod = op.start()
    try:
        # The slim image: no torch in it, and the operator runs from it as the chart says.
        assert operator_pod.spec.node_name == NODE
        assert operator_pod.spec.containers[0].image == node.images["operator"]
        assert operator_pod.status.container_statuses[0].container_id.startswith(
            "containerd://")
        probe = subprocess.run(
            [*_kubectl_argv(real_cluster), "exec", "-n", operator_pod.metadata.namespace,
             operator_pod.metadata.name, "--", "python", "-c",
             "import importlib.util as u; print('torch:', u.find_spec('torch') is not None)"],
            capture_output=True, text=True, timeout=60)
        assert probe.stdout.strip() == "torch: False", (probe.stdout, probe.stderr)
        manifest = tmp_path / "job.yaml"
        manifest.write_text(yaml.safe_dump(_job("real", node.images["worker"])))
        _kubectl(real_cluster, "apply", "-n", ns, "-f", str(manifest))
        first = wait("the job to train on 2 workers in containers", lambda: (
            lambda s: s if s.get("phase") == "Running" and s.get("workers") == 2
            and s.get("step", 0) >= 3 else None)(status()), timeout=240)
        pods = core.list_namespaced_pod(ns, label_selector="dynatrain.io/job=real").items
        assert len(pods) == 2
        for pod in pods:
            assert pod.spec.node_name == NODE
            assert pod.status.container_statuses[0].container_id.startswith("containerd://")
            assert ipaddress.ip_address(pod.status.pod_ip) in node.subnet
            # The pod's CPU limit (250m) reaches the worker through its cgroup: one torch
            # thread, not one per core of the node (two threads throttled in turn made steps
            # of 10 s, and the deleted pod's grace period ran out inside the switch).
            log = core.read_namespaced_pod_log(pod.metadata.name, ns)
            assert "1 torch thread(s) for a CPU limit of 0.25 cores" in log, log[-3000:]

        # `kubectl delete pod`: the kubelet sends SIGTERM, the worker reports that it is
        # leaving and trains on, the job switches off it live (a preemption, not a failure)
        # and the operator replaces the pod.
        victim = sorted(p.metadata.name for p in pods)[1]
        _kubectl(real_cluster, "delete", "pod", "-n", ns, victim, "--wait=false")

        def switched() -> dict | None:
            s = status()
            last = s.get("lastSwitch", {})
            return s if (s.get("generation", 0) > first["generation"]
                         and last.get("result") == "success") else None

        after = wait("a switch after the pod's deletion", switched, timeout=180)
        assert after["lastSwitch"]["reason"] == "preemption", after["lastSwitch"]
        wait("training to go on after the switch",
             lambda: status().get("step", 0) > after["lastSwitch"]["step"] + 2, timeout=120)

        # Deleting the job (the operator removes its finalizer): the garbage collector
        # deletes its pods, and the kubelet stops their containers.
        _kubectl(real_cluster, "delete", "dynatrainjob", "real", "-n", ns, "--wait=false")
        wait("the job's pods to be gone", lambda: not core.list_namespaced_pod(
            ns, label_selector="dynatrain.io/job=real").items, timeout=120)
    finally:
        print(op.describe())
        op.stop()
        print(op.logs()[-6000:])

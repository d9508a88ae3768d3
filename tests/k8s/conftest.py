"""Fixtures for tests against the real dev cluster (marker ``k8s``).

One cluster per test session: starting it takes seconds once the binaries
are cached, building them (first run, empty Go caches) takes minutes, so
tests share it and isolate themselves by namespace and by the nodes they
pin pods to. Each test's pods are deleted when it ends so that GPU capacity
does not leak from one test into the next.
"""

from __future__ import annotations

import datetime
import os
import uuid

import pytest


def _unavailable(reason: str):
    # In CI nothing central may be skipped: a missing prerequisite there is a failure.
    if os.environ.get("CI"):
        pytest.fail(f"k8s tests cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


try:
    import kubernetes  # noqa: F401
except ImportError:
    _unavailable("the k8s tests need the `kubernetes` client (pip install -e .)")

from dynatrain.devcluster import ClusterConfig, DevCluster, NodePool  # noqa: E402

GPU_NODES = 4
GPUS_PER_NODE = 8


@pytest.fixture(scope="session")
def devcluster(tmp_path_factory):
    """A running dev cluster: GPU_NODES nodes x GPUS_PER_NODE GPUs, plus one CPU-only node."""
    from dynatrain.devcluster.gobuild import TOOLS, GoUnavailable, go_command

    try:
        # go on PATH, else the toolchain tools/k8s/go.mod names, installed (goinstall.py).
        # The cache is keyed by the Go version too, so without Go there is nothing to look
        # up. With Go, a missing cache is built here (minutes) rather than skipped, so CI
        # cannot pass vacuously.
        go_command(TOOLS / "k8s" / "go.mod")
    except GoUnavailable as exc:
        _unavailable(str(exc))
    config = ClusterConfig(
        pools=(
            NodePool(count=GPU_NODES, gpus_per_node=GPUS_PER_NODE, instance_type="p5.48xlarge"),
            NodePool(count=1, gpus_per_node=0, name_prefix="cpu-node",
                     instance_type="m7i.4xlarge", cpu="16", memory="64Gi"),
        ),
        # Under pytest's tmp dir, so the logs of a failed session are kept
        # (pytest keeps the last 3 runs) and the path shows in the report.
        workdir=tmp_path_factory.mktemp("devcluster"),
        kubeconfig=None,
        # Loopback pod IPs: the operator tests run each worker pod as a local process that
        # binds its pod IP, and the operator reaches it there, as on a cluster network.
        # Two test sessions on one machine need different ranges (DYNATRAIN_TEST_POD_CIDR),
        # or their workers bind each other's addresses.
        pod_cidr=os.environ.get("DYNATRAIN_TEST_POD_CIDR", "127.20.0.0/16"),
        # Kueue (its manager runs in a private mount namespace: root only); it touches only
        # pods labelled with a queue name, so the other suites see the cluster as before.
        kueue=os.geteuid() == 0,
    )
    with DevCluster(config) as cluster:
        yield cluster


@pytest.fixture
def kueue(devcluster):
    """The session cluster's Kueue (a test that needs it fails in CI without it)."""
    if not devcluster.config.kueue:
        _unavailable("Kueue runs in the dev cluster only as root (see devcluster/kueue.py)")
    return devcluster


@pytest.fixture(scope="session")
def kubectl(devcluster):
    """Run the dev cluster's kubectl with its admin kubeconfig; returns CompletedProcess."""
    import subprocess

    from dynatrain.devcluster.build import ensure_built

    binary = ensure_built().path("kubectl")

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([str(binary), "--kubeconfig", str(devcluster.kubeconfig), *args],
                              capture_output=True, text=True, timeout=60, check=check)
    return run


@pytest.fixture
def core(devcluster):
    return devcluster.core()


@pytest.fixture
def namespace(devcluster, core):
    """A fresh namespace, ready for pods; deleted afterwards, its pods at once.

    Ready means its ``default`` ServiceAccount exists: kube-controller-manager creates it,
    and the ServiceAccount admission plugin rejects pods until it does.
    """
    from dynatrain.devcluster.processes import wait_until

    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace(body={"metadata": {"name": name}})
    wait_until(f"the default ServiceAccount of {name}", lambda: any(
        sa.metadata.name == "default" for sa in core.list_namespaced_service_account(name).items),
        timeout=datetime.timedelta(seconds=30))
    yield name
    for pod in core.list_namespaced_pod(namespace=name).items:
        core.delete_namespaced_pod(name=pod.metadata.name, namespace=name,
                                   grace_period_seconds=0)
    core.delete_namespace(name)      # the namespace controller finishes it in the background


@pytest.fixture(scope="module")
def dynatrain_crd(devcluster, kubectl):
    """The DynaTrainJob CRD applied (server-side, so every module's copy of it is simply
    updated) and served; its object as the apiserver has it."""
    from kubernetes import client

    from harness.operator_process import ROOT

    kubectl("apply", "--server-side", "--force-conflicts", "-f",
            str(ROOT / "crds" / "dynatrainjob.yaml"))
    devcluster.wait_established("dynatrainjobs.dynatrain.io")
    return client.ApiextensionsV1Api(devcluster.api_client()).read_custom_resource_definition(
        name="dynatrainjobs.dynatrain.io")


@pytest.fixture
def custom(devcluster, dynatrain_crd):
    """The custom-objects API, with the DynaTrainJob CRD served."""
    from kubernetes import client

    return client.CustomObjectsApi(devcluster.api_client())


@pytest.fixture
def timeout():
    return datetime.timedelta(seconds=30)


@pytest.fixture
def operator(devcluster, kubectl, namespace, tmp_path):
    """The CRD applied, `dynatrain operator` running for ``namespace`` (leader election, as in
    a cluster) and a pod runner that runs the job's worker pods as local processes."""
    from harness.pod_runner import job_pods
    from harness.operator_process import ROOT, Operator

    kubectl("apply", "--server-side", "--force-conflicts", "-f",
            str(ROOT / "crds" / "dynatrainjob.yaml"))
    devcluster.wait_established("dynatrainjobs.dynatrain.io")
    op = Operator(devcluster, namespace, tmp_path)
    # The harness's settings (GPU workers on the CPU, worker pods forked): harness.pod_runner.
    pods = job_pods(devcluster.core(), tmp_path / "pods", namespace)
    with pods:
        op.start()
        try:
            yield op, pods
        finally:
            op.stop()
            print(op.logs()[-8000:])

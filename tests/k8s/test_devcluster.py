"""The dev cluster against itself: real apiserver, real scheduler, kwok nodes.

Each test checks an effect read back from the API (or from kubectl, where
the printed columns are the point), and most check the opposite case too: a
pod that must *not* schedule, an object that must be rejected. That way a
helper that silently did nothing would fail here.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from dynatrain.devcluster import nodes as dn
from dynatrain.devcluster.build import ensure_built
from dynatrain.devcluster.processes import wait_until

pytestmark = pytest.mark.k8s

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "dynatrainjob.yaml"
GROUP, VERSION, PLURAL = "dynatrain.io", "v1alpha1", "dynatrainjobs"


def gpu_pod(name: str, *, gpus: int, node: str | None = None,
            tolerations: list[dict] | None = None) -> dict:
    spec: dict = {
        "containers": [{
            "name": "worker", "image": "dynatrain/worker:dev",
            "resources": {"limits": {dn.GPU_RESOURCE: str(gpus)}},
        }],
        "terminationGracePeriodSeconds": 5,
    }
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if tolerations:
        spec["tolerations"] = tolerations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def wait_running(core, namespace: str, name: str, timeout: datetime.timedelta):
    def running():
        pod = core.read_namespaced_pod(name=name, namespace=namespace)
        return pod if pod.status.phase == "Running" else None
    return wait_until(f"pod {namespace}/{name} Running", running, timeout=timeout)


def wait_unschedulable(core, namespace: str, name: str, timeout: datetime.timedelta):
    """Wait until the scheduler has tried and failed to place the pod."""
    def unschedulable():
        pod = core.read_namespaced_pod(name=name, namespace=namespace)
        return any(c.type == "PodScheduled" and c.status == "False"
                   and c.reason == "Unschedulable" for c in (pod.status.conditions or []))
    wait_until(f"pod {namespace}/{name} marked Unschedulable", unschedulable, timeout=timeout)
    pod = core.read_namespaced_pod(name=name, namespace=namespace)
    assert not pod.spec.node_name and pod.status.phase == "Pending"
    return pod


# -- nodes -------------------------------------------------------------------

def test_nodes_ready_with_gpu_capacity(devcluster, core):
    gpu_pool = devcluster.config.pools[0]
    nodes = {n.metadata.name: n for n in core.list_node().items}
    gpu_nodes = gpu_pool.node_names()
    assert set(nodes) >= set(gpu_nodes) | {"cpu-node-0"}
    for index, name in enumerate(gpu_nodes):
        node = nodes[name]
        assert dn.node_is_ready(node), node.status.conditions
        assert node.status.allocatable[dn.GPU_RESOURCE] == str(gpu_pool.gpus_per_node)
        assert node.metadata.labels[dn.NODE_INDEX_LABEL] == str(index)
        assert node.metadata.labels[dn.INSTANCE_TYPE_LABEL] == "p5.48xlarge"
        # as GPU feature discovery labels a p5 node
        assert node.metadata.labels[dn.GPU_PRODUCT_LABEL] == "NVIDIA-H100-80GB-HBM3"
    cpu_node = nodes["cpu-node-0"]
    assert dn.node_is_ready(cpu_node)
    assert dn.GPU_PRODUCT_LABEL not in cpu_node.metadata.labels
    assert dn.GPU_RESOURCE not in cpu_node.status.allocatable
    assert cpu_node.status.allocatable["cpu"] == "16"


def test_kubectl_sees_the_nodes(devcluster):
    kubectl = ensure_built().path("kubectl")
    out = subprocess.run(
        [str(kubectl), "--kubeconfig", str(devcluster.kubeconfig), "get", "nodes",
         "-l", f"{dn.INSTANCE_TYPE_LABEL}=p5.48xlarge", "-o", "name"],
        capture_output=True, text=True, timeout=60, check=True)
    expected = [f"node/{n}" for n in devcluster.config.pools[0].node_names()]
    assert sorted(out.stdout.split()) == expected


# -- the DynaTrainJob CRD ----------------------------------------------------------

@pytest.fixture(scope="module")
def crd(devcluster):
    api = client.ApiextensionsV1Api(devcluster.api_client())
    manifest = yaml.safe_load(CRD_FILE.read_text())
    try:
        api.create_custom_resource_definition(body=manifest)
    except ApiException as exc:
        # Other test modules of this session (the CRD and chart tests) apply it too.
        if exc.status != 409:
            raise
        current = api.read_custom_resource_definition(name=manifest["metadata"]["name"])
        manifest["metadata"]["resourceVersion"] = current.metadata.resource_version
        api.replace_custom_resource_definition(name=manifest["metadata"]["name"], body=manifest)

    def established():
        obj = api.read_custom_resource_definition(name=manifest["metadata"]["name"])
        return any(c.type == "Established" and c.status == "True"
                   for c in (obj.status.conditions or []))
    wait_until("CRD dynatrainjobs.dynatrain.io Established", established,
               timeout=datetime.timedelta(seconds=30))
    return manifest


def job(name: str, **elastic) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "DynaTrainJob",
        "metadata": {"name": name},
        "spec": {
            "image": "dynatrain/worker:dev",
            "command": ["python", "-m", "dynatrain.train"],
            "model": {"preset": "gpt-1b"},
            "resources": {"gpus": 8, "cpu": "32", "memory": "256Gi"},
            "elastic": {"minWorkers": 1, "maxWorkers": 4, **elastic},
            "parallelism": {"mode": "auto"},
            "globalBatchSize": 512,
            "agent": {"authSecret": "dtj-agent-token"},
        },
    }


def test_crd_accepts_a_job_and_rejects_an_invalid_one(devcluster, crd, namespace):
    custom = client.CustomObjectsApi(devcluster.api_client())
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job("llama"))
    stored = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "llama")
    # Defaults from the schema were applied by the apiserver.
    assert stored["spec"]["agent"]["port"] == 50051
    assert stored["spec"]["preemptionPolicy"] == "Switch"

    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, job("bad", minWorkers=5, maxWorkers=2))
    assert err.value.status == 422
    assert "spec.elastic.minWorkers must be <= spec.elastic.maxWorkers" in json.loads(
        err.value.body)["message"]

    with pytest.raises(ApiException) as err:
        bad = job("bad-mode")
        bad["spec"]["parallelism"] = {"mode": "sometimes"}
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, bad)
    assert err.value.status == 422


def test_crd_status_scale_and_printer_columns(devcluster, crd, namespace):
    custom = client.CustomObjectsApi(devcluster.api_client())
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job("gpt", workers=2))
    # Status is a subresource: a status write through the main resource is ignored ...
    custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "gpt", {"status": {"phase": "Failed"}},
        _content_type="application/merge-patch+json")
    assert "status" not in custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "gpt")
    # ... and only the status endpoint sets it.
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "gpt",
        {"status": {"phase": "Running", "layout": "dp2-tp8", "workers": 2,
                    "selector": "dynatrain.io/job=gpt", "step": 120, "loss": 3.25,
                    "tokensPerSecond": 1234.5}},
        _content_type="application/merge-patch+json")

    # The scale subresource drives spec.elastic.workers.
    custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, namespace, PLURAL, "gpt", {"spec": {"replicas": 3}},
        _content_type="application/merge-patch+json")
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gpt")
    assert obj["spec"]["elastic"]["workers"] == 3
    scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, "gpt")
    assert scale["status"]["replicas"] == 2

    kubectl = ensure_built().path("kubectl")
    out = subprocess.run(
        [str(kubectl), "--kubeconfig", str(devcluster.kubeconfig), "-n", namespace,
         "get", "dtj", "gpt"], capture_output=True, text=True, timeout=60, check=True)
    header, row = out.stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "LAYOUT", "WORKERS", "STEP", "LOSS", "LAST",
                              "SWITCH", "AGE"]
    assert row.split()[:6] == ["gpt", "Running", "dp2-tp8", "2", "120", "3.25"]


# -- scheduling onto simulated GPU nodes -------------------------------------------

def test_gpu_pods_are_scheduled_and_running(devcluster, core, namespace, timeout):
    gpus_per_node = devcluster.config.pools[0].gpus_per_node
    for i in range(2):
        core.create_namespaced_pod(namespace=namespace,
                                   body=gpu_pod(f"w{i}", gpus=gpus_per_node))
    pods = [wait_running(core, namespace, f"w{i}", timeout) for i in range(2)]
    hosts = {p.spec.node_name for p in pods}
    # A full node's worth of GPUs each: they cannot share a node.
    assert len(hosts) == 2 and all(h.startswith("gpu-node-") for h in hosts)
    for pod in pods:
        assert pod.status.pod_ip, f"{pod.metadata.name} has no pod IP"
        assert all(cs.ready for cs in pod.status.container_statuses)

    # No node has more GPUs than gpus_per_node: the scheduler must refuse.
    core.create_namespaced_pod(namespace=namespace,
                               body=gpu_pod("too-big", gpus=gpus_per_node + 1))
    pod = wait_unschedulable(core, namespace, "too-big", timeout)
    message = next(c.message for c in pod.status.conditions if c.type == "PodScheduled")
    assert "Insufficient nvidia.com/gpu" in message


def test_cordon_keeps_new_pods_off_and_uncordon_lets_them_in(core, namespace, timeout):
    node = "gpu-node-0"
    dn.cordon(core, node)
    try:
        assert core.read_node(name=node).spec.unschedulable is True
        core.create_namespaced_pod(namespace=namespace, body=gpu_pod("p", gpus=1, node=node))
        wait_unschedulable(core, namespace, "p", timeout)
    finally:
        dn.uncordon(core, node)
    assert not core.read_node(name=node).spec.unschedulable
    assert wait_running(core, namespace, "p", timeout).spec.node_name == node


def test_termination_taint_repels_pods_without_toleration(core, namespace, timeout):
    node = "gpu-node-1"
    spot = dn.Taint(key=dn.SPOT_INTERRUPTION_TAINT, value="true", effect="NoSchedule")
    dn.taint(core, node, spot)
    try:
        taints = core.read_node(name=node).spec.taints
        assert [(t.key, t.value, t.effect) for t in taints] == [
            (dn.SPOT_INTERRUPTION_TAINT, "true", "NoSchedule")]
        core.create_namespaced_pod(namespace=namespace, body=gpu_pod("plain", gpus=1, node=node))
        core.create_namespaced_pod(namespace=namespace, body=gpu_pod(
            "tolerant", gpus=1, node=node,
            tolerations=[{"key": dn.SPOT_INTERRUPTION_TAINT, "operator": "Exists"}]))
        assert wait_running(core, namespace, "tolerant", timeout).spec.node_name == node
        wait_unschedulable(core, namespace, "plain", timeout)

        # A second taint adds to the first; re-adding one replaces, not duplicates.
        gce = dn.Taint(key=dn.GCE_IMPENDING_TERMINATION_TAINT, effect="NoSchedule")
        dn.taint(core, node, gce)
        dn.taint(core, node, gce)
        keys = sorted(t.key for t in core.read_node(name=node).spec.taints)
        assert keys == sorted([dn.SPOT_INTERRUPTION_TAINT, dn.GCE_IMPENDING_TERMINATION_TAINT])
    finally:
        dn.untaint(core, node, dn.SPOT_INTERRUPTION_TAINT)
        dn.untaint(core, node, dn.GCE_IMPENDING_TERMINATION_TAINT)
    assert not core.read_node(name=node).spec.taints
    assert wait_running(core, namespace, "plain", timeout).spec.node_name == node


def test_add_and_delete_nodes(devcluster, core, namespace, timeout):
    pool = dn.NodePool(count=2, gpus_per_node=4, name_prefix="spot", first_index=10,
                       instance_type="g5.12xlarge", labels={"dynatrain.io/pool": "spot"})
    names = devcluster.add_pool(pool)
    assert names == ["spot-10", "spot-11"]
    node = core.read_node(name="spot-11")
    assert dn.node_is_ready(node)
    assert node.status.allocatable[dn.GPU_RESOURCE] == "4"
    assert node.metadata.labels["dynatrain.io/pool"] == "spot"
    assert node.metadata.labels[dn.NODE_INDEX_LABEL] == "11"

    core.create_namespaced_pod(namespace=namespace, body=gpu_pod("on-spot", gpus=4, node="spot-10"))
    assert wait_running(core, namespace, "on-spot", timeout).spec.node_name == "spot-10"

    dn.delete_node(core, "spot-10")
    with pytest.raises(ApiException) as err:
        core.read_node(name="spot-10")
    assert err.value.status == 404
    # A pod pinned to the deleted node now has nowhere to go.
    core.create_namespaced_pod(namespace=namespace, body=gpu_pod("late", gpus=1, node="spot-10"))
    wait_unschedulable(core, namespace, "late", timeout)
    dn.delete_node(core, "spot-11")


def test_disruption_target_condition_is_set(core, namespace, timeout):
    core.create_namespaced_pod(namespace=namespace, body=gpu_pod("victim", gpus=1))
    wait_running(core, namespace, "victim", timeout)
    dn.set_disruption_target(core, namespace, "victim", reason="PreemptionByScheduler",
                             message="preempted by a higher-priority job")
    pod = core.read_namespaced_pod(name="victim", namespace=namespace)
    conditions = {c.type: c for c in pod.status.conditions}
    assert conditions["DisruptionTarget"].status == "True"
    assert conditions["DisruptionTarget"].reason == "PreemptionByScheduler"
    # The strategic merge added one condition and kept kwok's.
    assert conditions["Ready"].status == "True"
    assert pod.status.phase == "Running"


def test_graceful_deletion_waits_for_the_grace_period(core, namespace, timeout):
    core.create_namespaced_pod(namespace=namespace, body=gpu_pod("leaver", gpus=1))
    wait_running(core, namespace, "leaver", timeout)
    started = time.monotonic()
    core.delete_namespaced_pod(name="leaver", namespace=namespace, grace_period_seconds=3)
    pod = core.read_namespaced_pod(name="leaver", namespace=namespace)
    assert pod.metadata.deletion_timestamp is not None

    def gone():
        try:
            core.read_namespaced_pod(name="leaver", namespace=namespace)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False
    wait_until("pod leaver to be deleted by kwok", gone, timeout=timeout)
    assert time.monotonic() - started >= 2.0


# -- kube-controller-manager -------------------------------------------------------------------

def test_controller_manager_makes_service_accounts_and_collects_garbage(core, namespace,
                                                                         timeout):
    # The serviceaccount controller: every namespace gets `default` (the ServiceAccount
    # admission plugin, now on, would reject pods without it).
    wait_until("the default ServiceAccount", lambda: any(
        sa.metadata.name == "default"
        for sa in core.list_namespaced_service_account(namespace).items), timeout=timeout)
    # The garbage collector: a dependent goes with its owner, as a job's pods, Service,
    # ConfigMap and Secret go with the DynaTrainJob.
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
           "uid": owner.metadata.uid}
    core.create_namespaced_secret(namespace, {"metadata": {"name": "dependent",
                                                           "ownerReferences": [ref]}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "independent"}})
    core.delete_namespaced_config_map("owner", namespace)
    wait_until("the garbage collector to delete the dependent", lambda: "dependent" not in {
        s.metadata.name for s in core.list_namespaced_secret(namespace).items},
        timeout=timeout)
    assert "independent" in {s.metadata.name for s in core.list_namespaced_secret(namespace).items}


def test_a_node_whose_heartbeat_stops_is_tainted_and_its_pods_evicted(devcluster, core,
                                                                       namespace, timeout):
    coordination = client.CoordinationV1Api(devcluster.api_client())
    [lossy] = devcluster.add_pool(dn.NodePool(count=1, gpus_per_node=8, name_prefix="lossy"))
    try:
        core.create_namespaced_pod(namespace, gpu_pod("on-lossy", gpus=1, node=lossy))
        core.create_namespaced_pod(namespace, gpu_pod("elsewhere", gpus=1, node="gpu-node-0"))
        pod = wait_running(core, namespace, "on-lossy", timeout)
        # DefaultTolerationSeconds (admission) gave it the dev cluster's short tolerations.
        assert {(t.key, t.toleration_seconds) for t in pod.spec.tolerations} >= {
            ("node.kubernetes.io/unreachable", devcluster.config.node_timings.toleration_s)}
        wait_running(core, namespace, "elsewhere", timeout)

        dn.stop_heartbeat(coordination, lossy)
        grace = datetime.timedelta(seconds=devcluster.config.node_timings.monitor_grace_s + 30)

        def evicted():
            p = core.read_namespaced_pod("on-lossy", namespace)
            target = [c for c in p.status.conditions or [] if c.type == "DisruptionTarget"]
            return p if p.metadata.deletion_timestamp and target else None
        pod = wait_until("the taint-eviction controller to evict on-lossy", evicted,
                         timeout=grace)
        [target] = [c for c in pod.status.conditions if c.type == "DisruptionTarget"]
        assert target.reason == "DeletionByTaintManager"
        node = core.read_node(lossy)
        assert [c.status for c in node.status.conditions if c.type == "Ready"] == ["Unknown"]
        assert "node.kubernetes.io/unreachable" in {t.key for t in node.spec.taints}
        # Only the silent node: the pod elsewhere is untouched.
        assert core.read_namespaced_pod("elsewhere", namespace).metadata.deletion_timestamp \
            is None

        dn.resume_heartbeat(coordination, lossy)
        wait_until(f"{lossy} to be Ready and untainted again", lambda: (lambda n: dn.node_is_ready(
            n) and not any(t.key.startswith("node.kubernetes.io/") for t in n.spec.taints or []))(
            core.read_node(lossy)), timeout=grace)
    finally:
        dn.delete_node(core, lossy)


# -- pods that run ---------------------------------------------------------------------------------

def _process_pod(name: str, script: str, *, restart: str = "Never", claim: str = "") -> dict:
    import sys

    container = {
        "name": "main", "image": "unused", "command": [sys.executable, "-c", script],
        "args": ["$(POD_NAME)", "/config/greeting"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
                {"name": "DATA", "value": "/data"}],
        "volumeMounts": [{"name": "config", "mountPath": "/config"}]}
    volumes = [{"name": "config", "configMap": {"name": "c"}}]
    if claim:
        container["volumeMounts"].append({"name": "data", "mountPath": "/data"})
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": claim}})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [container], "volumes": volumes, "restartPolicy": restart,
                     "nodeSelector": {"kubernetes.io/hostname": "cpu-node-0"}}}


def _terminated(core, namespace, name):
    pod = core.read_namespaced_pod(name, namespace)
    statuses = pod.status.container_statuses or []
    if pod.status.phase in ("Succeeded", "Failed") and statuses and statuses[0].state.terminated:
        return pod
    return None


def test_pod_runner_runs_containers_with_env_volumes_and_a_shared_claim(devcluster, core,
                                                                          namespace, tmp_path):
    from dynatrain.devcluster.pods import PodRunner
    from dynatrain.devcluster.volumes import STORAGE_CLASS

    core.create_namespaced_config_map(namespace, {"metadata": {"name": "c"},
                                                  "data": {"greeting": "hello"}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "s"},
                                              "stringData": {"token": "t0k"}})
    core.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": "shared"},
        "spec": {"accessModes": ["ReadWriteMany"],
                 "resources": {"requests": {"storage": "1Gi"}}}})
    # The writer renames a complete file into place: the reader polls for it, and a file
    # opened for writing exists (empty) before its contents are written.
    writer = ("import os, sys; name, path = sys.argv[1:]; "
              "out = os.environ['DATA'] + '/from-' + name; "
              "open(out + '.tmp', 'w').write("
              "open(path).read() + ' ' + os.environ['TOKEN'] + ' ' + os.environ['POD_IP']); "
              "os.replace(out + '.tmp', out); sys.exit(3)")
    reader = ("import os, sys, time\n"
              "p = os.environ['DATA'] + '/from-writer'\n"
              "while not os.path.exists(p): time.sleep(0.1)\n"
              "print(open(p).read(), flush=True)\n")
    long = datetime.timedelta(seconds=60)
    with PodRunner(core, tmp_path / "pods", namespace=namespace) as runner:
        core.create_namespaced_pod(namespace, _process_pod("writer", writer, claim="shared"))
        core.create_namespaced_pod(namespace, _process_pod("reader", reader, claim="shared"))
        pvc = core.read_namespaced_persistent_volume_claim("shared", namespace)
        assert pvc.spec.storage_class_name == STORAGE_CLASS     # the default class
        read_claim = core.read_namespaced_persistent_volume_claim
        wait_until("the claim to be provisioned and bound",
                   lambda: read_claim("shared", namespace).status.phase == "Bound",
                   timeout=long)
        failed = wait_until("writer to exit", lambda: _terminated(core, namespace, "writer"),
                            timeout=long)
        done = wait_until("reader to exit", lambda: _terminated(core, namespace, "reader"),
                          timeout=long)
        # Exit codes as a kubelet reports them: 3 -> Failed; 0 -> Succeeded.
        assert failed.status.phase == "Failed"
        assert failed.status.container_statuses[0].state.terminated.exit_code == 3
        assert done.status.phase == "Succeeded"
        ip = failed.status.pod_ip
        # ConfigMap volume, Secret env and the downward API, across one claim's directory.
        assert runner.log(namespace, "reader").strip() == f"hello t0k {ip}"
        assert (runner.claim_dir(namespace, "shared") / "from-writer").read_text() == \
            f"hello t0k {ip}"


@pytest.mark.parametrize("fork_workers", [False, True])
def test_a_worker_pod_runs_the_same_forked_or_as_a_new_interpreter(devcluster, core, namespace,
                                                                    tmp_path, fork_workers):
    # The tests' harness forks worker pods from a torch-loaded server (harness.pod_runner): the
    # pod must see the same command, environment, exit code and log either way.
    from dynatrain.controller.workerstart import ForkedWorker
    from dynatrain.devcluster.pods import PodRunner

    name = f"worker-{'forked' if fork_workers else 'exec'}"
    container = {"name": "main", "image": "unused",
                 "command": ["dynatrain", "worker", "--job", "/config/job.yaml",
                             "--device", "0", "--log-every", "$(EVERY)"],
                 "env": [{"name": "EVERY", "value": "-1"}]}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"containers": [container], "restartPolicy": "Never",
                    "nodeSelector": {"kubernetes.io/hostname": "cpu-node-0"}}}
    with PodRunner(core, tmp_path / "pods", namespace=namespace,
                   fork_workers=fork_workers) as runner:
        core.create_namespaced_pod(namespace, pod)
        done = wait_until("the worker to exit", lambda: _terminated(core, namespace, name),
                          timeout=datetime.timedelta(seconds=120))
        assert done.status.phase == "Failed"
        assert done.status.container_statuses[0].state.terminated.exit_code == 2
        assert "--log-every -1 is invalid" in runner.log(namespace, name)
        proc = runner.process(namespace, name)
        assert isinstance(proc, ForkedWorker if fork_workers else subprocess.Popen)


def test_pod_runner_restarts_per_policy_and_sigterms_a_deleted_pod(devcluster, core, namespace,
                                                                 tmp_path):
    from dynatrain.devcluster.pods import PodRunner

    core.create_namespaced_config_map(namespace, {"metadata": {"name": "c"},
                                                  "data": {"greeting": "hi"}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "s"},
                                              "stringData": {"token": "x"}})
    flaky = "import sys; sys.exit(1)"
    long = datetime.timedelta(seconds=60)
    with PodRunner(core, tmp_path / "pods", namespace=namespace, backoff_first_s=0.5) as runner:
        core.create_namespaced_pod(namespace, _process_pod("flaky", flaky, restart="OnFailure"))

        def restarted_twice():
            pod = core.read_namespaced_pod("flaky", namespace)
            statuses = pod.status.container_statuses or []
            return pod if statuses and statuses[0].restart_count >= 2 else None
        pod = wait_until("flaky to be restarted twice", restarted_twice, timeout=long)
        assert pod.status.phase == "Running"        # OnFailure: it keeps coming back
        assert runner.log(namespace, "flaky").count("--- restart") >= 2

        # A deleted pod gets SIGTERM, then SIGKILL at the end of its grace period.
        sleeper = "import time; time.sleep(600)"
        core.create_namespaced_pod(namespace, _process_pod("sleeper", sleeper))
        proc = wait_until("sleeper's process", lambda: runner.process(namespace, "sleeper"),
                          timeout=long)
        core.delete_namespaced_pod("sleeper", namespace, grace_period_seconds=30)
        assert proc.wait(30) == -15                 # python dies of SIGTERM at once


def test_pod_runner_watches_the_pods_and_nodes_and_reads_leases_and_claims_less_often(
        devcluster, core, namespace, tmp_path):
    # The pods (of the runner's namespace) and the nodes are listed once and then watched, so
    # a round reads them from memory; the heartbeat leases and the pending claims are read
    # every `nodes_interval_s`. Listing all four 5 times a second took ~7.5% of a 2-core
    # machine from the apiserver, etcd and the runner with nothing to run, and the pods list
    # was the apiserver's largest request stream in the operator suites.
    import collections

    from dynatrain.devcluster.pods import PodRunner

    reads = collections.Counter()

    class Counted:
        def __init__(self, api):
            self._api = api

        def __getattr__(self, name):
            attr = getattr(self._api, name)
            if not name.startswith("list_"):
                return attr

            def counted(*args, **kwargs):
                reads[name] += 1
                return attr(*args, **kwargs)
            return counted

    core.create_namespaced_config_map(namespace, {"metadata": {"name": "c"},
                                                  "data": {"greeting": "hi"}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "s"},
                                              "stringData": {"token": "x"}})
    other = _process_pod("other", "import time; time.sleep(600)")
    other["metadata"]["labels"] = {"x": "y"}           # not the runner's: its selector is !x
    core.create_namespaced_pod(namespace, other)
    long = datetime.timedelta(seconds=60)
    with PodRunner(Counted(core), tmp_path / "pods", namespace=namespace, selector="!x",
                   nodes_interval_s=1.0) as runner:
        started = time.monotonic()
        core.create_namespaced_pod(namespace, _process_pod("sleeper", "import time; "
                                                           "time.sleep(600)"))
        proc = wait_until("sleeper's process", lambda: runner.process(namespace, "sleeper"),
                          timeout=long)
        wait_until("five reads of the claims", lambda: reads[
            "list_namespaced_persistent_volume_claim"] >= 5, timeout=long)
        elapsed = time.monotonic() - started
        assert reads["list_namespaced_pod"] == reads["list_node"] == 0, reads
        assert reads["list_namespaced_persistent_volume_claim"] <= elapsed / 1.0 + 2, reads
        stats = runner.view.stats()["by_resource"]
        for what in ("pods", "nodes"):
            assert stats[what]["lists"] == 1 and stats[what]["watches"] >= 1, stats
            assert stats[what]["relists"] == stats[what]["errors"] == 0, stats
        # Only the pods of its namespace and selector: not the other one, nor other namespaces'.
        assert [p.metadata.name for p in runner.view.pods()] == ["sleeper"]
        assert runner.process(namespace, "other") is None
        core.delete_namespaced_pod("sleeper", namespace, grace_period_seconds=30)
        assert proc.wait(30) == -15            # the deletion reaches it by the watch

"""The operator's reading of the cluster (doom signals, free GPU slots) and the manifests it
writes, on Kubernetes API objects built here (the end-to-end path is in tests/k8s)."""

import datetime

from kubernetes import client

from dynatrain.operator import cluster as k

NOW = datetime.datetime(2026, 11, 21, tzinfo=datetime.timezone.utc)


def node(name, gpus=8, taints=(), cordoned=False, ready=True):
    return client.V1Node(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1NodeSpec(unschedulable=cordoned,
                               taints=[client.V1Taint(key=t, effect="NoSchedule")
                                       for t in taints] or None),
        status=client.V1NodeStatus(allocatable={"nvidia.com/gpu": str(gpus)}, conditions=[
            client.V1NodeCondition(type="Ready", status="True" if ready else "False")]))


def pod(device, node_name="n1", gpus=1, deleted_in=None, disruption=False, phase="Running"):
    conditions = [client.V1PodCondition(type="DisruptionTarget", status="True",
                                        reason="PreemptionByScheduler")] if disruption else None
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=f"job-worker-{device}", labels={k.DEVICE_LABEL: str(device)},
            deletion_timestamp=NOW + datetime.timedelta(seconds=deleted_in)
            if deleted_in is not None else None),
        spec=client.V1PodSpec(node_name=node_name, containers=[client.V1Container(
            name="worker", resources=client.V1ResourceRequirements(
                limits={"nvidia.com/gpu": str(gpus)}))]),
        status=client.V1PodStatus(phase=phase, pod_ip="127.20.0.9", conditions=conditions))


def nodes(*ns):
    return {n.metadata.name: k.read_node(n) for n in ns}


def test_each_doom_signal():
    ns = nodes(node("n1"), node("spot", taints=[
        "aws-node-termination-handler/spot-itn"]), node("gce", taints=[
            "cloud.google.com/impending-node-termination"]), node("cordon", cordoned=True))
    assert not k.read_worker(pod(0, "n1"), ns, NOW).doomed
    for name in ("spot", "gce", "cordon"):
        w = k.read_worker(pod(1, name), ns, NOW)
        assert w.doomed and w.deadline_s == k.DEFAULT_NOTICE_S and name in w.why
    deleted = k.read_worker(pod(2, deleted_in=12), ns, NOW)
    assert deleted.doomed and deleted.deadline_s == 12 and "deleted" in deleted.why
    target = k.read_worker(pod(3, disruption=True), ns, NOW)
    assert target.doomed and "DisruptionTarget" in target.why
    gone = k.read_worker(pod(4, "vanished"), ns, NOW)
    assert gone.doomed and gone.deadline_s == 0
    assert k.read_worker(pod(5), ns, NOW).device == 5


def test_unrelated_taints_do_not_doom():
    ns = nodes(node("n1", taints=["nvidia.com/gpu"]))
    assert not k.read_worker(pod(0), ns, NOW).doomed


def test_free_slots_counts_every_pod_and_skips_doomed_nodes():
    ns = nodes(node("a", gpus=8), node("b", gpus=8), node("c", gpus=8, cordoned=True),
               node("d", gpus=8, ready=False))
    used = [pod(0, "a", gpus=8), pod(1, "b", gpus=3)]
    assert k.free_slots(ns, used, gpus_per_worker=1) == 5
    assert k.free_slots(ns, used, gpus_per_worker=4) == 1
    finished = [pod(2, "a", gpus=8, phase="Succeeded")]
    assert k.free_slots(ns, finished, gpus_per_worker=8) == 2


def test_worker_pod_manifest():
    body = {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": "job", "namespace": "ns", "uid": "u-1"},
            "spec": {"image": "img:1", "resources": {"gpus": 2, "memory": "8Gi"},
                     "args": ["--threads", "4"]}}
    p = k.worker_pod(body, 7, secret="tok", agent_port=50051)
    assert p["metadata"]["name"] == "job-worker-7"
    assert p["metadata"]["labels"][k.JOB_LABEL] == "job"
    assert p["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    (c,) = p["spec"]["containers"]
    assert c["command"] == ["dynatrain", "worker"]
    assert c["args"][:6] == ["--job", k.JOB_FILE, "--device", "7", "--host", "$(POD_IP)"]
    assert c["args"][-2:] == ["--threads", "4"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} \
        in c["env"]
    assert p["spec"]["securityContext"]["runAsNonRoot"]

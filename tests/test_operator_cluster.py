"""The operator's reading of the cluster (doom signals, free GPU slots) and the manifests it
writes, on Kubernetes API objects built here (the end-to-end path is in tests/k8s)."""

import datetime

from kubernetes import client

from dynatrain.operator import cluster as k

NOW = datetime.datetime(2026, 11, 21, tzinfo=datetime.timezone.utc)


def node(name, gpus=8, taints=(), cordoned=False, ready=True, cpu="96", memory="1Ti"):
    return client.V1Node(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1NodeSpec(unschedulable=cordoned,
                               taints=[client.V1Taint(key=t, effect="NoSchedule")
                                       for t in taints] or None),
        status=client.V1NodeStatus(allocatable={"nvidia.com/gpu": str(gpus), "cpu": cpu,
                                                "memory": memory}, conditions=[
            client.V1NodeCondition(type="Ready", status="True" if ready else "False")]))


def pod(device, node_name="n1", gpus=1, deleted_in=None, disruption=False, phase="Running",
        requests=None, waiting=None, terminated=None):
    conditions = [client.V1PodCondition(type="DisruptionTarget", status="True",
                                        reason="PreemptionByScheduler")] if disruption else None
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=f"job-worker-{device}", labels={k.DEVICE_LABEL: str(device)},
            deletion_timestamp=NOW + datetime.timedelta(seconds=deleted_in)
            if deleted_in is not None else None),
        spec=client.V1PodSpec(node_name=node_name, containers=[client.V1Container(
            name="worker", resources=client.V1ResourceRequirements(
                limits={"nvidia.com/gpu": str(gpus)}, requests=requests))],
            restart_policy="Never"),
        status=client.V1PodStatus(phase=phase, pod_ip="127.20.0.9", conditions=conditions,
                                  container_statuses=[client.V1ContainerStatus(
                                      name="worker", image="i", image_id="", ready=False,
                                      restart_count=0, state=client.V1ContainerState(
                                          waiting=waiting, terminated=terminated))]))


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
    assert k.free_slots(ns, used, k.WorkerShape(1, 1.0, 1 << 30)) == 5
    assert k.free_slots(ns, used, k.WorkerShape(4, 1.0, 1 << 30)) == 1
    finished = [pod(2, "a", gpus=8, phase="Succeeded")]
    assert k.free_slots(ns, finished, k.WorkerShape(8, 1.0, 1 << 30)) == 2


def test_cpu_workers_are_counted_against_cpu_and_memory():
    # A CPU job used to have unlimited slots: maxWorkers 4096 made 4096 pods in one tick.
    ns = nodes(node("a", gpus=0, cpu="16", memory="64Gi"), node("b", gpus=0, cpu="4",
                                                                memory="4Gi"))
    shape = k.WorkerShape.of({"resources": {"gpus": 0, "cpu": "2", "memory": "4Gi"}})
    assert (shape.cpu, shape.memory) == (2.0, 4 << 30)
    assert k.free_slots(ns, [], shape) == 8 + 1          # a: 8 by CPU, 16 by memory; b: 1
    used = [pod(0, "a", gpus=0, requests={"cpu": "15", "memory": "1Gi"})]
    assert k.free_slots(ns, used, shape) == 0 + 1         # 1 core left on a
    half = k.WorkerShape.of({"resources": {"gpus": 0, "cpu": "500m"}}, ("1", "1Gi"))
    assert (half.cpu, half.memory) == (0.5, 1 << 30)      # memory: the operator's default
    assert k.free_slots(ns, used, half) == 2 + 4


def test_no_node_fits_names_the_field():
    ns = nodes(node("a", gpus=8), node("b", gpus=4))
    assert k.no_node_fits(ns, k.WorkerShape(8, 1.0, 1 << 30)) == ""
    why = k.no_node_fits(ns, k.WorkerShape(16, 1.0, 1 << 30))
    assert why.startswith("spec.resources.gpus") and "16" in why and "a, has 8" in why
    why = k.no_node_fits(ns, k.WorkerShape(0, 200.0, 1 << 30))
    assert why.startswith("spec.resources.cpu") and "200" in why
    assert k.no_node_fits(nodes(node("c", ready=False)), k.WorkerShape(1, 1, 1)) == \
        "no node is Ready"


def test_unhealthy_pods():
    ok = pod(0)
    assert k.unhealthy_reason(ok) == "" and k.read_worker(ok, nodes(node("n1"))).unhealthy == ""
    assert "Failed" in k.unhealthy_reason(pod(1, phase="Failed"))
    assert "Succeeded" in k.unhealthy_reason(pod(1, phase="Succeeded"))
    for reason in ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull"):
        p = pod(2, waiting=client.V1ContainerStateWaiting(reason=reason, message="m"))
        assert reason in k.unhealthy_reason(p)
    starting = pod(3, phase="Pending",
                   waiting=client.V1ContainerStateWaiting(reason="ContainerCreating"))
    assert k.unhealthy_reason(starting) == ""
    exited = pod(4, terminated=client.V1ContainerStateTerminated(exit_code=1))
    assert "exited with code 1" in k.unhealthy_reason(exited)


def test_device_label_and_pod_names():
    assert k.device_of(pod(12)) == 12
    p = pod(1)
    p.metadata.labels = {k.DEVICE_LABEL: "x"}
    assert k.device_of(p) is None
    p.metadata.labels = None
    assert k.device_of(p) is None
    assert k.pod_name("job", 7) == "job-worker-7"
    long = "j" * 52                                   # the longest job name the CRD admits
    assert k.pod_name(long, 999) == f"{long}-worker-999"          # 63: still the long form
    for device in (0, 999, 1000, 123456, 10 ** 9 - 1):
        assert len(k.pod_name(long, device)) <= 63, device
    assert k.pod_name(long, 1000) == f"{long}-w1000"
    assert k.pod_name(long, 1000) != k.pod_name(long, 100)


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
    # requests equal limits (a Guaranteed pod); the CPU default is the operator's
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "2", "cpu": k.DEFAULT_WORKER_CPU,
                                        "memory": "8Gi"}
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} \
        in c["env"]
    assert p["spec"]["securityContext"]["runAsNonRoot"]


def test_a_checkpointed_job_mounts_its_claim_and_writes_there():
    body = {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": "job", "namespace": "ns", "uid": "u-1"},
            "spec": {"image": "img:1", "resources": {"gpus": 1},
                     "checkpoint": {"claimName": "ckpt", "path": "/data/ckpt"},
                     "args": ["--threads", "4"]}}
    p = k.worker_pod(body, 0, secret="tok", agent_port=50051)
    (c,) = p["spec"]["containers"]
    assert {"name": "checkpoints", "mountPath": "/data/ckpt"} in c["volumeMounts"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}} \
        in p["spec"]["volumes"]
    args = c["args"]
    assert args[args.index("--checkpoint-dir") + 1] == "/data/ckpt"
    assert args[-2:] == ["--threads", "4"]               # spec.args still come last

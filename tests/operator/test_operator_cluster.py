"""The operator's reading of the cluster (doom signals, why a pod waits) and the manifests it
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


def test_a_pod_the_scheduler_cannot_place_carries_its_reason():
    # Capacity is the scheduler's to decide: the operator reads why a pod waits, from the
    # scheduler's PodScheduled condition, and never counts allocatable itself.
    waiting = pod(5, node_name=None, phase="Pending")
    waiting.status.container_statuses = None
    waiting.status.conditions = [client.V1PodCondition(
        type="PodScheduled", status="False", reason="Unschedulable",
        message="0/5 nodes are available: 5 Insufficient nvidia.com/gpu.")]
    w = k.read_worker(waiting, nodes(node("n1")), NOW)
    assert w.unschedulable == "0/5 nodes are available: 5 Insufficient nvidia.com/gpu."
    assert w.node is None and not w.doomed and w.unhealthy == ""
    assert k.read_worker(pod(6), nodes(node("n1")), NOW).unschedulable == ""
    fresh = pod(7, node_name=None, phase="Pending")          # not yet looked at: no reason
    fresh.status.conditions = None
    assert k.unschedulable(fresh) == ""


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


def _templated(template: dict, **spec) -> dict:
    body = {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": "job", "namespace": "ns", "uid": "u-1"},
            "spec": {"image": "img:1", "resources": {"gpus": 8, "memory": "64Gi"},
                     "template": template, **spec}}
    return k.worker_pod(body, 2, secret="tok", agent_port=50051)


def test_the_template_places_the_worker_and_adds_to_it():
    p = _templated({
        "metadata": {"labels": {"team": "llm"}, "annotations": {"note": "x"}},
        "spec": {
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                             "effect": "NoSchedule"}],
            "priorityClassName": "preemptible", "schedulerName": "sched",
            "runtimeClassName": "nvidia", "imagePullSecrets": [{"name": "regcred"}],
            "automountServiceAccountToken": True,
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}],
            "containers": [{
                "name": "worker",
                "env": [{"name": "NCCL_DEBUG", "value": "INFO"},
                        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                            "name": "hf", "key": "token"}}}],
                "envFrom": [{"configMapRef": {"name": "nccl-env"}}],
                "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
                "resources": {"limits": {"rdma/ib": 1, "ephemeral-storage": "100Gi"}}}]}},
        resources={"gpus": 8, "memory": "64Gi", "shmSize": "16Gi"})
    meta, spec = p["metadata"], p["spec"]
    assert meta["labels"]["team"] == "llm" and meta["labels"][k.JOB_LABEL] == "job"
    assert meta["annotations"] == {"note": "x"}
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert (spec["priorityClassName"], spec["schedulerName"], spec["runtimeClassName"]) == (
        "preemptible", "sched", "nvidia")
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["automountServiceAccountToken"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "corpus"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    (c,) = spec["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NCCL_DEBUG"]["value"] == "INFO" and "POD_IP" in env
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf"
    assert c["envFrom"] == [{"configMapRef": {"name": "nccl-env"}}]
    assert {"name": "data", "mountPath": "/data", "readOnly": True} in c["volumeMounts"]
    # extended resources: limit and request alike; the operator's own are unchanged
    assert c["resources"]["limits"]["rdma/ib"] == c["resources"]["requests"]["rdma/ib"] == "1"
    assert c["resources"]["limits"]["ephemeral-storage"] == "100Gi"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert c["resources"]["limits"]["memory"] == "64Gi"


def test_the_template_cannot_take_what_the_operator_owns():
    # The CRD refuses these at admission; the merge reads only what a template may set, so
    # an object stored before a rule existed cannot reach the pod with them either.
    p = _templated({
        "metadata": {"labels": {k.JOB_LABEL: "other"}},
        "spec": {"securityContext": {"runAsUser": 0}, "hostNetwork": True,
                 "restartPolicy": "Always",
                 "volumes": [{"name": "token", "emptyDir": {}}],
                 "containers": [{"name": "worker", "image": "evil", "command": ["sh"],
                                 "env": [{"name": "POD_IP", "value": "1.2.3.4"}],
                                 "volumeMounts": [{"name": "x", "mountPath": "/tmp/"}],
                                 "resources": {"limits": {"nvidia.com/gpu": 64}}}]}})
    spec = p["spec"]
    assert p["metadata"]["labels"][k.JOB_LABEL] == "job"
    assert spec["securityContext"]["runAsUser"] == k.WORKER_UID
    assert "hostNetwork" not in spec and spec["restartPolicy"] == "Never"
    assert [v for v in spec["volumes"] if v["name"] == "token"][0]["secret"]
    (c,) = spec["containers"]
    assert c["image"] == "img:1" and c["command"] == ["dynatrain", "worker"]
    assert [e for e in c["env"] if e["name"] == "POD_IP"][0]["valueFrom"]
    assert all(m["name"] != "x" for m in c["volumeMounts"])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert spec["automountServiceAccountToken"] is False


def test_a_finished_jobs_ttl_counts_from_its_end():
    from dynatrain.operator.runtime import seconds_to_expiry

    end = NOW.isoformat()
    body = {"spec": {"ttlSecondsAfterFinished": 60},
            "status": {"phase": "Succeeded", "conditions": [
                {"type": "Running", "status": "False", "lastTransitionTime": end},
                {"type": "Complete", "status": "True", "lastTransitionTime": end}]}}
    later = NOW + datetime.timedelta(seconds=45)
    assert seconds_to_expiry(body, later) == 15.0
    assert seconds_to_expiry(body, later + datetime.timedelta(seconds=20)) == -5.0
    failed = {"spec": {"ttlSecondsAfterFinished": 0}, "status": {
        "phase": "Failed", "conditions": [{"type": "Failed", "status": "True",
                                           "lastTransitionTime": "2026-11-21T00:00:00Z"}]}}
    assert seconds_to_expiry(failed, NOW) == 0.0
    assert seconds_to_expiry({**body, "spec": {}}, later) is None          # no TTL: kept
    running = {"spec": body["spec"], "status": {"phase": "Running", "conditions": []}}
    assert seconds_to_expiry(running, later) is None


def test_the_nodes_gpu_labels_price_the_job():
    from types import SimpleNamespace

    from dynatrain.spec.hardware import PROFILES
    from dynatrain.operator.runtime import hardware_of

    def labelled(name, product=None, memory=None):
        n = node(name)
        n.metadata.labels = {**({"nvidia.com/gpu.product": product} if product else {}),
                             **({"nvidia.com/gpu.memory": memory} if memory else {})}
        return k.read_node(n)

    job = SimpleNamespace(raw={"spec": {}})
    a40 = labelled("a", "NVIDIA-A100-SXM4-40GB", "40960")
    h100 = labelled("b", "NVIDIA-H100-80GB-HBM3")
    assert hardware_of(job, [a40, a40])[:3] == (PROFILES["a100-40gb"], True, "FromNodeLabels")
    # Mixed models: planned for the least memory, so every layout fits every device.
    profile, ok, reason, text = hardware_of(job, [h100, a40])
    assert (profile.name, ok, reason) == ("a100-40gb", False, "MixedGPUs")
    assert "a100-40gb, h100" in text
    profile, ok, reason, text = hardware_of(job, [labelled("c")])
    assert (profile.name, ok, reason) == ("h100", False, "NoGPULabels")
    assert "spec.hardware.profile" in text and "c" in text
    pinned = SimpleNamespace(raw={"spec": {"hardware": {"profile": "l4"}}})
    assert hardware_of(pinned, [h100])[:3] == (PROFILES["l4"], True, "Override")


def test_kueue_its_queue_label_its_gate_and_its_eviction_read_as_notice():
    spec = {"image": "i", "model": {"preset": "gpt-tiny"}, "queueName": "team-a"}
    body = {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": "job", "uid": "u1", "namespace": "ns"}, "spec": spec}
    made = k.worker_pod(body, 0, secret="s", agent_port=50051)
    assert made["metadata"]["labels"][k.KUEUE_QUEUE_LABEL] == "team-a"
    assert k.KUEUE_QUEUE_LABEL not in k.worker_pod(
        {**body, "spec": {**spec, "queueName": ""}}, 0, secret="s", agent_port=50051
    )["metadata"]["labels"]

    ns = nodes(node("n1"))
    gated = pod(0, node_name=None, phase="Pending")
    gated.spec.scheduling_gates = [client.V1PodSchedulingGate(name=k.KUEUE_GATE)]
    gated.status.conditions = [client.V1PodCondition(
        type="PodScheduled", status="False", reason="SchedulingGated",
        message="Scheduling is blocked due to non-empty scheduling gates")]
    w = k.read_worker(gated, ns, NOW)
    # Held by Kueue for quota: not the scheduler's unmet demand (no share contention).
    assert w.queued and w.unschedulable == "" and not w.doomed

    evicted = pod(1, deleted_in=30)
    evicted.status.conditions = [client.V1PodCondition(
        type=k.KUEUE_STOP_CONDITION, status="True", reason="WorkloadEvictedDueToPreempted",
        message="Preempted to accommodate a workload (UID: x) due to reclamation within the "
                "cohort")]
    w = k.read_worker(evicted, ns, NOW)
    assert w.doomed and w.deadline_s == 30
    assert w.why.startswith("Kueue: WorkloadEvictedDueToPreempted: Preempted to accommodate")


def test_kueue_s_reason_for_a_waiting_pod_is_read_off_its_workload():
    def workload(uid, *conditions):
        return {"metadata": {"name": f"pod-w-{uid}", "labels": {k.KUEUE_JOB_UID_LABEL: uid}},
                "status": {"conditions": [dict(zip(("type", "status", "reason", "message"), c))
                                          for c in conditions]}}
    quota = ("couldn't assign flavors to pod set main: insufficient unused quota for "
             "nvidia.com/gpu in flavor default, 1 more needed")
    waits = k.kueue_waits([
        workload("a", ("QuotaReserved", "False", "Pending", quota)),
        workload("b", ("QuotaReserved", "True", "QuotaReserved", "Quota reserved"),
                 ("Admitted", "True", "Admitted", "")),
        workload("c"),                                # not yet looked at by Kueue
        {"metadata": {"name": "unlabelled"}, "status": {"conditions": [
            {"type": "QuotaReserved", "status": "False", "message": "x"}]}}])
    assert waits == {"a": quota}

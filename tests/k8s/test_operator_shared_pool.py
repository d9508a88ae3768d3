"""A job on a shared GPU cluster's terms: a tainted, labelled pool chosen by the job's pod
template, capacity decided by the real kube-scheduler, priority preemption by it, and the
workers' real nodes deciding where their in-memory mirrors go.

The pool is two simulated nodes added for this test (tainted ``nvidia.com/gpu:NoSchedule``,
labelled with a GPU product), two GPUs each. The job tolerates the taint and selects the pool
by its label, and wants more workers than one node holds: the pods the scheduler cannot place
stay Pending with its reason (the job's unmet demand), the job trains on the others, and when
the second node arrives the waiting pod runs and the job grows live. Nothing is set by hand but
the nodes themselves.
"""

from __future__ import annotations

import pytest
import yaml
from kubernetes import client

from dynatrain.devcluster.nodes import NodePool, Taint, add_nodes, delete_node
from harness.operator_process import agent_client, condition, events, get, job, job_pods, wait

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
PRODUCT = "NVIDIA-A100-SXM4-40GB"


def _pool(first: int, pool: str, prefix: str = "tainted") -> NodePool:
    return NodePool(count=1, gpus_per_node=2, name_prefix=prefix, first_index=first,
                    instance_type="p4d.24xlarge",
                    labels={"nvidia.com/gpu.product": PRODUCT, "dynatrain.io/test-pool": pool},
                    taints=(Taint(key="nvidia.com/gpu", value="present", effect="NoSchedule"),))


def _placement(pool: str) -> dict:
    return {"nodeSelector": {"nvidia.com/gpu.product": PRODUCT, "dynatrain.io/test-pool": pool},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                             "effect": "NoSchedule"}]}


def _templated(name: str, pool: str) -> dict:
    doc = job(name, gpus=1, max_workers=3)
    doc["spec"]["resources"]["shmSize"] = "1Gi"
    doc["spec"]["template"] = {
        "metadata": {"labels": {"team": "llm"}},
        "spec": {
            "nodeSelector": {"nvidia.com/gpu.product": PRODUCT,
                             "dynatrain.io/test-pool": pool},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                             "effect": "NoSchedule"}],
            "volumes": [{"name": "corpus", "configMap": {"name": f"{name}-corpus"}}],
            "containers": [{"name": "worker",
                            "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
                            "volumeMounts": [{"name": "corpus", "mountPath": "/data",
                                              "readOnly": True}]}]}}
    return doc


def test_a_tainted_pool_chosen_by_the_template_and_capacity_from_the_scheduler(
        devcluster, kubectl, namespace, operator, tmp_path):
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    pool = namespace                                  # a label value of this test's own
    nodes = add_nodes(core, _pool(0, pool))
    name = "pooled"
    try:
        core.create_namespaced_config_map(namespace, client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name=f"{name}-corpus"), data={"a.txt": "text"}))
        manifest = tmp_path / "job.yaml"

        # What the operator owns is refused at admission, naming the field and why.
        bad = _templated(name, pool)
        bad["spec"]["template"]["spec"]["securityContext"] = {"runAsUser": 0}
        manifest.write_text(yaml.safe_dump(bad))
        out = kubectl("apply", "-n", namespace, "-f", str(manifest), check=False)
        assert out.returncode != 0 and "spec.template.spec.securityContext" in out.stderr \
            and "restricted Pod Security Standard" in out.stderr, out.stderr

        manifest.write_text(yaml.safe_dump(_templated(name, pool)))
        kubectl("apply", "-n", namespace, "-f", str(manifest))

        # Two workers fit the pool's one node; the third waits with the scheduler's reason.
        def two_running_one_waiting():
            st = get(custom, namespace, name).get("status", {})
            cond = condition(custom, namespace, name, "Schedulable")
            return (st, cond) if st.get("phase") == "Running" and st.get("workers") == 2 \
                and cond and cond["status"] == "False" else None
        st, cond = wait("2 workers on the pool and 1 pod waiting", two_running_one_waiting,
                        timeout=150)
        assert cond["reason"] == "Unschedulable" and "1 of 3 worker pods wait" in \
            cond["message"], cond
        assert "Insufficient nvidia.com/gpu" in cond["message"], cond
        pods = job_pods(core, namespace, name)
        placed = [p for p in pods if p.spec.node_name]
        assert len(pods) == 3 and {p.spec.node_name for p in placed} == set(nodes), \
            [(p.metadata.name, p.spec.node_name) for p in pods]
        # The template reached the pods; /dev/shm is memory, sized; no API token.
        p = placed[0]
        assert p.metadata.labels["team"] == "llm"
        volumes = {v.name: v for v in p.spec.volumes}
        assert volumes["dshm"].empty_dir.medium == "Memory"
        assert volumes["dshm"].empty_dir.size_limit == "1Gi"
        assert volumes["corpus"].config_map.name == f"{name}-corpus"
        (c,) = p.spec.containers
        mounts = {m.mount_path: m.name for m in c.volume_mounts}
        assert mounts["/dev/shm"] == "dshm" and mounts["/data"] == "corpus"
        assert {"NCCL_DEBUG"} <= {e.name for e in c.env}
        assert p.spec.automount_service_account_token is False
        assert p.spec.security_context.fs_group_change_policy == "OnRootMismatch"
        assert "Unschedulable" in [e.reason for e in events(core, namespace, name)]
        # The pool's GPU labels price the job: A100 40 GB, not the H100 a GPU job once was.
        hw = wait("the Hardware condition", lambda: condition(custom, namespace, name,
                                                              "Hardware"), timeout=30)
        assert (hw["status"], hw["reason"]) == ("True", "FromNodeLabels"), hw
        assert get(custom, namespace, name)["status"]["hardware"] == "a100-40gb"

        # A second node joins the pool: the waiting pod runs there, the job grows live.
        nodes += add_nodes(core, _pool(1, pool))

        def grown():
            st = get(custom, namespace, name).get("status", {})
            return st if st.get("workers") == 3 and st.get("phase") == "Running" else None
        st = wait("the job to grow onto the new node", grown, timeout=150)
        assert st["lastSwitch"]["reason"] == "scale-up", st["lastSwitch"]
        assert {p.spec.node_name for p in job_pods(core, namespace, name)} == set(nodes)
        wait("Schedulable again", lambda: (condition(custom, namespace, name, "Schedulable")
                                           or {}).get("status") == "True", timeout=30)
        assert "WorkerLost" not in [e.reason for e in events(core, namespace, name)]
    finally:
        kubectl("delete", "dynatrainjob", name, "-n", namespace, "--wait=false", check=False)
        wait("the job's pods to go", lambda: not job_pods(core, namespace, name), timeout=60)
        for n in nodes:
            delete_node(core, n)


def test_a_higher_priority_pod_preempts_a_worker_through_the_scheduler(
        devcluster, kubectl, namespace, operator, tmp_path):
    # The main way a shared cluster takes GPUs back: kube-scheduler evicts a lower-priority
    # pod for a higher one (DisruptionTarget, reason PreemptionByScheduler, then a graceful
    # deletion). The job shrinks live, its replacement pod waits, and it grows back when the
    # capacity returns: no failure, no step trained twice, every sample read once.
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    sched = client.SchedulingV1Api(devcluster.api_client())
    pool, name = namespace, "yielding"
    low, high = f"{namespace}-low", f"{namespace}-high"
    for cls, value in ((low, 100), (high, 100000)):
        sched.create_priority_class(client.V1PriorityClass(
            metadata=client.V1ObjectMeta(name=cls), value=value))
    nodes = add_nodes(core, _pool(0, pool, prefix="prio"))
    try:
        doc = job(name, gpus=1, max_workers=2)
        doc["spec"]["template"] = {"spec": {**_placement(pool), "priorityClassName": low}}
        manifest = tmp_path / "job.yaml"
        manifest.write_text(yaml.safe_dump(doc))
        kubectl("apply", "-n", namespace, "-f", str(manifest))

        def on(workers):
            def check():
                st = get(custom, namespace, name).get("status", {})
                return st if st.get("phase") == "Running" and st.get("workers") == workers \
                    else None
            return check
        wait("the job on both GPUs of the pool", on(2), timeout=150)
        assert all(p.spec.priority == 100 for p in job_pods(core, namespace, name))

        core.create_namespaced_pod(namespace, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "urgent"},
            "spec": {**_placement(pool), "priorityClassName": high,
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": "unused",
                                     "command": ["sleep", "3600"],
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})

        def preempted():
            st = get(custom, namespace, name).get("status", {})
            last = st.get("lastSwitch", {})
            return st if last.get("reason") == "preemption" and st.get("workers") == 1 \
                else None
        st = wait("a live shrink for the scheduler's preemption", preempted, timeout=120)
        assert st["lastSwitch"]["result"] == "success" and st["lastSwitch"]["pauseSeconds"] > 0
        wait("the urgent pod to run", lambda: core.read_namespaced_pod(
            "urgent", namespace).status.phase == "Running", timeout=90)
        why = [e.message for e in events(core, namespace, name) if e.reason == "Preemption"]
        assert why and any("PreemptionByScheduler" in m or "pod deleted" in m for m in why), why
        wait("the replacement pod to wait for the GPU", lambda: (
            condition(custom, namespace, name, "Schedulable") or {}).get(
            "reason") == "Unschedulable", timeout=60)

        core.delete_namespaced_pod("urgent", namespace)
        st = wait("the job to grow back", on(2), timeout=150)
        assert st["lastSwitch"]["reason"] == "scale-up", st["lastSwitch"]
        reasons = [e.reason for e in events(core, namespace, name)]
        assert "WorkerLost" not in reasons and "Recovered" not in reasons, reasons

        def audited():
            data = get(custom, namespace, name).get("status", {}).get("data", {})
            return data if data.get("auditedStep", 0) > st["lastSwitch"]["step"] + 2 else None
        data = wait("the data audit past the regrowth", audited, timeout=90)
        assert data["exactlyOnce"] and data["retrainedSteps"] == 0, data
    finally:
        kubectl("delete", "dynatrainjob", name, "-n", namespace, "--wait=false", check=False)
        kubectl("delete", "pod", "urgent", "-n", namespace, "--wait=false",
                "--ignore-not-found", check=False)
        wait("the job's pods to go", lambda: not job_pods(core, namespace, name), timeout=60)
        for n in nodes:
            delete_node(core, n)
        for cls in (low, high):
            sched.delete_priority_class(cls)


def test_mirrors_live_on_another_node_and_a_lost_node_is_recovered_from_memory(
        devcluster, kubectl, namespace, operator, tmp_path):
    # Two nodes of two GPUs, four one-GPU workers, two per node. Every layout of the job
    # (ZeRO-1 only) gives each rank unique optimizer state, which survives a loss only in
    # its mirror. The mirrors must follow the real nodes (spec.nodeName), not a guess from
    # device ids, or losing a node loses both copies. The job runs 2 workers on the first
    # node, then the second joins and it is scaled to 4, so devices 0 and 1 share one node
    # and 2 and 3 the other: the old guess
    # (device // 8, all on one node) paired device 0 with device 1.
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    pool, name = namespace, "spread"

    def node(index):
        return add_nodes(core, NodePool(
            count=1, first_index=index, gpus_per_node=2, name_prefix="mirror",
            instance_type="p4d.24xlarge",
            labels={"nvidia.com/gpu.product": PRODUCT, "dynatrain.io/test-pool": pool},
            taints=(Taint(key="nvidia.com/gpu", value="present", effect="NoSchedule"),)))
    nodes = node(0)
    try:
        doc = job(name, gpus=1, max_workers=4)
        doc["spec"]["elastic"]["workers"] = 2            # devices 0 and 1, on the one node
        doc["spec"]["parallelism"] = {"mode": "auto", "limits": {"zeroStages": [1]}}
        doc["spec"]["template"] = {"spec": _placement(pool)}
        manifest = tmp_path / "job.yaml"
        manifest.write_text(yaml.safe_dump(doc))
        kubectl("apply", "-n", namespace, "-f", str(manifest))
        wait("the job on the first node's 2 workers", lambda: (lambda st: st.get(
            "phase") == "Running" and st.get("workers") == 2)(
            get(custom, namespace, name).get("status", {})), timeout=150)
        nodes += node(1)
        kubectl("scale", f"dynatrainjob/{name}", "-n", namespace, "--replicas=4")

        def four():
            st = get(custom, namespace, name).get("status", {})
            return st if st.get("phase") == "Running" and st.get("workers") == 4 \
                and st.get("step", 0) >= 3 else None
        wait("the job on 4 workers over 2 nodes", four, timeout=150)
        pods = {int(p.metadata.labels["dynatrain.io/device"]): p
                for p in job_pods(core, namespace, name)}
        node_of = {d: p.spec.node_name for d, p in pods.items()}
        assert sorted(node_of.values()) == sorted(nodes * 2), node_of
        assert node_of[0] == node_of[1] != node_of[2] == node_of[3], node_of

        def mirrors():
            out = {}
            for d, p in pods.items():
                c = agent_client(core, namespace, name, p)
                try:
                    st = c.status(since_step=1 << 62)
                finally:
                    c.close()
                if st.mirror_of < 0 or not st.mirror_steps:
                    return None
                out[d] = st.mirror_of
            return out
        mirror_of = wait("every worker to hold a mirror", mirrors, timeout=60)
        assert sorted(mirror_of.values()) == sorted(pods), mirror_of
        assert all(node_of[src] != node_of[d] for d, src in mirror_of.items()), \
            (mirror_of, node_of)

        lost = nodes[0]
        delete_node(core, lost)                        # the machine is gone, without notice

        def recovered():
            st = get(custom, namespace, name).get("status", {})
            last = st.get("lastSwitch", {})
            return st if last.get("reason") in ("failure", "preemption") \
                and st.get("workers") == 2 else None
        st = wait(f"a recovery from the loss of {lost}", recovered, timeout=120)
        assert st["lastSwitch"]["result"] == "success", st["lastSwitch"]
        # No checkpoint exists (the job has none): the state came from the mirrors.
        assert "checkpoint" not in doc["spec"]
        wait("training to go on", lambda: get(custom, namespace, name)["status"].get(
            "step", 0) > st["lastSwitch"]["step"] + 2, timeout=90)
        assert get(custom, namespace, name)["status"]["phase"] == "Running"
    finally:
        kubectl("delete", "dynatrainjob", name, "-n", namespace, "--wait=false", check=False)
        wait("the job's pods to go", lambda: not [
            p for p in job_pods(core, namespace, name) if p.spec.node_name != nodes[0]],
            timeout=60)
        for n in nodes:
            try:
                delete_node(core, n)
            except client.exceptions.ApiException as e:
                if e.status != 404:
                    raise

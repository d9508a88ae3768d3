"""The operator against the real control plane, with real worker processes and real switches.

kwok simulates the GPU nodes and runs no containers; the dev cluster's pod runner
(:class:`dynatrain.devcluster.pods.PodRunner`, what ``dynatrain dev cluster --run-pods`` uses)
starts each worker pod's command as a local process on its (loopback) pod IP. Everything else is the real thing:
kubectl apply, the scheduler placing pods on GPU nodes, the operator (a separate process, as in
a cluster) creating pods, reading taints, driving the agents over gRPC, and the trainers
switching layout live.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from dynatrain.devcluster import NodePool
from dynatrain.devcluster.nodes import SPOT_INTERRUPTION_TAINT, Taint, taint, untaint

from harness.operator_process import GROUP, PLURAL, VERSION, Operator, agent_client, condition, \
    events as _events, get as _get, job as _job, wait as _wait

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_apply_preempt_and_grow(devcluster, kubectl, namespace, operator, tmp_path):
    op, pods = operator
    core = devcluster.core()
    custom = client.CustomObjectsApi(devcluster.api_client())
    # Whole-node workers (8 GPUs each) make capacity exact: one worker per GPU node.
    manifest = tmp_path / "job.yaml"
    doc = _job("elastic", gpus=8, max_workers=6)
    doc["spec"]["output"] = {"logEverySteps": 1}    # the rank-0 worker logs every step
    manifest.write_text(yaml.safe_dump(doc))
    kubectl("apply", "-n", namespace, "-f", str(manifest))

    def running():
        st = _get(custom, namespace, "elastic").get("status", {})
        return st if st.get("phase") == "Running" and st.get("layout") else None

    st = _wait("the job to run", running, timeout=150)
    gpu_nodes = {n.metadata.name for n in core.list_node().items
                 if int((n.status.allocatable or {}).get("nvidia.com/gpu", "0")) > 0}
    job_pods = core.list_namespaced_pod(namespace, label_selector="dynatrain.io/job=elastic").items
    placed = [p for p in job_pods if p.spec.node_name]
    assert placed and all(p.spec.node_name in gpu_nodes for p in placed)
    start_workers = st["workers"]
    assert start_workers == len(gpu_nodes) == 4, st
    # The other two pods wait for a node (the job's unmet demand), saying why.
    assert len(job_pods) == 6 and all(p.status.phase == "Pending" for p in job_pods
                                      if not p.spec.node_name)
    _wait("the Schedulable condition", lambda: (condition(custom, namespace, "elastic",
                                                          "Schedulable") or {}).get(
        "reason") == "Unschedulable", timeout=30)
    table = kubectl("get", "dynatrainjobs", "-n", namespace).stdout
    for column in ("PHASE", "LAYOUT", "WORKERS", "STEP", "LOSS", "LAST SWITCH", "AGE"):
        assert column in table
    assert "Running" in table and st["layout"] in table

    # A spot interruption taint on one node: the job switches off that node's worker before
    # its pod is deleted (the operator deletes it only after the switch).
    victim = next(p for p in job_pods if p.metadata.labels["dynatrain.io/device"] ==
                  str(min(int(p.metadata.labels["dynatrain.io/device"]) for p in job_pods)))
    node = victim.spec.node_name
    taint(core, node, Taint(key=SPOT_INTERRUPTION_TAINT, value="true", effect="NoSchedule"))
    try:
        def preempted():
            last = _get(custom, namespace, "elastic").get("status", {}).get("lastSwitch", {})
            return last if last.get("reason") == "preemption" else None

        last = _wait("a preemption switch", preempted, timeout=120)
        assert last["pauseSeconds"] > 0
        st = _get(custom, namespace, "elastic")["status"]
        assert st["workers"] == start_workers - 1
        _wait("the operator to delete the victim's pod", lambda: any(
            p.metadata.name == victim.metadata.name and p.metadata.deletion_timestamp
            for p in core.list_namespaced_pod(
                namespace, label_selector="dynatrain.io/job=elastic").items) or not any(
            p.metadata.name == victim.metadata.name for p in core.list_namespaced_pod(
                namespace, label_selector="dynatrain.io/job=elastic").items))
        # the victim's worker saw the switch through and left: it exits by itself (0), or
        # was shutting down when its pod's deletion sent SIGTERM; it was never SIGKILLed
        assert pods.process(namespace, victim.metadata.name).wait(30) in (0, -signal.SIGTERM)

        # New GPU nodes: the job grows onto them.
        devcluster.add_pool(NodePool(count=2, gpus_per_node=8, name_prefix="gpu-extra",
                                     instance_type="p5.48xlarge"))

        def grown():
            st = _get(custom, namespace, "elastic").get("status", {})
            last = st.get("lastSwitch", {})
            return st if last.get("reason") == "scale-up" else None

        st = _wait("a scale-up switch onto the new nodes", grown, timeout=150)
        assert st["workers"] > start_workers - 1
        reasons = [e.reason for e in _events(core, namespace, "elastic")]
        assert reasons.count("Switched") >= 2 and "Preemption" in reasons
        m = op.metrics()
        done = {dict(k[1]).get("reason"): v for k, v in m.items()
                if k[0] == "dynatrain_switches_total" and dict(k[1]).get("result") == "success"}
        assert done.get("preemption", 0) >= 1 and done.get("scale-up", 0) >= 1, done
        # the operator's own cost: its requests counted by verb, its passes timed
        verbs = {dict(k[1])["verb"]: v for k, v in m.items()
                 if k[0] == "dynatrain_operator_api_requests_total"}
        assert verbs.get("POST", 0) >= 4 and verbs.get("PATCH", 0) >= 1, verbs
        # At least a pass for each of the job's start, the preemption and the scale-up (a
        # count, not a rate: the operator's passes follow the changes it watches, and a faster
        # cluster makes fewer of them; 10 was once a floor here, and a run made exactly 10).
        key = (("job", "elastic"), ("namespace", namespace))
        passes = (m[("dynatrain_operator_reconcile_seconds_count", key)],
                  m[("dynatrain_operator_reconcile_seconds_sum", key)])
        assert passes[0] >= 3 and passes[1] > 0, passes
        _check_step_and_loss_columns(kubectl, core, namespace, "elastic")
    finally:
        untaint(core, node, SPOT_INTERRUPTION_TAINT)
        kubectl("delete", "dynatrainjob", "elastic", "-n", namespace, "--wait=false")


def _columns(table: str) -> dict[str, str]:
    """The first row of a ``kubectl get`` table, by column header (values may hold spaces)."""
    header, row = table.splitlines()[:2]
    starts = [(m.start(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", header)]
    return {name: row[start:(starts[i + 1][0] if i + 1 < len(starts) else None)].strip()
            for i, (start, name) in enumerate(starts)}


def _check_step_and_loss_columns(kubectl, core, namespace, name) -> None:
    """``kubectl get`` shows the job's step and loss, and they are what the job's rank-0
    worker said for that step in its log (every step, with ``logEverySteps: 1``), as
    ``kubectl logs`` of the running workers shows it."""
    row = _columns(kubectl("get", "dynatrainjobs", name, "-n", namespace).stdout)
    step, loss = int(row["STEP"]), float(row["LOSS"])
    assert step > 0 and loss > 0, row

    def said():
        found = {}
        for pod in core.list_namespaced_pod(namespace,
                                            label_selector=f"dynatrain.io/job={name}").items:
            if pod.metadata.deletion_timestamp or pod.status.phase != "Running":
                continue
            for line in kubectl("logs", pod.metadata.name, "-n", namespace).stdout.splitlines():
                if "rank 0): step " in line:
                    text = line.split("rank 0): step ", 1)[1]
                    found.setdefault(int(text.split("/")[0]), []).append(
                        float(text.split("loss ")[1].split()[0]))
        return found if step in found else None

    lines = _wait(f"the rank-0 worker's line for step {step}", said, timeout=20)
    assert lines[step] == [pytest.approx(loss, abs=1e-6)], (row, lines[step])


def test_operator_restart_mid_switch(devcluster, kubectl, namespace, operator, tmp_path):
    op, pods = operator
    core = devcluster.core()
    custom = client.CustomObjectsApi(devcluster.api_client())
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(_job("restart", gpus=1, max_workers=4)))
    kubectl("apply", "-n", namespace, "-f", str(manifest))
    st = _wait("the job to run", lambda: (lambda s: s if s.get("phase") == "Running"
                                           and s.get("layout") else None)(
        _get(custom, namespace, "restart").get("status", {})), timeout=150)
    generation = st["generation"]
    target = "dp=1,tp=2,pp=2" if st["layout"] != "dp=1,tp=2,pp=2" else "dp=4,tp=1,pp=1"
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "restart", {
        "spec": {"parallelism": {"mode": "fixed", "layout": target}}})
    _wait("the switch to start", lambda: _get(custom, namespace, "restart")["status"].get(
        "phase") == "Switching", timeout=60, interval=0.05)
    op.kill()                                   # in the middle of the switch
    time.sleep(1.0)
    op.start()

    def settled():
        s = _get(custom, namespace, "restart").get("status", {})
        return s if s.get("phase") == "Running" and s.get("layout") == target else None

    st = _wait("the job to end on the requested layout", settled, timeout=150)
    assert st["generation"] > generation
    # no orphans: every pod of the job is a worker of the running layout
    job_pods = core.list_namespaced_pod(namespace, label_selector="dynatrain.io/job=restart").items
    live = [p for p in job_pods if p.metadata.deletion_timestamp is None]
    assert len(live) == st["workers"] == 4
    # every worker trains on, on the same generation and layout (asked as the operator asks:
    # mutual TLS and the token)
    seen = set()
    for p in live:
        with agent_client(core, namespace, "restart", p) as c:
            s1 = c.status()
            _wait(f"{p.metadata.name} to keep training", lambda: c.status().step > s1.step,
                  timeout=60)
            s2 = c.status()
        assert s2.generation == st["generation"] and s2.layout == target
        seen.add(s2.rank)
    assert seen == {0, 1, 2, 3}
    kubectl("delete", "dynatrainjob", "restart", "-n", namespace, "--wait=false")


def test_a_worker_killed_without_notice_is_recovered_and_replaced(devcluster, kubectl, namespace,
                                                                  operator, tmp_path):
    op, pods = operator
    core = devcluster.core()
    custom = client.CustomObjectsApi(devcluster.api_client())
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(_job("chaos", gpus=1, max_workers=4)))
    kubectl("apply", "-n", namespace, "-f", str(manifest))
    st = _wait("the job to run on 4 workers", lambda: (lambda s: s if s.get("phase") == "Running"
                                                       and s.get("workers") == 4 else None)(
        _get(custom, namespace, "chaos").get("status", {})), timeout=150)
    victim = sorted(p.metadata.name for p in core.list_namespaced_pod(
        namespace, label_selector="dynatrain.io/job=chaos").items)[1]
    _wait(f"{victim}'s process", lambda: pods.process(namespace, victim))
    pods.process(namespace, victim).kill()       # no notice, no taint: the process is gone

    def recovered():
        last = _get(custom, namespace, "chaos").get("status", {}).get("lastSwitch", {})
        return last if last.get("reason") == "failure" else None

    last = _wait("a recovery switch", recovered, timeout=120)
    assert last["result"] == "success"
    events = _events(core, namespace, "chaos")
    reasons = [e.reason for e in events]
    assert "Switched" in reasons
    device = victim.rsplit("-", 1)[1]
    assert [e.message for e in events if e.reason == "WorkerLost"
            and e.message.startswith(f"worker {device} failed: ")], reasons
    # the dead worker's pod is replaced, and the job goes on training
    _wait("the dead worker's pod to be deleted", lambda: not any(
        p.metadata.name == victim and p.metadata.deletion_timestamp is None
        for p in core.list_namespaced_pod(namespace,
                                          label_selector="dynatrain.io/job=chaos").items))
    _wait("training to go on after the recovery", lambda: _get(
        custom, namespace, "chaos")["status"].get("step", 0) > last["step"] + 2, timeout=60)
    m = op.metrics()
    done = {dict(k[1]).get("reason"): v for k, v in m.items()
            if k[0] == "dynatrain_switches_total" and dict(k[1]).get("result") == "success"}
    assert done.get("failure", 0) >= 1, done
    assert st["generation"] < _get(custom, namespace, "chaos")["status"]["generation"]

    # Deleting the job: its pods, Service, ConfigMap and Secret go through the garbage
    # collector (owner references); the operator deletes none of them itself.
    def owned() -> list[str]:
        objects = (core.list_namespaced_pod(namespace).items
                   + core.list_namespaced_service(namespace).items
                   + core.list_namespaced_config_map(namespace).items
                   + core.list_namespaced_secret(namespace).items)
        return [f"{type(o).__name__} {o.metadata.name}" for o in objects
                if any(r.kind == "DynaTrainJob" and r.name == "chaos"
                       for r in o.metadata.owner_references or [])]
    kinds = {o.split()[0] for o in owned()}
    assert kinds >= {"V1Pod", "V1ConfigMap", "V1Secret"}, kinds
    kubectl("delete", "dynatrainjob", "chaos", "-n", namespace, "--wait=false")
    _wait("the garbage collector to remove the job's objects", lambda: not owned(), timeout=60)
    assert "deleted; its worker pods are gone" not in op.logs()


def test_a_node_that_stops_heart_beating_is_recovered_from(devcluster, kubectl, namespace,
                                                           operator, tmp_path):
    # Node loss as a cluster sees it: the node's lease stops, the node lifecycle controller
    # marks it NotReady and taints it, the taint-eviction controller evicts its pods; the
    # pod runner stops the node's processes (the machine is gone). The job must recover onto
    # the workers left, from memory, and keep training.
    from dynatrain.devcluster.nodes import resume_heartbeat, stop_heartbeat

    op, pods = operator
    core = devcluster.core()
    custom = client.CustomObjectsApi(devcluster.api_client())
    coordination = client.CoordinationV1Api(devcluster.api_client())
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(_job("lossy", gpus=1, max_workers=4)))
    kubectl("apply", "-n", namespace, "-f", str(manifest))
    _wait("the job to run on 4 workers", lambda: (lambda s: s if s.get("phase") == "Running"
                                                   and s.get("workers") == 4 else None)(
        _get(custom, namespace, "lossy").get("status", {})), timeout=150)
    job_pods = core.list_namespaced_pod(namespace, label_selector="dynatrain.io/job=lossy").items
    by_node: dict[str, list[str]] = {}
    for p in job_pods:
        by_node.setdefault(p.spec.node_name, []).append(p.metadata.name)
    # The node with the fewest workers (the scheduler spreads them): some must survive.
    node = min(by_node, key=lambda n: len(by_node[n]))
    assert len(by_node[node]) < len(job_pods), by_node
    _wait("a few steps trained", lambda: _get(custom, namespace, "lossy")["status"].get(
        "step", 0) >= 3, timeout=60)
    try:
        stop_heartbeat(coordination, node)

        def recovered():
            last = _get(custom, namespace, "lossy").get("status", {}).get("lastSwitch", {})
            return last if last.get("reason") in ("failure", "preemption") else None
        last = _wait(f"a recovery from the loss of {node}", recovered, timeout=120)
        assert last["result"] == "success"
        _wait(f"the controller-manager to evict the pods of {node}", lambda: all(
            any(c.type == "DisruptionTarget" for c in p.status.conditions or [])
            for p in core.list_namespaced_pod(namespace).items
            if p.metadata.name in by_node[node]), timeout=60)
        _wait("training to go on after the recovery", lambda: _get(
            custom, namespace, "lossy")["status"].get("step", 0) > last["step"] + 2, timeout=60)
    finally:
        resume_heartbeat(coordination, node)
        kubectl("delete", "dynatrainjob", "lossy", "-n", namespace, "--wait=false")


def test_a_standalone_operator_handles_jobs(devcluster, kubectl, namespace, tmp_path):
    # `dynatrain operator --standalone` (one replica, no KopfPeering object): kopf used to
    # be told a peering name as well, which made peering mandatory, and with none to find
    # every watch stayed paused: no job was ever handled.
    kubectl("apply", "--server-side", "--force-conflicts", "-f",
            str(ROOT / "crds" / "dynatrainjob.yaml"))
    devcluster.wait_established("dynatrainjobs.dynatrain.io")
    op = Operator(devcluster, namespace, tmp_path, standalone=True)
    core = devcluster.core()
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(_job("solo", gpus=1, max_workers=1)))
    op.start()
    try:
        kubectl("apply", "-n", namespace, "-f", str(manifest))
        _wait("the standalone operator to create the job's worker pod", lambda: any(
            p.metadata.name == "solo-worker-0" for p in core.list_namespaced_pod(
                namespace, label_selector="dynatrain.io/job=solo").items), timeout=60)
        kubectl("delete", "dynatrainjob", "solo", "-n", namespace, "--wait=true",
                "--timeout=60s")     # the operator, still running, removes its finalizer
    finally:
        op.stop()
        print(op.logs()[-4000:])

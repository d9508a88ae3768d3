"""Planned removals on a cluster are notice, and `kubectl scale` resizes a job live.

On Kubernetes every planned removal of a pod arrives at its worker as SIGTERM with a grace
period: `kubectl delete pod`, an Eviction API call, `kubectl drain` (a cordon, then
evictions), a spot node's shutdown. The worker trains on and says in its Status that it is
leaving, the operator also sees the pod's deletionTimestamp, and the job switches off the
worker live (reason ``preemption``, never ``failure``): no step is trained twice and every
sample is read exactly once (``status.data``, from the workers' own reports of their reads).

`kubectl scale dtj/NAME --replicas N` sets ``spec.elastic.workers``: fewer is a live
``scale-down`` switch (the leavers' pods are deleted after it), more a ``scale-up``.

The cluster is the dev cluster (real apiserver, scheduler, controller-manager; kwok nodes),
with the pod runner running each worker pod as a local process, as in test_operator.py.
"""

from __future__ import annotations

import time

import pytest
import yaml
from kubernetes import client

from harness.operator_process import events as _events, get as _get, job as _job, wait as _wait

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
LABEL = "dynatrain.io/job"


def _status(custom, namespace, name) -> dict:
    return _get(custom, namespace, name).get("status", {})


def _running_on(custom, namespace, name, workers: int, timeout: float = 150):
    def ready():
        st = _status(custom, namespace, name)
        return st if st.get("phase") == "Running" and st.get("workers") == workers else None
    return _wait(f"{name} to run on {workers} workers", ready, timeout=timeout)


def _switches(core, namespace, name, reason: str) -> list[str]:
    return [e.message for e in _events(core, namespace, name)
            if e.reason == "Switched" and f"({reason})" in e.message]


def _members(core, namespace, name) -> list:
    return sorted((p for p in core.list_namespaced_pod(
        namespace, label_selector=f"{LABEL}={name}").items
        if p.metadata.deletion_timestamp is None),
        key=lambda p: int(p.metadata.labels["dynatrain.io/device"]))


def _left_cleanly(pods, namespace, pod: str) -> int:
    """The exit code of the pod's worker once it has gone (0: it left after its switch)."""
    proc = _wait(f"{pod}'s process", lambda: pods.process(namespace, pod))
    return proc.wait(60)


def _audited_past(custom, namespace, name, step: int) -> dict:
    def audited():
        data = _status(custom, namespace, name).get("data", {})
        return data if data.get("auditedStep", 0) > step + 2 else None
    return _wait(f"the data audit past step {step}", audited, timeout=90)


def test_pod_deletion_eviction_and_drain_switch_off_the_worker_live(
        devcluster, kubectl, namespace, operator, tmp_path):
    op, pods = operator
    core = devcluster.core()
    custom = client.CustomObjectsApi(devcluster.api_client())
    name = "evicted"
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(_job(name, gpus=1, max_workers=4)))
    kubectl("apply", "-n", namespace, "-f", str(manifest))
    _running_on(custom, namespace, name, 4)
    drained = None
    try:
        for way in ("delete", "evict", "drain"):
            before = len(_switches(core, namespace, name, "preemption"))
            victim = _members(core, namespace, name)[1]
            pod, node = victim.metadata.name, victim.spec.node_name
            _wait(f"{pod}'s process", lambda: pods.process(namespace, pod))
            if way == "delete":
                kubectl("delete", "pod", pod, "-n", namespace, "--grace-period=30",
                        "--wait=false")
            elif way == "evict":
                core.create_namespaced_pod_eviction(pod, namespace, client.V1Eviction(
                    metadata=client.V1ObjectMeta(name=pod, namespace=namespace)))
            else:
                drained = node
                # --delete-emptydir-data: the workers' /tmp and $HOME are emptyDirs (the
                # root file system is read-only), which drain otherwise refuses to evict.
                kubectl("drain", node, "--pod-selector", f"{LABEL}={name}",
                        "--ignore-daemonsets", "--delete-emptydir-data", "--grace-period=30",
                        "--timeout=55s")
            _wait(f"a preemption switch after the {way}", lambda: len(
                _switches(core, namespace, name, "preemption")) > before, timeout=120)
            # The worker saw its switch through and exited by itself, well inside its grace
            # period (a kill at the deadline would be -9, and a failure recovery).
            assert _left_cleanly(pods, namespace, pod) == 0, pods.log(namespace, pod)[-3000:]
            assert "told to leave (SIGTERM)" in pods.log(namespace, pod)
            _wait(f"{pod} to be gone", lambda: not any(
                p.metadata.name == pod for p in core.list_namespaced_pod(
                    namespace, label_selector=f"{LABEL}={name}").items), timeout=60)
            # A new pod takes the freed place (not on a drained node) and the job grows back.
            _running_on(custom, namespace, name, 4)
        assert all(p.spec.node_name != drained for p in _members(core, namespace, name))
        reasons = [e.reason for e in _events(core, namespace, name)]
        assert "WorkerLost" not in reasons, reasons
        assert _switches(core, namespace, name, "failure") == []
        st = _status(custom, namespace, name)
        data = _audited_past(custom, namespace, name, st["lastSwitch"]["step"])
        assert data["exactlyOnce"] and data["retrainedSteps"] == 0, data
        assert data["auditedFrom"] == 1, data
    finally:
        if drained:
            kubectl("uncordon", drained)
        kubectl("delete", "dynatrainjob", name, "-n", namespace, "--wait=false")


def test_kubectl_scale_shrinks_and_grows_the_job_live(devcluster, kubectl, namespace, operator,
                                                      tmp_path):
    op, pods = operator
    core = devcluster.core()
    custom = client.CustomObjectsApi(devcluster.api_client())
    name = "scaled"
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(_job(name, gpus=1, max_workers=4)))
    kubectl("apply", "-n", namespace, "-f", str(manifest))
    _running_on(custom, namespace, name, 4)
    four = [p.metadata.name for p in _members(core, namespace, name)]
    try:
        kubectl("scale", f"dynatrainjob/{name}", "-n", namespace, "--replicas=2")
        st = _running_on(custom, namespace, name, 2, timeout=120)
        last = st["lastSwitch"]
        assert last["reason"] == "scale-down" and last["result"] == "success", last
        assert last["pauseSeconds"] > 0
        # The leavers' pods are deleted after the switch, and their workers left cleanly.
        _wait("two pods to be gone", lambda: len(_members(core, namespace, name)) == 2,
              timeout=60)
        left = sorted(set(four) - {p.metadata.name for p in _members(core, namespace, name)})
        assert len(left) == 2
        for pod in left:
            assert _left_cleanly(pods, namespace, pod) == 0, pods.log(namespace, pod)[-3000:]
        time.sleep(3)                             # no pod is created back while 2 are wanted
        assert len(_members(core, namespace, name)) == 2
        assert kubectl("get", f"dynatrainjob/{name}", "-n", namespace, "-o",
                       "jsonpath={.spec.elastic.workers}").stdout == "2"

        kubectl("scale", f"dynatrainjob/{name}", "-n", namespace, "--replicas=4")
        st = _running_on(custom, namespace, name, 4, timeout=150)
        assert st["lastSwitch"]["reason"] == "scale-up", st["lastSwitch"]
        assert len(_members(core, namespace, name)) == 4
        reasons = [e.reason for e in _events(core, namespace, name)]
        assert "WorkerLost" not in reasons, reasons
        data = _audited_past(custom, namespace, name, st["lastSwitch"]["step"])
        assert data["exactlyOnce"] and data["retrainedSteps"] == 0, data
        # Below spec.elastic.minWorkers is refused by the CRD, naming the rule.
        job = _get(custom, namespace, name)
        assert job["spec"]["elastic"]["minWorkers"] == 1
        bad = kubectl("scale", f"dynatrainjob/{name}", "-n", namespace, "--replicas=0",
                      check=False)
        assert bad.returncode != 0 and "minWorkers" in bad.stderr, bad.stderr
    finally:
        kubectl("delete", "dynatrainjob", name, "-n", namespace, "--wait=false")

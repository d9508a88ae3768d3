"""Kueue decides, the job adapts (#35): a low-priority elastic job borrows a cohort's idle quota,
a high-priority job in the other ClusterQueue arrives and Kueue itself reclaims it by
preempting the low job's worker pods, which the job takes as notice and shrinks live; when the
high job ends, Kueue admits the low job's waiting pods and it grows back live.

Real Kueue (built from its Go module, started by the dev cluster with its webhooks), real
kube-scheduler; the pool is two simulated nodes of this test's own, two GPUs each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes import client

from dynatrain.devcluster.nodes import NodePool, Taint, add_nodes, delete_node
from harness.operator_process import apply, condition, events, get, job_pods, wait

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


ROOT = Path(__file__).resolve().parents[2]


def _queues(namespace: str) -> list[dict]:
    """The README recipe's queues (examples/kueue/queues.yaml): two ClusterQueues of 2 GPUs
    each in one cohort (borrowing allowed, reclaimed by preemption), a LocalQueue for each,
    here in the test's namespace."""
    docs = [d for d in yaml.safe_load_all((ROOT / "examples/kueue/queues.yaml").read_text())
            if d]
    for d in docs:
        if d["kind"] == "LocalQueue":
            d["metadata"]["namespace"] = namespace
    return docs


def _pool(index: int, pool: str) -> NodePool:
    return NodePool(count=1, gpus_per_node=2, name_prefix="kueue", first_index=index,
                    labels={"dynatrain.io/test-pool": pool},
                    taints=(Taint(key="nvidia.com/gpu", value="present", effect="NoSchedule"),))


def _recipe_job(name: str, pool: str) -> dict:
    """The README recipe's job (examples/kueue/NAME.yaml) on this test's pool."""
    doc = yaml.safe_load((ROOT / f"examples/kueue/{name}.yaml").read_text())
    doc["spec"]["template"] = {"spec": {
        "nodeSelector": {"dynatrain.io/test-pool": pool},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                         "effect": "NoSchedule"}]}}
    return doc


def test_kueue_reclaims_borrowed_quota_by_preemption_and_the_job_shrinks_live_and_grows_back(
        kueue, kubectl, namespace, operator, tmp_path):
    devcluster = kueue
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    pool = namespace
    queues = tmp_path / "queues.yaml"
    queues.write_text(yaml.safe_dump_all(_queues(namespace)))
    kubectl("apply", "-f", str(queues))
    nodes = []
    try:
        for i in range(2):
            nodes += add_nodes(core, _pool(20 + i, pool))

        def on(name, workers):
            def check():
                st = get(custom, namespace, name).get("status", {})
                return st if st.get("phase") == "Running" and st.get("workers") == workers \
                    else None
            return check

        # The low job (team a, 2 GPUs of quota) borrows team b's idle 2: 4 workers.
        apply(kubectl, namespace, tmp_path, _recipe_job("borrower", pool))
        wait("the borrower on 4 workers (2 of them on borrowed quota)", on("borrower", 4),
             timeout=240)
        pods = job_pods(core, namespace, "borrower")
        assert all(p.metadata.labels.get("kueue.x-k8s.io/queue-name") == "team-a"
                   for p in pods), [p.metadata.labels for p in pods]
        assert all("kueue.x-k8s.io/managed" in (p.metadata.finalizers or []) for p in pods)
        admitted = wait("the Admitted condition", lambda: condition(
            custom, namespace, "borrower", "Admitted"), timeout=30)
        assert admitted["status"] == "True", admitted

        # Team b's job arrives: Kueue reclaims the borrowed quota by preempting two of the
        # borrower's pods; the borrower switches them out live.
        apply(kubectl, namespace, tmp_path, _recipe_job("owner", pool))
        wait("team b's job on its 2 workers", on("owner", 2), timeout=240)
        st = wait("the borrower shrunk live to 2", on("borrower", 2), timeout=120)
        shrink = st["lastSwitch"]
        assert (shrink["reason"], shrink["result"]) == ("preemption", "success"), shrink
        notices = [e.message for e in events(core, namespace, "borrower")
                   if e.reason == "Preemption"]
        assert any("Kueue" in m for m in notices), notices
        reasons = [e.reason for e in events(core, namespace, "borrower")]
        assert "WorkerLost" not in reasons and "Recovered" not in reasons, reasons
        # Its replacement pods wait for quota, held by Kueue (not by the scheduler).
        waiting = wait("the borrower's pods waiting for quota", lambda: (
            condition(custom, namespace, "borrower", "Admitted") or {}).get(
            "reason") == "QuotaWait" and condition(custom, namespace, "borrower", "Admitted"),
            timeout=60)
        assert "wait for Kueue to admit them (LocalQueue team-a" in waiting["message"], waiting
        assert "QuotaWait" in [e.reason for e in events(core, namespace, "borrower")]

        # Team b's job ends: Kueue admits the waiting pods, the borrower grows back live.
        kubectl("delete", "dynatrainjob", "owner", "-n", namespace, "--wait=false")
        st = wait("the borrower grown back to 4", on("borrower", 4), timeout=240)
        assert st["lastSwitch"]["reason"] == "scale-up", st["lastSwitch"]

        def audited():
            data = get(custom, namespace, "borrower").get("status", {}).get("data", {})
            return data if data.get("auditedStep", 0) > st["lastSwitch"]["step"] + 2 else None
        data = wait("the data audit past the regrowth", audited, timeout=120)
        assert data["exactlyOnce"] and data["retrainedSteps"] == 0, data
    finally:
        for name in ("borrower", "owner"):
            kubectl("delete", "dynatrainjob", name, "-n", namespace, "--wait=false",
                    check=False)
        for name in ("borrower", "owner"):
            wait(f"{name}'s pods to go", lambda: not job_pods(core, namespace, name),
                 timeout=120)
        for n in nodes:
            delete_node(core, n)
        kubectl("delete", "-f", str(queues), "--wait=false", check=False)

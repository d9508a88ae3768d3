"""Kueue decides, the job adapts (#35): a low-priority elastic job borrows a cohort's idle quota,
a high-priority job in the other ClusterQueue arrives and Kueue itself reclaims it by
preempting the low job's worker pods, which the job takes as notice and shrinks live; when the
high job ends, Kueue admits the low job's waiting pods and it grows back live.

Real Kueue (built from its Go module, started by the dev cluster with its webhooks), real
kube-scheduler; the pool is two simulated nodes of this test's own, two GPUs each.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from dynatrain.devcluster.nodes import add_nodes
from harness.operator_process import (apply, audited_past, claim, condition, events, get,
                                     job_pods, on_pool, remove_jobs, running_on, pool_node,
                                     wait)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


ROOT = Path(__file__).resolve().parents[2]


def _queues(namespace: str) -> list[dict]:
    """The README recipe's queues (examples/kueue/queues.yaml): two ClusterQueues of 2 GPUs
    each in one cohort (borrowing allowed, reclaimed by preemption), a LocalQueue for each,
    here in the test's namespace."""
    docs = [d for d in yaml.safe_load_all((ROOT / "examples/kueue/queues.yaml").read_text())
            if d]
    # The cluster-wide objects get names of this test's own (a deleted ClusterQueue lingers
    # while its workloads finish, and a later test must not find it terminating).
    for d in docs:
        if d["kind"] == "LocalQueue":
            d["metadata"]["namespace"] = namespace
            d["spec"]["clusterQueue"] = f"{namespace}-{d['spec']['clusterQueue']}"
        else:
            d["metadata"]["name"] = f"{namespace}-{d['metadata']['name']}"
        if d["kind"] == "ClusterQueue":
            d["spec"]["cohortName"] = namespace
            for group in d["spec"]["resourceGroups"]:
                for flavor in group["flavors"]:
                    flavor["name"] = f"{namespace}-{flavor['name']}"
    return docs


def _apply_queues(kubectl, namespace: str, tmp_path, docs: list[dict] | None = None):
    """``kubectl apply`` of the recipe's queues (or ``docs``); the file, to delete them by."""
    queues = tmp_path / "queues.yaml"
    queues.write_text(yaml.safe_dump_all(docs or _queues(namespace)))
    kubectl("apply", "-f", str(queues))
    return queues


def _pool(index: int, pool: str):
    return pool_node("kueue", index, pool)


def _recipe_job(name: str, pool: str) -> dict:
    """The README recipe's job (examples/kueue/NAME.yaml) on this test's pool."""
    return on_pool(yaml.safe_load((ROOT / f"examples/kueue/{name}.yaml").read_text()), pool)


@pytest.mark.timeout(600)        # several jobs to start and switch on a small machine
def test_kueue_reclaims_borrowed_quota_by_preemption_and_the_job_shrinks_live_and_grows_back(
        kueue, kubectl, namespace, operator, tmp_path):
    devcluster = kueue
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    on = partial(running_on, custom, namespace)
    pool = namespace
    queues = _apply_queues(kubectl, namespace, tmp_path)
    nodes = []
    try:
        for i in range(2):
            nodes += add_nodes(core, _pool(20 + i, pool))


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
        # ... in Kueue's own words, read off their Workloads (QuotaReserved False).
        said = wait("Kueue's reason in the Admitted condition", lambda: (lambda c: c if c and (
            "Kueue says: " in c["message"]) else None)(
            condition(custom, namespace, "borrower", "Admitted")), timeout=60)
        assert "quota" in said["message"].split("Kueue says: ", 1)[1], said
        assert "QuotaWait" in [e.reason for e in events(core, namespace, "borrower")]

        # Team b's job ends: Kueue admits the waiting pods, the borrower grows back live.
        kubectl("delete", "dynatrainjob", "owner", "-n", namespace, "--wait=false")
        st = wait("the borrower grown back to 4", on("borrower", 4), timeout=240)
        assert st["lastSwitch"]["reason"] == "scale-up", st["lastSwitch"]

        data = wait("the data audit past the regrowth", audited_past(
            custom, namespace, "borrower", st["lastSwitch"]["step"]), timeout=120)
        assert data["exactlyOnce"] and data["retrainedSteps"] == 0, data
    finally:
        remove_jobs(kubectl, core, namespace, ("borrower", "owner"), nodes)
        kubectl("delete", "-f", str(queues), "--wait=false", check=False)


@pytest.mark.timeout(600)        # several jobs to start and switch on a small machine
def test_a_job_that_cannot_reach_its_minimum_lets_go_of_what_kueue_admitted(
        kueue, kubectl, namespace, operator, tmp_path):
    # One queue of 3 GPUs. "first" (2 workers) runs; "second" (minimum 2) gets one pod
    # admitted and one held for quota; "third" (1 worker) queues behind it. After the gang
    # wait, "second" lets go of its admitted pod, so "third" runs on that GPU, and "second"
    # waits holding nothing until "first" ends; then it runs whole.
    devcluster = kueue
    op, _ = operator
    op.stop()
    op.env["DYNATRAIN_GANG_WAIT_S"] = "8"
    op.start()
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    on = partial(running_on, custom, namespace)
    pool = namespace
    docs = [d for d in _queues(namespace) if d["kind"] == "ResourceFlavor"
            or d["metadata"]["name"] in (f"{namespace}-team-a", "team-a")]
    cq = next(d for d in docs if d["kind"] == "ClusterQueue")
    cq["spec"].pop("cohortName")
    cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"][2]["nominalQuota"] = 3
    queues = _apply_queues(kubectl, namespace, tmp_path, docs)
    names = ("first", "second", "third")
    nodes = []
    try:
        for i in range(2):
            nodes += add_nodes(core, _pool(30 + i, pool))


        def job_of(name, lo, hi):
            doc = _recipe_job("borrower", pool)
            doc["metadata"]["name"] = name
            doc["spec"]["elastic"] = {"minWorkers": lo, "maxWorkers": hi}
            return doc
        apply(kubectl, namespace, tmp_path, job_of("first", 2, 2))
        wait("the first job on 2 workers", on("first", 2), timeout=240)
        apply(kubectl, namespace, tmp_path, job_of("second", 2, 2))

        def half_admitted():
            pods = job_pods(core, namespace, "second")
            placed = [p for p in pods if p.spec.node_name]
            return pods if len(pods) == 2 and len(placed) == 1 else None
        wait("one of the second job's pods admitted, one held", half_admitted, timeout=120)
        apply(kubectl, namespace, tmp_path, job_of("third", 1, 1))

        wait("the third job running on the GPU the second let go of", on("third", 1),
             timeout=240)
        released = [e.message for e in events(core, namespace, "second")
                    if e.reason == "GangReleased"]
        assert released and "holds 1 of its minimum 2 workers" in released[0], released
        assert "Kueue's quota" in released[0] or "gates" in released[0], released
        # The second job now holds nothing: its pods wait for quota, none is placed.
        wait("the second job holding nothing", lambda: all(
            not p.spec.node_name for p in job_pods(core, namespace, "second")), timeout=60)
        st = get(custom, namespace, "second").get("status", {})
        assert st.get("phase") == "Pending", st

        kubectl("delete", "dynatrainjob", "first", "-n", namespace, "--wait=false")
        wait("the second job running whole", on("second", 2), timeout=240)
    finally:
        remove_jobs(kubectl, core, namespace, names, nodes)
        kubectl("delete", "-f", str(queues), "--wait=false", check=False)


@pytest.mark.timeout(600)        # two jobs to start, a park and a resume on a small machine
def test_kueue_taking_a_job_under_its_minimum_parks_it_at_a_checkpoint_until_quota_returns(
        kueue, kubectl, namespace, operator, tmp_path):
    # The recipe, with the borrower needing 3 workers and checkpointing to a claim: Kueue's
    # reclaim of 2 leaves it 2, under its minimum. It writes a checkpoint with all 4 workers
    # (the 2 preempted inside their grace period), lets go of its pods and waits; when team b's
    # job ends it continues from that checkpoint, no step lost and none trained twice.
    devcluster = kueue
    op, runner = operator
    op.stop()
    op.env["DYNATRAIN_GANG_WAIT_S"] = "8"        # the 2 GPUs it gets back while waiting go fast
    op.start()
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    on = partial(running_on, custom, namespace)
    pool = namespace
    queues = _apply_queues(kubectl, namespace, tmp_path)
    claim(core, namespace, "parked")
    nodes = []
    try:
        for i in range(2):
            nodes += add_nodes(core, _pool(40 + i, pool))
        borrower = _recipe_job("borrower", pool)
        borrower["spec"]["elastic"]["minWorkers"] = 3
        borrower["spec"]["checkpoint"] = {"claimName": "parked", "path": "/checkpoints",
                                          "intervalSteps": 100000}
        apply(kubectl, namespace, tmp_path, borrower)
        wait("the borrower on 4 workers", on("borrower", 4), timeout=240)
        wait("a few steps trained", lambda: get(custom, namespace, "borrower")["status"].get(
            "step", 0) >= 3, timeout=120)

        apply(kubectl, namespace, tmp_path, _recipe_job("owner", pool))
        st = wait("the borrower parked at a checkpoint", lambda: (
            lambda s: s if s.get("suspension") else None)(
            get(custom, namespace, "borrower").get("status", {})), timeout=180)
        held = st["suspension"]
        cond = condition(custom, namespace, "borrower", "Suspended")
        assert (cond["status"], cond["reason"]) == ("True", "BelowMinimum"), cond
        assert "minWorkers=3" in cond["message"], cond
        assert held["checkpoint"].startswith(str(runner.claim_dir(namespace, "parked"))), held
        notices = [e.message for e in events(core, namespace, "borrower")
                   if e.reason == "Preemption"]
        assert any("Kueue" in m for m in notices), notices
        wait("team b's job on its 2 workers", on("owner", 2), timeout=240)
        assert get(custom, namespace, "borrower")["status"]["phase"] == "Pending"

        kubectl("delete", "dynatrainjob", "owner", "-n", namespace, "--wait=false")
        st = wait("the borrower back on 4 workers", on("borrower", 4), timeout=300)
        assert "suspension" not in st, st
        assert f"started from checkpoint {held['checkpoint']} at step {held['step']}" \
            in op.logs(), op.logs()[-3000:]
        reasons = [e.reason for e in events(core, namespace, "borrower")]
        assert "Resumed" in reasons and "Failed" not in reasons, reasons
        data = wait("the data audit past the resume", audited_past(
            custom, namespace, "borrower", held["step"]), timeout=120)
        assert data["exactlyOnce"] and data["retrainedSteps"] == 0, data
    finally:
        remove_jobs(kubectl, core, namespace, ("borrower", "owner"), nodes)
        kubectl("delete", "-f", str(queues), "--wait=false", check=False)

"""Several jobs on one pool (#35): they share it by the documented rule (controller/share.py),
nobody waits for ever, and a job that arrives takes its minimum back from jobs above their
share by a live shrink (reason ``rebalance``), never a restart.

The pool is three simulated nodes of this test's own (tainted, labelled), two GPUs each, so
6 GPUs; every job is elastic between 2 and 4 workers of one GPU. The real kube-scheduler
places the pods; the operator only reads where they run and which ones wait.
"""

from __future__ import annotations

import time
from functools import partial

import pytest
from kubernetes import client

from dynatrain.devcluster.nodes import add_nodes
from harness.operator_process import (apply, audited_past, claim, condition, events, get, job,
                                     job_pods, on_pool, remove_jobs, running_on, pool_node,
                                     wait)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


def _pool(index: int, pool: str):
    return pool_node("share", index, pool)


@pytest.fixture
def priorities(devcluster, namespace):
    """Two PriorityClasses of this test's own, (low, high), deleted after it."""
    sched = client.SchedulingV1Api(devcluster.api_client())
    names = (f"{namespace}-low", f"{namespace}-high")
    for cls, value in zip(names, (100, 100000)):
        sched.create_priority_class(client.V1PriorityClass(
            metadata=client.V1ObjectMeta(name=cls), value=value))
    yield names
    for cls in names:
        sched.delete_priority_class(cls)


def _elastic(name: str, pool: str) -> dict:
    doc = job(name, gpus=1, max_workers=4)
    doc["spec"]["elastic"]["minWorkers"] = 2
    return on_pool(doc, pool)


@pytest.mark.timeout(600)        # several jobs to start and switch on a small machine
def test_equal_jobs_share_the_pool_and_a_third_takes_its_minimum_by_live_shrinks(
        devcluster, kubectl, namespace, operator, tmp_path):
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    pool = namespace
    nodes = []
    names = ("first", "second", "third")
    try:
        for i in range(3):
            nodes += add_nodes(core, _pool(i, pool))
        for name in names[:2]:
            apply(kubectl, namespace, tmp_path, _elastic(name, pool))

        def settled(share: dict):
            def check():
                sts = {n: get(custom, namespace, n).get("status", {}) for n in share}
                ok = all(st.get("phase") == "Running" and st.get("workers") == share[n]
                         for n, st in sts.items())
                return sts if ok else None
            return check
        # Two equal jobs on 6 GPUs: both run, 3 each (whoever the scheduler placed first).
        sts = wait("both jobs on 3 workers each", settled({"first": 3, "second": 3}),
                   timeout=300)
        # On the way there a job may have shrunk and grown again (a share computed while the
        # other job's pods were still being placed): its leaver's pod, which exited as the
        # shrink ended, is deleted as the operator sees it, which can come after the status.
        def placed(name: str) -> list:
            return [p for p in job_pods(core, namespace, name)
                    if p.spec.node_name and p.metadata.deletion_timestamp is None]
        try:
            wait("3 placed worker pods per job, any leaver's pod deleted",
                 lambda: all(len(placed(n)) == 3 for n in names[:2]), timeout=60)
        except AssertionError as e:
            pods = [(p.metadata.name, p.spec.node_name, p.status.phase)
                    for n in names[:2] for p in placed(n)]
            raise AssertionError(f"{e}: {pods}") from None
        for name in names[:2]:
            cond = condition(custom, namespace, name, "Share")
            assert cond is not None and "of the 6 GPUs its pool's 2 jobs hold" in \
                cond["message"], cond
        # A job that got 4 first gave one back live; the other grew into it.
        for name, st in sts.items():
            if st.get("lastSwitch"):
                assert st["lastSwitch"]["reason"] in ("rebalance", "scale-up"), st
                assert st["lastSwitch"]["result"] == "success", st

        # A third job arrives: the first two shrink live to their minimum to let it start.
        apply(kubectl, namespace, tmp_path, _elastic("third", pool))
        sts = wait("2 workers each for three jobs", settled(
            {"first": 2, "second": 2, "third": 2}), timeout=300)
        for name in names[:2]:
            last = sts[name]["lastSwitch"]
            assert (last["reason"], last["result"]) == ("rebalance", "success"), last
            assert last["from"] != last["to"] and last["pauseSeconds"] > 0, last
            reasons = [e.reason for e in events(core, namespace, name)]
            assert "OverShare" in reasons, reasons
            # Its leaver's pod ends as the shrink ends: it left, it is not replaced.
            assert not {"WorkerLost", "Recovered", "WorkerReplaced"} & set(reasons), reasons
        assert sum(1 for n in names for p in job_pods(core, namespace, n)
                   if p.spec.node_name and p.metadata.deletion_timestamp is None) == 6

        # Live, not restarted: the shrunk jobs read their data exactly once past the shrink.
        for name in names[:2]:
            data = wait(f"{name}'s data audit past the shrink", audited_past(
                custom, namespace, name, sts[name]["lastSwitch"]["step"]), timeout=120)
            assert data["exactlyOnce"] and data["retrainedSteps"] == 0, data

        # The third ends: the others grow back into its GPUs.
        kubectl("delete", "dynatrainjob", "third", "-n", namespace, "--wait=false")
        wait("the first two back on 3 workers each", settled({"first": 3, "second": 3}),
             timeout=300)
    finally:
        remove_jobs(kubectl, core, namespace, names, nodes)


@pytest.mark.timeout(600)        # several jobs to start and switch on a small machine
def test_a_high_priority_job_makes_a_low_one_shrink_live_and_grow_back_when_it_ends(
        devcluster, kubectl, namespace, operator, tmp_path, priorities):
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    on = partial(running_on, custom, namespace)
    pool = namespace
    low_cls, high_cls = priorities
    nodes = []
    try:
        for i in range(2):                                 # 4 GPUs
            nodes += add_nodes(core, _pool(10 + i, pool))
        low = _elastic("low", pool)
        low["spec"]["template"]["spec"]["priorityClassName"] = low_cls
        apply(kubectl, namespace, tmp_path, low)

        wait("the low-priority job on all 4 GPUs", on("low", 4), timeout=240)

        high = _elastic("high", pool)
        high["spec"]["elastic"]["maxWorkers"] = 2
        high["spec"]["template"]["spec"]["priorityClassName"] = high_cls
        apply(kubectl, namespace, tmp_path, high)
        wait("the high-priority job on 2 workers", on("high", 2), timeout=240)
        st = wait("the low-priority job shrunk live to 2", on("low", 2), timeout=120)
        shrink = st["lastSwitch"]
        # The scheduler's preemption (a notice) or the share (the high job waits) came first:
        # either way a live switch, not a failure.
        assert shrink["reason"] in ("preemption", "rebalance") and \
            shrink["result"] == "success", shrink
        reasons = [e.reason for e in events(core, namespace, "low")]
        assert "WorkerLost" not in reasons and "Recovered" not in reasons, reasons

        kubectl("delete", "dynatrainjob", "high", "-n", namespace, "--wait=false")
        st = wait("the low-priority job grown back to 4", on("low", 4), timeout=240)
        assert st["lastSwitch"]["reason"] == "scale-up", st["lastSwitch"]

        data = wait("the data audit past the regrowth", audited_past(
            custom, namespace, "low", st["lastSwitch"]["step"]), timeout=120)
        assert data["exactlyOnce"] and data["retrainedSteps"] == 0, data
    finally:
        remove_jobs(kubectl, core, namespace, ("low", "high"), nodes)


@pytest.mark.timeout(600)        # two jobs to start, a park and a resume on a small machine
def test_a_low_priority_job_pushed_under_its_minimum_waits_at_a_checkpoint_and_resumes(
        devcluster, kubectl, namespace, operator, tmp_path, priorities):
    """The scheduler preempts two of a low-priority job's four workers for a high-priority
    job, which leaves it under its minimum of 3: it writes a checkpoint with every worker
    (those preempted still run in their grace period), holds no GPUs while it cannot train,
    and, when the high-priority job ends, continues from that checkpoint: no step lost, none
    trained twice."""
    op, runner = operator
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    on = partial(running_on, custom, namespace)
    pool = namespace
    low_cls, high_cls = priorities
    claim(core, namespace, "parked")
    nodes = []
    try:
        for i in range(2):                                 # 4 GPUs
            nodes += add_nodes(core, _pool(20 + i, pool))
        low = _elastic("low", pool)
        low["spec"]["elastic"]["minWorkers"] = 3
        # Periodic checkpoints far apart: the one the job continues from is its park's.
        low["spec"]["checkpoint"] = {"claimName": "parked", "path": "/checkpoints",
                                     "intervalSteps": 100000}
        low["spec"]["template"]["spec"]["priorityClassName"] = low_cls
        apply(kubectl, namespace, tmp_path, low)
        st = wait("the low-priority job on all 4 GPUs", on("low", 4), timeout=240)
        wait("a few steps trained", lambda: get(custom, namespace, "low")["status"].get(
            "step", 0) >= 3, timeout=120)

        high = _elastic("high", pool)
        high["spec"]["elastic"]["maxWorkers"] = 2
        high["spec"]["template"]["spec"]["priorityClassName"] = high_cls
        apply(kubectl, namespace, tmp_path, high)

        def parked():
            st = get(custom, namespace, "low").get("status", {})
            return st if st.get("suspension") else None
        st = wait("the low-priority job parked at a checkpoint", parked, timeout=180)
        held = st["suspension"]
        cond = condition(custom, namespace, "low", "Suspended")
        assert cond["status"] == "True" and cond["reason"] == "BelowMinimum", cond
        assert "minWorkers=3" in cond["message"] and f"step {held['step']}" in \
            cond["message"], cond
        assert st["phase"] == "Pending", st
        assert held["checkpoint"].startswith(str(runner.claim_dir(namespace, "parked"))), held
        wait("the high-priority job on 2 workers", on("high", 2), timeout=240)
        # While it cannot reach its minimum it holds no GPU: only the high job's pods run.
        def low_placed():
            return [p.metadata.name for p in job_pods(core, namespace, "low")
                    if p.spec.node_name and p.metadata.deletion_timestamp is None
                    and p.status.phase == "Running"]
        wait("the low job holding no GPU", lambda: not low_placed(), timeout=120)
        time.sleep(5)
        assert not low_placed() and get(custom, namespace, "low")["status"]["step"] == \
            held["step"]
        reasons = [e.reason for e in events(core, namespace, "low")]
        assert "BelowMinimum" in reasons and "Failed" not in reasons, reasons

        kubectl("delete", "dynatrainjob", "high", "-n", namespace, "--wait=false")
        st = wait("the low-priority job back on 4 workers", on("low", 4), timeout=300)
        assert "suspension" not in st, st
        assert f"started from checkpoint {held['checkpoint']} at step {held['step']}" \
            in op.logs(), op.logs()[-3000:]
        cond = condition(custom, namespace, "low", "Suspended")
        assert cond["status"] == "False" and cond["reason"] == "Resumed", cond
        assert "Resumed" in [e.reason for e in events(core, namespace, "low")]
        # Nothing trained twice, nothing skipped: the audit runs on from the checkpoint.
        data = wait("the data audit past the resume", audited_past(
            custom, namespace, "low", held["step"]), timeout=120)
        assert data["exactlyOnce"] and data["retrainedSteps"] == 0, data
    finally:
        remove_jobs(kubectl, core, namespace, ("low", "high"), nodes)

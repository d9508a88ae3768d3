"""A straggler on a cluster (#38 item 3): one worker pod computes 2.5x slower
(``DYNATRAIN_SLOWDOWN`` through ``spec.template``, which every worker pod gets and only
device 3 acts on). With ``spec.parallelism.rebalance`` on, the controller leaves it out, live
(``dp=4 -> dp=3``, reason ``rebalance``), the operator deletes its pod, and the pod made in
its place (a new device, as the scheduler would place it elsewhere) joins: the job is back on
4 workers without device 3 (controller/straggler.py; tests/controller/test_straggler.py for
the rule by hand)."""

from __future__ import annotations

import pytest
from kubernetes import client

from dynatrain.operator.cluster import pod_name
from harness.operator_process import (apply, audited_past, get, job, job_pods, remove_jobs,
                                     running_on, wait)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_a_slow_worker_is_left_out_live_and_its_pod_replaced(devcluster, kubectl, namespace,
                                                              operator, tmp_path):
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    name = "straggler"
    doc = job(name, gpus=1, max_workers=4)
    # Shares off: with them, the noise of 4 workers on 2 cores beside the control plane may
    # make dealing the micro-batches faster than leaving the device out (it did: 3+3+5+1,
    # the peers measured 423-655 ms per micro-batch); the left-out path is what this checks.
    doc["spec"]["parallelism"] = {"mode": "auto", "limits": {"maxTP": 1, "maxPP": 1},
                                  "rebalance": {"enabled": True, "shares": False}}
    doc["spec"]["template"] = {"spec": {"containers": [{"name": "worker", "env": [
        {"name": "DYNATRAIN_SLOWDOWN", "value": "device:3,factor:2.5"}]}]}}
    # A step of 4 workers on this machine's 2 cores beside the control plane takes seconds;
    # the slow worker's must not pass for a hang (the watchdog's default is 8 s).
    doc["spec"]["recovery"] = {"timeouts": {"watchdogSeconds": 40, "collectiveSeconds": 60}}
    try:
        apply(kubectl, namespace, tmp_path, doc)
        wait("the job on 4 workers", running_on(custom, namespace, name, 4), timeout=240)

        def left_out():
            st = get(custom, namespace, name).get("status", {})
            last = st.get("lastSwitch") or {}
            return last if last.get("reason") == "rebalance" else None
        last = wait("device 3 left out", left_out, timeout=180)
        assert (last["from"], last["to"], last["result"]) == \
            ("dp=4,tp=1,pp=1", "dp=3,tp=1,pp=1", "success"), last
        logs = operator[0].logs()
        assert "device 3 computes" in logs and ": left out;" in logs, logs[-3000:]
        assert "was unhealthy" not in logs, logs[-3000:]     # its exit was the plan
        # Its pod is deleted, and one made in its place joins: back on 4 workers.
        wait("the slow worker's pod to go", lambda: not any(
            p.metadata.name == pod_name(name, 3) and p.metadata.deletion_timestamp is None
            for p in job_pods(core, namespace, name)), timeout=120)
        st = wait("the job back on 4 workers", running_on(custom, namespace, name, 4),
                  timeout=240)
        assert st["lastSwitch"]["reason"] == "scale-up", st["lastSwitch"]
        data = wait("the data audit past the switches", audited_past(
            custom, namespace, name, st["lastSwitch"]["step"]), timeout=120)
        assert data["exactlyOnce"], data
    finally:
        remove_jobs(kubectl, core, namespace, [name])

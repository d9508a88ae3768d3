"""Giving GPUs back on a cluster (#38 item 5): ``spec.elastic.minEfficiency`` set on a running job
releases the workers that do not pay off, live, and deletes their pods so the cluster can use
the GPUs; taken off again, the job takes them back. The count is the policy's, from the cost
model for the GPU the nodes' labels name (the dev cluster's p5 nodes: H100), where gpt-tiny's
second worker adds 8% of a worker's throughput (controller/policy.py, tests/controller/
test_efficiency.py for the count by hand)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kubernetes import client

from dynatrain.controller.policy import Policy
from dynatrain.spec.hardware import PROFILES
from dynatrain.spec.job import job_from_manifest
from harness.operator_process import (apply, audited_past, events, get, job, job_pods,
                                     remove_jobs, running_on, wait)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


def test_min_efficiency_releases_workers_live_and_deletes_their_pods_and_takes_them_back(
        devcluster, kubectl, namespace, operator, tmp_path):
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    name = "thrifty"
    doc = job(name, gpus=1, max_workers=4)
    keep = Policy().efficient_workers(
        replace(job_from_manifest({**doc, "metadata": {"name": name, "namespace": namespace}}),
                min_efficiency=0.5), PROFILES["h100"], 4)
    assert 1 <= keep < 4, keep           # else this job shows nothing: pick another threshold
    try:
        apply(kubectl, namespace, tmp_path, doc)
        wait("the job on 4 workers", running_on(custom, namespace, name, 4), timeout=240)
        assert get(custom, namespace, name)["status"]["hardware"] == "h100"

        kubectl("patch", "dynatrainjob", name, "-n", namespace, "--type=merge", "-p",
                '{"spec": {"elastic": {"minEfficiency": 0.5}}}')
        st = wait(f"the job released to {keep} workers", running_on(
            custom, namespace, name, keep), timeout=120)
        last = st["lastSwitch"]
        assert (last["reason"], last["result"]) == ("release", "success"), last
        # The released workers' pods are deleted (the GPUs go back to the cluster), and no
        # pod is made for them again while the setting holds.
        wait("the released pods to go", lambda: len(
            [p for p in job_pods(core, namespace, name)
             if p.metadata.deletion_timestamp is None]) == keep, timeout=90)
        reasons = [e.reason for e in events(core, namespace, name)]
        assert "WorkerLost" not in reasons and "Recovered" not in reasons, reasons
        logs = operator[0].logs()
        assert f"keeps {keep} of up to 4 workers at spec.elastic.minEfficiency=0.5" in logs
        data = wait("the data audit past the release", audited_past(
            custom, namespace, name, last["step"]), timeout=120)
        assert data["exactlyOnce"] and data["retrainedSteps"] == 0, data

        kubectl("patch", "dynatrainjob", name, "-n", namespace, "--type=json", "-p",
                '[{"op": "remove", "path": "/spec/elastic/minEfficiency"}]')
        st = wait("the job back on 4 workers", running_on(custom, namespace, name, 4),
                  timeout=240)
        assert st["lastSwitch"]["reason"] == "scale-up", st["lastSwitch"]
    finally:
        remove_jobs(kubectl, core, namespace, [name])

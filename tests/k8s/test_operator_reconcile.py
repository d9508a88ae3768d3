"""The operator never gives up on a job: bad specs, edits, unhealthy pods, quotas, re-creation.

Against the real control plane (the dev cluster's kube-apiserver, controller-manager and
scheduler; kwok nodes), with `dynatrain operator` as a separate process and the job's worker
pods run as local processes by the pod runner. What the CRD refuses at admission is tested in
test_crd_validation.py, and the edits it refuses in test_crd_updates.py; these are the cases
only the operator can judge, each answered by a named status condition within seconds, and
what it does about them.
"""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from harness.operator_process import apply, condition, events, get, job, job_pods, wait

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
GROUP, VERSION, PLURAL = "dynatrain.io", "v1alpha1", "dynatrainjobs"


def _false(custom, namespace, name, kind):
    c = condition(custom, namespace, name, kind)
    return c if c and c["status"] == "False" else None


def test_an_unfit_spec_is_named_and_a_fixed_one_runs_without_a_restart(
        devcluster, kubectl, namespace, operator, tmp_path):
    op, _ = operator
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    # tp=3 passes admission (3 workers <= maxWorkers) but does not divide gpt-tiny's 8 heads:
    # only the parser knows the model, so the operator names it in a condition.
    doc = job("fixme", gpus=1, max_workers=4)
    doc["spec"]["parallelism"] = {"mode": "fixed", "layout": "tp=3"}
    apply(kubectl, namespace, tmp_path, doc)
    started = time.monotonic()
    cond = wait("the SpecValid condition", lambda: _false(custom, namespace, "fixme",
                                                          "SpecValid"), timeout=30)
    assert time.monotonic() - started < 30
    assert cond["reason"] == "InvalidSpec" and "spec.parallelism.layout" in cond["message"]
    assert "nothing runs until the spec is fixed" in cond["message"]
    assert not job_pods(core, namespace, "fixme")
    assert "InvalidSpec" in [e.reason for e in events(core, namespace, "fixme")]

    # Fixed: the same operator process picks it up.
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fixme", {
        "spec": {"parallelism": {"mode": "fixed", "layout": "dp=2,tp=1,pp=1"}}})

    def running(layout):
        def check():
            st = get(custom, namespace, "fixme").get("status", {})
            return st if st.get("phase") == "Running" and st.get("layout") == layout else None
        return check

    st = wait("the fixed job to run", running("dp=2,tp=1,pp=1"), timeout=150)
    assert condition(custom, namespace, "fixme", "SpecValid")["status"] == "True"
    assert st["observedGeneration"] == get(custom, namespace, "fixme")["metadata"]["generation"]

    # A bad edit of a running job: refused by name, the job trains on under its last spec.
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fixme", {
        "spec": {"parallelism": {"layout": "tp=3"}}})
    cond = wait("the refused edit's condition", lambda: _false(custom, namespace, "fixme",
                                                               "SpecValid"), timeout=30)
    assert "runs on under its last valid spec" in cond["message"]
    step = get(custom, namespace, "fixme")["status"]["step"]
    wait("training to go on", lambda: get(custom, namespace, "fixme")["status"].get(
        "step", 0) > step, timeout=60)
    assert get(custom, namespace, "fixme")["status"]["layout"] == "dp=2,tp=1,pp=1"

    # Fixed again: applied (a requested layout: a live switch).
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fixme", {
        "spec": {"parallelism": {"layout": "dp=1,tp=2,pp=1"}}})
    wait("the requested layout", running("dp=1,tp=2,pp=1"), timeout=120)
    assert condition(custom, namespace, "fixme", "SpecValid")["status"] == "True"
    # ... and the request is answered, in a condition and an Event.
    req = wait("the LayoutRequest condition", lambda: (
        lambda c: c if c and c["reason"] == "Applied" else None)(
        condition(custom, namespace, "fixme", "LayoutRequest")), timeout=30)
    assert req["status"] == "True" and "dp=1,tp=2,pp=1: applied at step" in req["message"]
    assert "LayoutRequestApplied" in [e.reason for e in events(core, namespace, "fixme")]

    # Suspending a job with no checkpoint claim would lose its training: refused by a
    # condition that says why, and the job trains on with its pods.
    before = {p.metadata.name for p in job_pods(core, namespace, "fixme")}
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "fixme", {
        "spec": {"suspend": True}})
    cond = wait("the Suspended condition", lambda: _false(custom, namespace, "fixme",
                                                          "Suspended"), timeout=30)
    assert cond["reason"] == "NoCheckpointClaim" and "spec.checkpoint" in cond["message"]
    step = get(custom, namespace, "fixme")["status"]["step"]
    wait("training to go on", lambda: get(custom, namespace, "fixme")["status"].get(
        "step", 0) > step + 1, timeout=60)
    assert get(custom, namespace, "fixme")["status"]["phase"] == "Running"
    after = job_pods(core, namespace, "fixme")
    assert before <= {p.metadata.name for p in after} and before
    assert not any(p.metadata.deletion_timestamp for p in after)
    assert op.starts == 1 and op.proc.poll() is None
    kubectl("delete", "dynatrainjob", "fixme", "-n", namespace, "--wait=false")


def test_more_gpus_than_any_node_has_waits_with_the_schedulers_reason(
        devcluster, kubectl, namespace, operator, tmp_path):
    # The operator does not count allocatable: it creates the pods (the job's demand, which
    # an autoscaler could meet) and says why they wait, in the scheduler's own words.
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    apply(kubectl, namespace, tmp_path, job("huge", gpus=16, max_workers=2))
    cond = wait("the Schedulable condition", lambda: _false(custom, namespace, "huge",
                                                            "Schedulable"), timeout=60)
    assert cond["reason"] == "Unschedulable", cond
    assert "2 of 2 worker pods wait for a node" in cond["message"], cond
    assert "Insufficient nvidia.com/gpu" in cond["message"], cond
    pods = job_pods(core, namespace, "huge")
    assert len(pods) == 2 and not any(p.spec.node_name for p in pods)
    assert "Unschedulable" in [e.reason for e in events(core, namespace, "huge")]
    assert get(custom, namespace, "huge")["status"]["phase"] == "Pending"
    kubectl("delete", "dynatrainjob", "huge", "-n", namespace, "--wait=false")


def test_a_crashing_worker_pod_is_replaced_with_back_off(devcluster, kubectl, namespace,
                                                         operator, tmp_path):
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    doc = job("crashy", gpus=1, max_workers=1)
    doc["spec"]["command"] = ["sh", "-c", "exit 3"]          # every worker crashes at start
    apply(kubectl, namespace, tmp_path, doc)
    cond = wait("a replacement", lambda: _false(custom, namespace, "crashy",
                                                "WorkersHealthy"), timeout=60)
    assert cond["reason"] == "WorkerReplaced", cond
    assert "exited with code 3" in cond["message"] or "pod Failed" in cond["message"], cond
    first = time.monotonic()
    st = wait("a second replacement", lambda: (lambda s: s if s.get("replacedWorkers", 0) >= 2
                                               else None)(
        get(custom, namespace, "crashy").get("status", {})), timeout=90)
    # back-off: the second replacement's pod was created no sooner than the first back-off
    assert time.monotonic() - first >= 5, "replaced without back-off"
    cond = condition(custom, namespace, "crashy", "WorkersHealthy")
    assert "(2 so far)" in cond["message"] or st["replacedWorkers"] > 2
    names = {p.metadata.name for p in job_pods(core, namespace, "crashy")
             if p.metadata.deletion_timestamp is None}
    assert len(names) <= 1, names                       # never more than maxWorkers at once
    assert "crashy-worker-0" not in names               # the first pod is gone, ids not reused
    assert "WorkerReplaced" in [e.reason for e in events(core, namespace, "crashy")]
    kubectl("delete", "dynatrainjob", "crashy", "-n", namespace, "--wait=false")


def test_a_quota_that_blocks_pods_is_a_condition_and_lifting_it_runs_the_job(
        devcluster, kubectl, namespace, operator, tmp_path):
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    core.create_namespaced_resource_quota(namespace, {
        "metadata": {"name": "no-gpus"}, "spec": {"hard": {"requests.nvidia.com/gpu": "0"}}})
    wait("the controller-manager to count the quota", lambda: (
        core.read_namespaced_resource_quota("no-gpus", namespace).status.hard or {}), timeout=30)
    apply(kubectl, namespace, tmp_path, job("quota", gpus=1, max_workers=2))
    cond = wait("the PodsCreated condition", lambda: _false(custom, namespace, "quota",
                                                            "PodsCreated"), timeout=30)
    assert cond["reason"] == "QuotaExceeded" and "quota" in cond["message"], cond
    assert "QuotaExceeded" in [e.reason for e in events(core, namespace, "quota")]
    core.delete_namespaced_resource_quota("no-gpus", namespace)
    wait("the job to run once the quota is gone", lambda: get(
        custom, namespace, "quota").get("status", {}).get("phase") == "Running", timeout=150)
    assert condition(custom, namespace, "quota", "PodsCreated")["status"] == "True"
    kubectl("delete", "dynatrainjob", "quota", "-n", namespace, "--wait=false")


def test_delete_and_recreate_with_the_same_name_starts_clean(devcluster, kubectl, namespace,
                                                             operator, tmp_path):
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    first = job("again", gpus=1, max_workers=1)
    apply(kubectl, namespace, tmp_path, first)
    wait("the first job to run", lambda: get(custom, namespace, "again").get(
        "status", {}).get("phase") == "Running", timeout=150)
    old_uid = get(custom, namespace, "again")["metadata"]["uid"]
    # Hold the first job's ConfigMap: the garbage collector can mark it deleted but not
    # remove it, so the second job deterministically meets its predecessor's object.
    hold = "dynatrain.test/hold"
    core.patch_namespaced_config_map("again-spec", namespace,
                                     {"metadata": {"finalizers": [hold]}})
    kubectl("delete", "dynatrainjob", "again", "-n", namespace, "--wait=true",
            "--timeout=60s")
    second = job("again", gpus=1, max_workers=1)
    second["spec"]["elastic"]["maxWorkers"] = 2
    apply(kubectl, namespace, tmp_path, second)
    new_uid = get(custom, namespace, "again")["metadata"]["uid"]
    assert new_uid != old_uid
    try:
        # Not adopted: the operator waits for the old ConfigMap to go (a condition says so).
        wait("the second job to report the old ConfigMap", lambda: (lambda c: c if c and
             c["status"] == "False" else None)(condition(custom, namespace, "again",
                                                         "Reconciled")), timeout=30)
        held = core.read_namespaced_config_map("again-spec", namespace)
        assert [r.uid for r in held.metadata.owner_references] == [old_uid]
    finally:
        core.patch_namespaced_config_map("again-spec", namespace,
                                         {"metadata": {"finalizers": None}})

    def clean():
        try:
            cm = core.read_namespaced_config_map("again-spec", namespace)
        except client.ApiException:
            return None
        owners = [r.uid for r in cm.metadata.owner_references or []]
        return cm if owners == [new_uid] else None

    cm = wait("the second job's own ConfigMap", clean, timeout=60)
    assert "maxWorkers: 2" in cm.data["job.yaml"]
    wait("the second job to run", lambda: get(custom, namespace, "again").get(
        "status", {}).get("phase") == "Running", timeout=150)
    time.sleep(5)                     # the collector has had its chance: nothing of ours goes
    for read, name in ((core.read_namespaced_config_map, "again-spec"),
                       (core.read_namespaced_secret, "again-agent-token"),
                       # the job's TLS Secrets (operator/pki.py): its own CAs, never the old's
                       (core.read_namespaced_secret, "again-agent-pki"),
                       (core.read_namespaced_secret, "again-agent-tls"),
                       (core.read_namespaced_service, "again-workers")):
        obj = read(name, namespace)
        assert [r.uid for r in obj.metadata.owner_references] == [new_uid], name
    pods = [p for p in job_pods(core, namespace, "again") if p.metadata.deletion_timestamp is None]
    assert pods and all(p.metadata.owner_references[0].uid == new_uid for p in pods)
    kubectl("delete", "dynatrainjob", "again", "-n", namespace, "--wait=false")


def test_a_finished_job_is_complete_for_kubectl_wait_and_deleted_after_its_ttl(
        devcluster, kubectl, namespace, operator, tmp_path):
    core, custom = devcluster.core(), client.CustomObjectsApi(devcluster.api_client())
    doc = job("brief", gpus=1, max_workers=2)
    doc["spec"]["training"]["steps"] = 6
    apply(kubectl, namespace, tmp_path, doc)
    running = wait("the Running condition", lambda: (
        lambda c: c if c and c["status"] == "True" else None)(
        condition(custom, namespace, "brief", "Running")), timeout=120)
    assert running["reason"] in ("Running", "Switching"), running
    # What a pipeline waits on, as it would for a batch Job.
    out = kubectl("wait", "--for=condition=Complete", "dynatrainjob/brief", "-n", namespace,
                  "--timeout=120s", check=False)
    assert out.returncode == 0, out.stderr
    st = get(custom, namespace, "brief")["status"]
    assert st["phase"] == "Succeeded" and st["step"] == 6, st
    assert st["startTime"] <= st["completionTime"], st
    assert condition(custom, namespace, "brief", "Running")["status"] == "False"
    assert condition(custom, namespace, "brief", "Running")["reason"] == "Succeeded"
    wait("its pods to be deleted", lambda: not job_pods(core, namespace, "brief"), timeout=60)
    # Kept until a TTL is set (it may be set after the end), then deleted once it passes.
    time.sleep(2)
    assert get(custom, namespace, "brief")["status"]["phase"] == "Succeeded"
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "brief",
                                          {"spec": {"ttlSecondsAfterFinished": 3}})

    def gone():
        try:
            get(custom, namespace, "brief")
        except client.exceptions.ApiException as e:
            return e.status == 404
        return False
    # 3 s of TTL, 1 s between the timer's looks, 1 s between kopf's checks that the timer
    # ended: well inside 20 s (kopf's default check, every 60 s, failed here half the time).
    wait("the job to be deleted after its TTL", gone, timeout=20)

"""Two operator replicas: exactly one acts, and the other adopts its job mid-switch.

As the chart deploys it: two `dynatrain operator` processes elect a leader on a Lease (with the
chart's RBAC). The leader is killed at a deterministic point of a requested switch, by the
controller's fault points (``DYNATRAIN_FAULT=device:-1,at:POINT``, vps/faults.py):

- ``prepared``: every worker prepared the new generation, no Commit was sent. The standby
  takes over, finds the uncommitted generation on the agents, aborts it, and switches again
  (the request is still in the spec);
- ``committed``: every worker holds the Commit, so the switch completes without the leader.
  The standby finds the committed generation and finishes it (or, as the switch takes
  milliseconds here, finds it done).

Either way the job ends on the requested layout, every live pod is a worker of it training
on the same generation, and no step was trained twice.
"""

from __future__ import annotations

import time

import pytest
import yaml
from kubernetes import client

from harness.operator_process import GROUP, PLURAL, ROOT, VERSION, Operator, get as _get, \
    job as _job, wait as _wait

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


@pytest.fixture
def replicas(devcluster, kubectl, namespace, tmp_path):
    """Two operator replicas (not started) and the pod runner."""
    from harness.pod_runner import job_pods

    kubectl("apply", "--server-side", "--force-conflicts", "-f",
            str(ROOT / "crds" / "dynatrainjob.yaml"))
    devcluster.wait_established("dynatrainjobs.dynatrain.io")
    ops = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        ops.append(Operator(devcluster, namespace, tmp_path / name))
    # The harness's settings (GPU workers on the CPU, worker pods forked): harness.pod_runner.
    pods = job_pods(devcluster.core(), tmp_path / "pods", namespace)
    with pods:
        try:
            yield ops, pods
        finally:
            for op in ops:
                op.stop()
            for op, name in zip(ops, "ab"):
                print(f"--- operator {name} ---\n" + op.logs()[-5000:])


@pytest.mark.parametrize("point", ["prepared", "committed"])
def test_the_standby_takes_over_and_adopts_a_switch_in_flight(devcluster, kubectl, namespace,
                                                               replicas, point, tmp_path):
    (a, b), pods = replicas
    core = devcluster.core()
    custom = client.CustomObjectsApi(devcluster.api_client())
    # The leader dies at the point in the second switch it makes (skip:1 passes the job's
    # start); the standby has no fault.
    a.env = {"DYNATRAIN_FAULT": f"device:-1,at:{point},skip:1"}
    a.start()
    _wait("replica a to lead", lambda: " leads " in a.logs(), timeout=60)
    b.start()
    _wait("replica b to stand by", lambda: "waiting for Lease" in b.logs(), timeout=60)

    name = "ha"
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(_job(name, gpus=1, max_workers=2)))
    kubectl("apply", "-n", namespace, "-f", str(manifest))
    st = _wait("the job to run on 2 workers", lambda: (lambda s: s if s.get("phase") == "Running"
                                                       and s.get("workers") == 2 else None)(
        _get(custom, namespace, name).get("status", {})), timeout=150)
    assert f"job {name}" not in b.logs()             # the standby has touched nothing
    generation = st["generation"]
    target = "dp=1,tp=1,pp=2" if st["layout"] != "dp=1,tp=1,pp=2" else "dp=2,tp=1,pp=1"
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {
        "spec": {"parallelism": {"mode": "fixed", "layout": target}}})

    assert a.proc.wait(120) == 17, a.logs()[-3000:]   # died at the fault point
    died = time.monotonic()
    _wait("replica b to take over", lambda: " leads " in b.logs(), timeout=30)
    print(f"takeover {time.monotonic() - died:.1f} s after the leader died")

    def settled():
        s = _get(custom, namespace, name).get("status", {})
        return s if s.get("phase") == "Running" and s.get("layout") == target else None

    st = _wait(f"the job to end on {target}", settled, timeout=150)
    assert st["generation"] > generation
    adopted = next(line for line in b.logs().splitlines() if f"job {name}: running" in line
                   or f"job {name}: no running" in line)
    if point == "prepared":      # found prepared, not committed: called off, then switched anew
        assert "aborted the uncommitted generation" in adopted, adopted
    else:                        # the switch went on without the leader: found in flight and
        # finished, or (it takes milliseconds on gpt-tiny) found done; never called off
        assert f"running generation {generation + 1}: {target}" in adopted \
            or f"finished the committed switch to generation {generation + 1}" in adopted, adopted

    # No orphan: every live pod is a worker of the running layout, all on its generation.
    from harness.operator_process import agent_client

    live = [p for p in core.list_namespaced_pod(
        namespace, label_selector=f"dynatrain.io/job={name}").items
        if p.metadata.deletion_timestamp is None]
    assert len(live) == st["workers"] == 2
    ranks = set()
    for p in live:
        with agent_client(core, namespace, name, p) as c:
            first = c.status()
            _wait(f"{p.metadata.name} to train on", lambda: c.status().step > first.step,
                  timeout=60)
            now = c.status()
        assert now.generation == st["generation"] and now.layout == target
        ranks.add(now.rank)
    assert ranks == {0, 1}
    data = _wait("the data audit past the switch", lambda: (lambda d: d if d.get(
        "auditedStep", 0) > st["step"] + 2 else None)(
        _get(custom, namespace, name)["status"].get("data", {})), timeout=90)
    assert data["exactlyOnce"] and data["retrainedSteps"] == 0, data
    kubectl("delete", "dynatrainjob", name, "-n", namespace, "--wait=false")

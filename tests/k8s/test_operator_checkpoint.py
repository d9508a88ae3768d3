"""Checkpoints on a volume: the last resort when no in-memory copy survives, and a new job's start.

The job's worker pods mount ``spec.checkpoint.claimName`` at ``spec.checkpoint.path`` and
write a PyTorch Distributed Checkpoint there every ``intervalSteps``. Killing a worker and its
buddy (the worker that mirrors its state) together leaves no copy of that state in memory:
the operator restarts the job from the newest checkpoint on the volume, under the layout that
fits the workers left, and trains on. A second job with ``spec.recovery.resumeFrom`` starts
from that checkpoint, named relative to the claim; a job whose resumeFrom lies outside its
claim is refused before any pod starts. Each job writes its steps in its own folder of the
claim (``<claim>/<job>/step-N``).

The claim is provisioned by the dev cluster's pod runner (a directory every pod mounting it
shares, as a ReadWriteMany volume would), bound by kube-controller-manager's binder.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from kubernetes import client

from dynatrain.trainer.checkpoint import latest_checkpoint

from harness.operator_process import (agent_client, claim as _claim, condition, events,
                                     get as _get, job as _job, job_pods, wait as _wait)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
INTERVAL = 6
"""Steps between checkpoints: the kill comes a few steps after one, before the next."""


def _checkpointed(name: str, claim: str, **over) -> dict:
    doc = _job(name, gpus=1, max_workers=4)
    # Four pipeline stages: each worker's state is unique, mirrored only by its buddy.
    doc["spec"]["parallelism"] = {"mode": "fixed", "layout": "dp=1,tp=1,pp=4"}
    doc["spec"]["checkpoint"] = {"claimName": claim, "path": "/checkpoints",
                                 "intervalSteps": INTERVAL}
    doc["spec"].update(over)
    return doc


def test_a_worker_and_its_buddy_lost_resume_from_the_volume_and_a_new_job_starts_there(
        devcluster, kubectl, namespace, operator, tmp_path):
    op, pods = operator
    core = devcluster.core()
    custom = client.CustomObjectsApi(devcluster.api_client())
    _claim(core, namespace, "ckpt")
    name = "ckpt"
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(_checkpointed(name, "ckpt")))
    kubectl("apply", "-n", namespace, "-f", str(manifest))
    st = _wait("the job to run on 4 pipeline stages", lambda: (
        lambda s: s if s.get("phase") == "Running" and s.get("layout") == "dp=1,tp=1,pp=4"
        else None)(_get(custom, namespace, name).get("status", {})), timeout=180)

    pods_by_device = {int(p.metadata.labels["dynatrain.io/device"]): p
                      for p in core.list_namespaced_pod(
                          namespace, label_selector=f"dynatrain.io/job={name}").items}
    # One client (one mutual-TLS connection) per worker, kept open as the operator keeps its
    # own: a handshake per poll would add hundreds of them to a loaded two-core machine.
    clients = {}

    def status(device):
        if device not in clients:
            clients[device] = agent_client(core, namespace, name, pods_by_device[device],
                                           timeout_s=20.0)
        return clients[device].status()

    # A checkpoint on the volume first, a couple of steps more (trained again after the
    # restore), then the victim and its buddy.
    victim = min(pods_by_device)
    buddy = next(d for d in pods_by_device if status(d).mirror_of == victim)
    first = _wait("a checkpoint on the volume", lambda: (lambda s: s if s.checkpoint else None)(
        status(victim)), timeout=120)
    claim_dir = pods.claim_dir(namespace, "ckpt")
    # In the job's own folder of the claim, so another job on it never prunes these steps.
    assert first.checkpoint.startswith(f"{claim_dir}/{name}/step-"), (first.checkpoint,
                                                                       claim_dir)
    _wait("two steps past it", lambda: status(victim).step >= first.checkpoint_step + 2,
          timeout=60, interval=0.05)
    for d in (victim, buddy):
        pods.process(namespace, pods_by_device[d].metadata.name).kill()

    def recovered():
        s = _get(custom, namespace, name).get("status", {})
        last = s.get("lastSwitch", {})
        return s if last.get("reason") == "failure" and last.get("result") == "success" \
            else None

    st = _wait("a recovery from the checkpoint", recovered, timeout=150)
    assert "from checkpoint" in op.logs(), op.logs()[-3000:]
    _wait("training to go on", lambda: _get(custom, namespace, name)["status"].get("step", 0)
          > st["lastSwitch"]["step"] + 3, timeout=90)
    data = _wait("the data audit past the recovery", lambda: (lambda d: d if d.get(
        "auditedStep", 0) > st["lastSwitch"]["step"] + 2 else None)(
        _get(custom, namespace, name)["status"].get("data", {})), timeout=90)
    # Steps after the checkpoint were trained again (the honest cost of the last resort),
    # and every step's batch was still read exactly once in the end.
    assert data["retrainedSteps"] > 0 and data["exactlyOnce"], data
    survivor = next(d for d in pods_by_device if d not in (victim, buddy))
    _wait("a newer checkpoint", lambda: status(survivor).checkpoint_step
          > first.checkpoint_step, timeout=120)
    kubectl("delete", "dynatrainjob", name, "-n", namespace, "--wait=false")
    # The newest checkpoint once the job's workers are gone: until then they train on and
    # prune older steps (a CI run resumed from one a worker was deleting).
    _wait("the first job's workers gone", lambda: not job_pods(core, namespace, name),
          timeout=120)
    path, step = latest_checkpoint(claim_dir, job=name)
    assert step > first.checkpoint_step
    newest = SimpleNamespace(checkpoint=path, checkpoint_step=step)

    # A job whose resumeFrom is outside its claim is refused at once, naming both.
    stray = _checkpointed("stray", "ckpt")
    stray["spec"]["recovery"] = {"resumeFrom": "/etc/step-00000001"}
    manifest.write_text(yaml.safe_dump(stray))
    kubectl("apply", "-n", namespace, "-f", str(manifest))
    cond = _wait("the stray job refused", lambda: next(
        (c for c in _get(custom, namespace, "stray").get("status", {}).get("conditions", [])
         if c["type"] == "SpecValid" and c["status"] == "False"), None), timeout=60)
    assert "spec.recovery.resumeFrom='/etc/step-00000001' is outside " \
        "spec.checkpoint.path='/checkpoints'" in cond["message"], cond
    assert not core.list_namespaced_pod(namespace, label_selector="dynatrain.io/job=stray").items
    kubectl("delete", "dynatrainjob", "stray", "-n", namespace, "--wait=false")

    # A new job from that checkpoint: its first generation starts at the checkpoint's step.
    # Named relative to the claim (spec.checkpoint.path): each worker resolves it against its
    # own mount, so the same manifest works wherever the claim is mounted.
    resumed = "resumed"
    doc = _checkpointed(resumed, "ckpt")
    relative = str(Path(newest.checkpoint).relative_to(claim_dir))
    assert relative == f"{name}/step-{newest.checkpoint_step:08d}"
    doc["spec"]["recovery"] = {"resumeFrom": relative}
    doc["spec"]["parallelism"] = {"mode": "auto"}
    manifest.write_text(yaml.safe_dump(doc))
    kubectl("apply", "-n", namespace, "-f", str(manifest))
    st = _wait("the resumed job to train past the checkpoint", lambda: (
        lambda s: s if s.get("phase") == "Running" and s.get("step", 0)
        > newest.checkpoint_step else None)(
        _get(custom, namespace, resumed).get("status", {})), timeout=180)
    assert f"started from checkpoint {relative} at step {newest.checkpoint_step}" \
        in op.logs()
    data = _wait("the resumed job's audit", lambda: (lambda d: d if d.get("auditedStep", 0)
                                                      > newest.checkpoint_step + 2 else None)(
        _get(custom, namespace, resumed)["status"].get("data", {})), timeout=90)
    assert data["auditedFrom"] == newest.checkpoint_step + 1 and data["exactlyOnce"], data
    kubectl("delete", "dynatrainjob", resumed, "-n", namespace, "--wait=false")


def test_suspend_checkpoints_at_an_agreed_step_removes_the_pods_and_resume_continues_there(
        devcluster, kubectl, namespace, operator, tmp_path):
    op, pods = operator
    core = devcluster.core()
    custom = client.CustomObjectsApi(devcluster.api_client())
    _claim(core, namespace, "held")
    name = "held"
    # Periodic checkpoints far apart: the suspend's own checkpoint is the one resumed from.
    doc = _checkpointed(name, "held", parallelism={"mode": "auto"},
                        elastic={"minWorkers": 1, "maxWorkers": 2})
    doc["spec"]["checkpoint"]["intervalSteps"] = 100000
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    kubectl("apply", "-n", namespace, "-f", str(manifest))
    _wait("the job to train on 2 workers", lambda: (
        lambda s: s if s.get("phase") == "Running" and s.get("workers") == 2
        and s.get("step", 0) >= 3 else None)(_get(custom, namespace, name).get("status", {})),
        timeout=180)

    kubectl("patch", "dynatrainjob", name, "-n", namespace, "--type=merge",
            "-p", '{"spec":{"suspend":true}}')
    st = _wait("the job suspended", lambda: (
        lambda s: s if s.get("phase") == "Suspended" and s.get("suspension") else None)(
        _get(custom, namespace, name).get("status", {})), timeout=120)
    held = st["suspension"]
    cond = condition(custom, namespace, name, "Suspended")
    assert cond["status"] == "True" and f"step {held['step']}" in cond["message"], cond
    assert condition(custom, namespace, name, "Running")["status"] == "False"
    # Every worker wrote its part of one checkpoint, in the job's folder of the claim.
    written = Path(held["checkpoint"])
    assert written.parent == Path(pods.claim_dir(namespace, "held")) / name
    assert (written / ".metadata").exists() and held["step"] >= 3
    _wait("the worker pods removed", lambda: not job_pods(core, namespace, name), timeout=90)
    time.sleep(2)                                 # suspended: nothing trains, nothing comes
    st = _get(custom, namespace, name)["status"]
    assert not job_pods(core, namespace, name) and st["step"] == held["step"], st
    assert "Suspended" in [e.reason for e in events(core, namespace, name)]
    # An operator that starts while the job is suspended (a restart, a new leader) reads
    # where to continue from in the status, and creates no pods meanwhile.
    op.kill()
    op.start()
    _wait("the new operator to lead", lambda: op.logs().count("leads (Lease") >= 2,
          timeout=60)
    time.sleep(3)
    assert not job_pods(core, namespace, name)
    assert _get(custom, namespace, name)["status"]["phase"] == "Suspended"

    kubectl("patch", "dynatrainjob", name, "-n", namespace, "--type=merge",
            "-p", '{"spec":{"suspend":false}}')
    st = _wait("the job resumed past the checkpoint", lambda: (
        lambda s: s if s.get("phase") == "Running" and s.get("step", 0) > held["step"] + 2
        else None)(_get(custom, namespace, name).get("status", {})), timeout=180)
    assert f"started from checkpoint {held['checkpoint']} at step {held['step']}" \
        in op.logs(), op.logs()[-3000:]
    assert "suspension" not in st                 # started from it: cleared
    cond = condition(custom, namespace, name, "Suspended")
    assert cond["status"] == "False" and cond["reason"] == "Resumed", cond
    # Nothing trained twice, nothing skipped (this operator audits from the checkpoint on:
    # the reads before it were recorded by the one it replaced).
    data = _wait("the audit past the resume", lambda: (lambda d: d if d.get(
        "auditedStep", 0) > held["step"] + 2 else None)(
        _get(custom, namespace, name)["status"].get("data", {})), timeout=90)
    assert data["auditedFrom"] == held["step"] + 1 and data["exactlyOnce"], data
    assert data["retrainedSteps"] == 0, data
    assert op.starts == 2 and op.proc.poll() is None
    kubectl("delete", "dynatrainjob", name, "-n", namespace, "--wait=false")

"""The operator's worker pods (operator/pods.py) without a cluster: what an ended worker pod
means depends on the switch in flight. A member that a shrink takes out exits as its part ends,
and the operator may see its pod end before the switch's record: that worker left, and is not
replaced. A CI run saw the opposite: a job that shrank for another one had its leaver's pod
"replaced" (a WorkerReplaced warning and the replacement back-off) mid-switch."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import yaml

from dynatrain.controller import inbox as ev
from dynatrain.controller import jobstate as js
from dynatrain.controller.core import JobController
from dynatrain.operator.basics import JobContext, Settings
from dynatrain.operator.cluster import WorkerPod
from dynatrain.operator.pods import WorkerPods
from dynatrain.operator.status import Conditions
from dynatrain.spec.hardware import PROFILES
from dynatrain.spec.job import job_from_manifest
from dynatrain.vps.layout import parse_layout

ROOT = Path(__file__).resolve().parents[2]


class _Client:
    closed = False

    def close(self):
        self.closed = True


def _room():
    body = yaml.safe_load((ROOT / "examples" / "dev-job.yaml").read_text())
    body["metadata"] = {"name": "j", "namespace": "ns", "uid": "uid-j"}
    job = job_from_manifest(body)
    c = JobController(job, rendezvous="127.0.0.1:1", profile=PROFILES["cpu"], log=lambda _: None)
    deleted, events = [], []
    core = SimpleNamespace(delete_namespaced_pod=lambda name, ns, **_: deleted.append(name))
    ctx = JobContext(core=core, namespace="ns", name="j", uid="uid-j", settings=Settings(),
                     log=lambda _: None, event=lambda *e: events.append(e),
                     conditions=Conditions(), job=lambda: job, body=lambda: body,
                     generation=lambda: 1, controller=lambda: c)
    pods = WorkerPods(ctx, view=None, secret_name=lambda: "s", publish=lambda force: None,
                      worker_uids=set())
    c.push(*(ev.DeviceUp(d, _Client()) for d in range(3)))
    c.take_in()
    c._apply(js.Adopted(parse_layout("dp=3").with_devices([0, 1, 2])))
    return c, pods, deleted, events


def _ended(d: int) -> WorkerPod:
    return WorkerPod(f"j-worker-{d}", d, "node-a", "127.0.0.1", "Succeeded", False, 0.0,
                     unhealthy="pod Succeeded")


def test_a_leaver_of_the_switch_in_flight_is_not_replaced():
    c, pods, deleted, events = _room()
    # A shrink dp=3 -> dp=2 in flight (what core._run_switch holds while it runs).
    c._apply(js.SwitchBegan(frozenset({0, 1, 2}), parse_layout("dp=2").with_devices([0, 1]),
                            "rebalance"))
    assert c.leaving == {2}
    pods.replace(_ended(2))
    assert 2 in c.clients                 # pushed into the controller's inbox, not yet taken in
    c.take_in()
    assert deleted == ["j-worker-2"] and 2 in pods.left
    assert pods.replaced == 0 and events == []               # no WorkerReplaced, no back-off
    assert 2 not in c.clients and not c.failed and c.lost == []
    # Its exit is kept for the switch's end: a failure only if the switch fails.
    assert 2 in dict(c.state.exits)


def test_a_member_that_ends_outside_a_switch_is_failed_and_replaced():
    c, pods, deleted, events = _room()
    assert c.leaving == frozenset()
    pods.replace(_ended(1))
    c.take_in()
    assert deleted == ["j-worker-1"] and pods.replaced == 1
    assert [e[1] for e in events] == ["WorkerReplaced"]
    assert c.failed == {1} and c.lost == [1]
    # Nor is a member the switch in flight keeps a leaver.
    c, pods, deleted, events = _room()
    c._apply(js.SwitchBegan(frozenset({0, 1, 2}), parse_layout("dp=2").with_devices([0, 1]),
                            "rebalance"))
    pods.replace(_ended(0))
    c.take_in()
    assert pods.replaced == 1 and c.failed == {0}

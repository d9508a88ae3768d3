"""The controller's inbox (dynatrain/controller/inbox.py): front ends push events, the controller
takes them in at its own points, in order, and never inside a front end's call.

Tables of event sequences against a real :class:`JobController` whose agents are fakes (the
agents' own message for Status), so they need no process and run in milliseconds. The process
tests (test_run.py, test_overlap.py, the operator's) run the same path end to end.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from dynatrain.agent.v1 import agent_pb2 as pb
from dynatrain.controller import inbox as ev
from dynatrain.controller import jobstate as js
from dynatrain.controller.core import JobController
from dynatrain.spec.hardware import PROFILES
from dynatrain.spec.job import job_from_manifest
from dynatrain.vps.layout import parse_layout

ROOT = Path(__file__).resolve().parents[2]


class _Agent:
    """An agent client that answers Status as a training worker with nothing new to report."""

    def __init__(self):
        self.closed = False

    def status(self, since_step=0, **_):
        return pb.StatusResponse(state=pb.StatusResponse.State.TRAINING)

    def close(self):
        self.closed = True


def _controller(devices=(0, 1, 2), layout="dp=3") -> JobController:
    body = yaml.safe_load((ROOT / "examples" / "dev-job.yaml").read_text())
    body["metadata"] = {"name": "j", "namespace": "ns", "uid": "uid-j"}
    c = JobController(job_from_manifest(body), rendezvous="127.0.0.1:1",
                      profile=PROFILES["cpu"], log=lambda _: None)
    c.push(*(ev.DeviceUp(d, _Agent()) for d in devices))
    c.take_in()
    if layout:
        shape = parse_layout(layout)
        c._apply(js.Adopted(shape.with_devices(list(devices)[:shape.world])))  # rest: standby
    return c


def _state(c: JobController) -> dict:
    """What the events change, as plain values."""
    req = c.pending_request()
    return {"clients": sorted(c.clients), "usable": c.usable, "doomed": sorted(c.doomed),
            "failed": sorted(c.failed), "lost": list(c.lost),
            "request": req.layout if req else None, "mode": c.job.mode}


# Each case: the controller's devices and layout, the events pushed, and what taking them in
# must leave. The events apply in the order pushed: a device that came up and then left is gone.
CASES = [
    ("a device comes up", (0, 1), "dp=2", [ev.DeviceUp(2, _Agent())],
     {"clients": [0, 1, 2], "usable": [0, 1, 2]}),
    ("up, then left", (0, 1), "dp=2", [ev.DeviceUp(2, _Agent()), ev.DeviceLeft(2)],
     {"clients": [0, 1], "usable": [0, 1]}),
    ("a notice takes the device out of the usable ones", (0, 1, 2), "dp=3",
     [ev.Notice(1, 30.0)], {"usable": [0, 2], "doomed": [1], "failed": []}),
    ("gone after its notice: not a failure", (0, 1, 2), "dp=3",
     [ev.Notice(1, 30.0), ev.DeviceLeft(1)],
     {"clients": [0, 2], "doomed": [], "failed": [], "lost": []}),
    ("a member that dies is failed and lost", (0, 1, 2), "dp=3",
     [ev.DeviceFailed(2, "its pod is gone without notice")],
     {"clients": [0, 1], "failed": [2], "lost": [2]}),
    ("a standby that dies is only gone", (0, 1, 2), "dp=2",
     [ev.DeviceFailed(2, "exited")], {"clients": [0, 1], "failed": [], "lost": []}),
    ("a layout request", (0, 1), "dp=2", [ev.LayoutRequested(parse_layout("pp=2"))],
     {"request": parse_layout("pp=2"), "mode": "fixed"}),
    ("the later request supersedes the earlier", (0, 1), "dp=2",
     [ev.LayoutRequested(parse_layout("pp=2")), ev.LayoutRequested(parse_layout("tp=2"))],
     {"request": parse_layout("tp=2")}),
]


@pytest.mark.parametrize("name,devices,layout,events,expected", CASES,
                         ids=[c[0] for c in CASES])
def test_events_apply_in_order_when_taken_in(name, devices, layout, events, expected):
    c = _controller(devices, layout)
    before = _state(c)
    c.push(*events)
    assert _state(c) == before                  # pushing changes nothing by itself
    assert c.take_in() == len(events)
    after = _state(c)
    assert {k: after[k] for k in expected} == expected
    assert c.take_in() == 0                     # taken once


def test_a_spec_edit_to_a_fixed_layout_is_a_request_and_back_to_auto_withdraws_it():
    c = _controller((0, 1), "dp=2")
    fixed = replace(c.job, mode="fixed", layout=parse_layout("pp=2"))
    c.push(ev.SpecEdited(fixed))
    c.take_in()
    (req,) = c.requests
    assert (req.state, c.pending_request()) == ("pending", req)
    c.push(ev.SpecEdited(replace(fixed, mode="auto", layout=None)))
    c.take_in()
    assert c.requests[0].state == "superseded" and c.pending_request() is None


def test_a_notice_deadline_counts_from_when_it_was_seen_not_when_taken_in():
    c = _controller((0, 1), "dp=2")
    seen = time.monotonic() - 10.0              # waited 10 s in the inbox (a long switch)
    c.push(ev.Notice(1, 30.0, at=seen))
    c.take_in()
    assert c.doomed[1] == pytest.approx(seen + 30.0)


def test_an_exit_of_a_leaver_of_the_switch_in_flight_waits_for_the_switch_to_end():
    c = _controller((0, 1, 2), "dp=3")
    c._apply(js.SwitchBegan(frozenset({0, 1, 2}), parse_layout("dp=2").with_devices([0, 1]),
                            "rebalance"))
    c.push(ev.DeviceFailed(2, "exited as its part ended"))
    c.take_in()
    assert 2 not in c.clients and not c.failed and c.lost == []
    assert c.state.exits == ((2, "exited as its part ended"),)


def test_something_else_is_refused_naming_what_would_do():
    c = _controller()
    with pytest.raises(TypeError, match="DeviceUp, Notice, DeviceLeft, DeviceFailed"):
        c.push(("notice", 1, 30.0))
    assert c.take_in() == 0


def test_pushes_from_many_threads_arrive_whole_and_each_threads_in_order():
    box = ev.Inbox()

    def pusher(k):
        for i in range(500):
            box.push(ev.DeviceLeft(k * 1000 + i))

    threads = [threading.Thread(target=pusher, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = [e.device for e in box.take()]
    assert sorted(got) == sorted(k * 1000 + i for k in range(4) for i in range(500))
    for k in range(4):
        mine = [d for d in got if d // 1000 == k]
        assert mine == sorted(mine)
    assert box.take() == []


def test_while_a_switch_waits_the_front_end_only_pushes_and_the_controller_takes_in_after():
    """The old ``intake`` changed the controller from inside the front end's call, in the
    middle of a switch. ``sense`` only pushes: while it runs, the controller is unchanged;
    the events apply when the controller takes its inbox in, right after."""
    c = _controller((0, 1, 2), "dp=3")
    c._apply(js.SwitchBegan(frozenset({0, 1, 2}), parse_layout("dp=3").with_devices([0, 1, 2]),
                            "scale-up"))
    seen_inside = {}

    def sense():
        c.push(ev.DeviceFailed(1, "its pod is gone without notice"), ev.DeviceUp(3, _Agent()))
        seen_inside.update(_state(c))

    c.sense = sense
    c._watch("commit")
    assert seen_inside["failed"] == [] and seen_inside["clients"] == [0, 1, 2]
    after = _state(c)
    assert after["failed"] == [1] and after["clients"] == [0, 2, 3]


def test_a_tick_takes_the_inbox_in_before_it_reads_progress_and_decides():
    c = _controller((0, 1), None)
    c.push(ev.DeviceUp(2, _Agent()))
    c.view()                                    # a read takes nothing in
    assert sorted(c.clients) == [0, 1]
    seen = []

    class Stop(Exception):
        pass

    def poll(**_):                              # the tick's first step after taking in
        seen.append(sorted(c.clients))
        raise Stop

    c.poll = poll
    with pytest.raises(Stop):
        c.tick()
    assert seen == [[0, 1, 2]]

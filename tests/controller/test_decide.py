"""The controller's decisions (dynatrain/controller/decide.py) as tables of cases and as event
replays: no process, no agent, no clock. Each case is a state the controller can be in and
the one thing it must do; the end-to-end tests (test_overlap.py, test_chaos.py, tests/k8s)
check that the controller does it with real workers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynatrain.controller import decide
from dynatrain.controller.decide import (Finished, GiveUp, Idle, InFlight, Park, Recover,
                                         Refuse, Request, Switch, View)
from dynatrain.spec.hardware import PROFILES
from dynatrain.spec.job import load_job
from dynatrain.controller.policy import Policy
from dynatrain.vps.layout import parse_layout

ROOT = Path(__file__).resolve().parents[2]
PROFILE = replace(PROFILES["cpu"], shared_cores=0, memory_bytes=4 << 30)
JOB = load_job(ROOT / "examples" / "quickstart.yaml")           # global batch 12, 1-4 workers
FOUR = parse_layout("dp=4").with_devices([0, 1, 2, 3])


def view(**kw) -> View:
    base = dict(now=100.0, layout=FOUR, usable=(0, 1, 2, 3), step=20, last_step_at=99.0,
                give_up_s=600.0)
    return View(**{**base, **kw})


def act(v: View, job=JOB, policy: Policy | None = None):
    return decide.next_action(v, policy or Policy(margin=100.0), job, PROFILE)


# -- next_action: one row per rule, in priority order --------------------------------------------
@pytest.mark.parametrize("case, v, expected", [
    ("finished beats everything", view(finished=True, failed=frozenset({1})), Finished),
    ("a stalled job gives up", view(now=1000.0, last_step_at=100.0), GiveUp),
    ("not before it runs a layout", view(layout=None, now=1000.0, last_step_at=0.0), Switch),
    ("a failure is recovered first", view(failed=frozenset({2}), doomed=frozenset({1})),
     Recover),
    ("interrupted past the grace", view(interrupted_since=98.9), Recover),
    ("interrupted within the grace", view(interrupted_since=99.5), Idle),
    ("a suspect holds a voluntary switch", view(usable=(0, 1, 2, 3, 4), misses={2: 1}), Idle),
    ("a notice overrides a suspect", view(usable=(0, 1, 2), doomed=frozenset({3}),
                                          misses={2: 1}), Switch),
    ("steady: nothing to do", view(), Idle),
    ("new capacity: grow", view(layout=parse_layout("dp=2").with_devices([0, 1])), Switch),
])
def test_next_action_takes_the_rules_in_order(case, v, expected):
    assert isinstance(act(v), expected), case


def test_the_give_up_message_names_the_timeout_and_the_members():
    a = act(view(now=1000.0, last_step_at=100.0, give_up_s=600.0))
    assert isinstance(a, GiveUp)
    assert "giveUpSeconds=600" in a.why and "[0, 1, 2, 3]" in a.why and "900 s" in a.why


def test_in_restart_mode_a_failure_is_left_to_the_front_end():
    a = act(view(failed=frozenset({1}), recover_in_memory=False))
    assert isinstance(a, Idle) and "restart" in a.why


def test_a_notice_switches_off_the_doomed_device():
    a = act(view(usable=(0, 1, 2), doomed=frozenset({3})))
    assert isinstance(a, Switch) and a.decision.reason == "preemption"
    assert 3 not in a.decision.layout.device_of


def test_no_layout_for_the_devices_left_gives_up_with_the_solvers_reason():
    job = replace(JOB, min_workers=3)
    a = act(view(usable=(0, 1), doomed=frozenset({2, 3})), job=job)
    assert isinstance(a, GiveUp) and "minWorkers=3" in a.why


def test_under_the_minimum_by_notices_a_job_that_can_wait_parks_at_a_checkpoint():
    job = replace(JOB, min_workers=3)
    pushed = view(usable=(0, 1), doomed=frozenset({2, 3}), wait_below_minimum=True)
    a = act(pushed, job=job)
    assert isinstance(a, Park), a
    assert "[2, 3]" in a.why and "2 usable" in a.why and "minWorkers=3" in a.why
    # Where nothing can hold it (the local runner, no checkpoint claim) it fails, saying what
    # would have kept it.
    a = act(replace(pushed, wait_below_minimum=False), job=job)
    assert isinstance(a, GiveUp) and "spec.checkpoint" in a.why
    # At its minimum it shrinks live as ever; a failure is still recovered first; a device
    # lost without notice is not a reason to park (recovery decides).
    assert isinstance(act(replace(pushed, usable=(0, 1, 4)), job=job), Switch)
    assert isinstance(act(replace(pushed, failed=frozenset({3})), job=job), Recover)
    assert isinstance(act(view(usable=(0, 1), wait_below_minimum=True,
                               layout=parse_layout("dp=2").with_devices([0, 1])),
                          job=replace(JOB, min_workers=2)), Idle)


def test_replay_a_higher_priority_job_takes_the_pool_and_gives_it_back():
    """A low-priority job (3..4 workers) on 4 GPUs; the scheduler preempts two of its pods
    for a high-priority job: it parks; when capacity comes back it starts again."""
    job = replace(JOB, min_workers=3)
    running = view(wait_below_minimum=True)
    assert isinstance(act(running, job=job), Idle)
    assert isinstance(act(replace(running, usable=(0, 1), doomed=frozenset({2, 3})),
                          job=job), Park)
    # Parked, it is a job that has not started: the front end asks again once its minimum
    # is up (the operator's start gate), and the first layout fits the workers it then has.
    parked = replace(running, layout=None, usable=(), doomed=frozenset(), step=20)
    # A start whose workers were taken meanwhile leaves it short again: it waits, not fails.
    a = act(replace(parked, usable=(4, 5)), job=job)
    assert isinstance(a, Idle) and "waiting" in a.why, a
    assert isinstance(act(replace(parked, usable=(4, 5), wait_below_minimum=False), job=job),
                      GiveUp)
    a = act(replace(parked, usable=(4, 5, 6)), job=job)
    assert isinstance(a, Switch) and a.decision.reason == "start", a
    assert a.decision.layout.world == 3
    a = act(replace(parked, usable=(4, 5, 6, 7)), job=job)
    assert isinstance(a, Switch) and a.decision.reason == "start", a
    assert a.decision.layout.world == 4


def test_a_request_that_cannot_be_solved_is_refused():
    bad = parse_layout("tp=3")                           # 12 heads? no: the solver refuses
    job = replace(JOB, mode="fixed", layout=bad)
    a = act(view(usable=(0, 1, 2, 3), request=Request(bad)), job=job)
    assert isinstance(a, Refuse) and a.why


@pytest.mark.parametrize("usable, expected", [
    ((0, 1, 2, 3), None),                       # applied by this decision: nothing to say
    ((0, 1), ("waiting", "needs 4 workers, 2 usable")),
])
def test_a_request_is_answered_waiting_when_capacity_is_short(usable, expected):
    want = parse_layout("dp=1,tp=2,pp=2")
    job = replace(JOB, mode="fixed", layout=want)
    two = parse_layout("dp=2").with_devices([0, 1])
    a = act(view(layout=two if len(usable) == 2 else FOUR, usable=usable,
                 request=Request(want)), job=job)
    if expected is None:
        assert isinstance(a, Switch) and a.decision.reason == "requested" and a.answer is None
    else:
        assert isinstance(a, Idle) and a.answer.state == expected[0]
        assert a.answer.text.startswith(expected[1])


def test_a_request_waits_behind_a_forced_switch():
    want = parse_layout("dp=1,tp=2,pp=2")
    a = act(view(usable=(0, 1, 2), doomed=frozenset({3}), request=Request(want)),
            job=replace(JOB, mode="fixed", layout=want))
    # Three devices cannot hold the request: the notice is acted on, the request waits.
    assert isinstance(a, Switch) and a.decision.reason == "preemption"
    assert a.answer == decide.Answer("waiting", "needs 4 workers, 3 usable: applied when "
                                     "capacity allows")


# -- superseded: the Prepare in flight ------------------------------------------------------------
GROW = InFlight(frozenset({0, 1, 2, 3, 4}), parse_layout("dp=4").with_devices([0, 1, 2, 4]),
                "scale-up")
PRESENT = frozenset({0, 1, 2, 3, 4})


@pytest.mark.parametrize("case, v, flight, present, expected", [
    ("nothing new", view(usable=(0, 1, 2, 3, 4)), GROW, PRESENT, None),
    ("a device taking part is gone", view(), GROW, PRESENT - {4}, "device(s) [4] lost"),
    ("a device taking part failed", view(failed=frozenset({1})), GROW, PRESENT,
     "device(s) [1] lost"),
    ("one missed Status is a slow answer", view(misses={2: 1}), GROW, PRESENT, None),
    ("two in a row: silent", view(misses={2: 2}), GROW, PRESENT,
     "device(s) [2] stopped answering Status"),
    ("a notice on the target", view(doomed=frozenset({4})), GROW, PRESENT,
     "preemption notice for device(s) [4], which the target uses"),
    ("a notice on a leaver is what the switch is for", view(doomed=frozenset({3})), GROW,
     PRESENT, None),
    ("a request over a voluntary switch", view(usable=(0, 1, 2, 3, 4),
                                               request=Request(parse_layout("tp=2,pp=2"))),
     GROW, PRESENT, "layout dp=1,tp=2,pp=2 was requested"),
    ("the request it is", view(request=Request(parse_layout("dp=4"))), GROW, PRESENT, None),
    ("a request never supersedes a forced switch",
     view(request=Request(parse_layout("tp=2,pp=2"))),
     InFlight(GROW.involved, GROW.target, "preemption"), PRESENT, None),
    ("a request capacity cannot hold", view(usable=(0, 1), request=Request(
        parse_layout("dp=4,tp=2"))), GROW, PRESENT, None),
])
def test_superseded(case, v, flight, present, expected):
    assert decide.superseded(v, flight, present=present) == expected, case


# -- the watchdog ----------------------------------------------------------------------------------
@pytest.mark.parametrize("slow, silent, expected", [
    (False, 0.0, "stopped answering"),          # refused: the process is gone
    (True, 3.0, None),                          # a slow answer: a miss
    (True, 8.0, "hung: no answer to Status for 8.0 s (watchdog 8 s)"),
])
def test_after_a_status_error(slow, silent, expected):
    assert decide.after_status_error(slow=slow, silent_s=silent, watchdog_s=8.0) == expected


@pytest.mark.parametrize("misses, expected", [(0, False), (1, False), (2, True), (5, True)])
def test_stopped_answering_takes_two_misses_in_a_row(misses, expected):
    # One miss is a slow answer; the second in a row is a device that stopped answering, both
    # for a Prepare in flight (superseded) and inside a Commit (the orchestrator's watch).
    assert decide.stopped_answering(misses) is expected


@pytest.mark.parametrize("waits, stalled, expected", [
    ({0: 5.0, 1: 5.0, 2: 0.1}, 9.0, [2]),       # two wait for the third, which waits for none
    ({0: 5.0, 1: 5.0, 2: 0.1}, 7.0, []),        # not stalled long enough yet
    ({0: 5.0, 1: 5.0, 2: 5.0}, 9.0, []),        # every one waits: inside the collective
    ({0: 0.1, 1: 0.2}, 9.0, []),                # no one waits: nothing to blame
    ({0: 3.0, 1: 0.5}, 9.0, []),                # a wait of under half the limit proves nothing
])
def test_hung_members_are_the_ones_the_others_wait_for(waits, stalled, expected):
    assert decide.hung(waits, stalled_s=stalled, limit_s=8.0) == expected


def test_the_preemption_policy_says_whether_a_notice_is_acted_on():
    assert decide.acts_on_notice(JOB)
    assert not decide.acts_on_notice(replace(JOB, preemption_policy="Ignore"))


# -- recovery: where to restore from --------------------------------------------------------------
def holding(snapshots, mirror_of=-1, mirrors=()):
    return SimpleNamespace(snapshot_steps=list(snapshots), mirror_of=mirror_of,
                           mirror_steps=list(mirrors))


def test_restore_takes_the_newest_step_that_is_whole():
    old = parse_layout("dp=1,tp=1,pp=2").with_devices([0, 1])
    new = parse_layout("dp=1").with_devices([0])
    model = JOB.model
    # Device 1 (stage 1) died; device 0 mirrors it at step 9 only: step 10 is not whole.
    held = {0: holding([9, 10], mirror_of=1, mirrors=[9])}
    assert decide.choose_restore(model, old, new, (1,), held, devices_per_node=8) == (9, {1: 0})
    # No mirror of the dead stage at all: nothing in memory (the caller reads a checkpoint).
    assert decide.choose_restore(model, old, new, (1,), {0: holding([9, 10])},
                                 devices_per_node=8) is None


# -- event replays: a sequence of signals, the controller's state kept by the replay ---------------
def replay(events, *, start=FOUR, usable=(0, 1, 2, 3), job=JOB):
    """Apply each event to the view, ask :func:`decide.next_action`, and apply a Switch as
    done at once (the executor's part). Returns the actions taken."""
    v = view(layout=start, usable=tuple(usable))
    policy = Policy(margin=100.0, cooldown_s=0.0)
    taken = []
    for step, kind, devices in events:
        up, doomed, failed = set(v.usable), set(v.doomed), set(v.failed)
        if kind == "join":
            up |= set(devices)
        elif kind == "notice":
            doomed |= set(devices)
            up -= set(devices)
        elif kind == "kill":
            failed |= set(devices) & set(v.members)
            up -= set(devices)
        v = replace(v, step=step, usable=tuple(sorted(up)), doomed=frozenset(doomed),
                    failed=frozenset(failed))
        a = decide.next_action(v, policy, job, PROFILE)
        name = type(a).__name__
        if isinstance(a, Recover):
            # The executor recovers over the survivors (the policy places the new layout).
            d = policy.decide(job, PROFILE, v.layout, list(v.usable), set(v.failed), step)
            a = Switch(d, None)
            v = replace(v, failed=frozenset())
        reason = None
        if isinstance(a, Switch):
            reason = a.decision.reason
            v = replace(v, layout=a.decision.layout,
                        doomed=frozenset(v.doomed - set(a.decision.layout.device_of)))
        taken.append((step, name, reason))
    return taken, v


def test_replay_notice_join_kill_a_few_steps_apart():
    # The overlap test's first scenario, as events: each lands while the last is handled.
    taken, v = replay([(10, "notice", [3]), (11, "join", [4, 5]), (14, "kill", [1])])
    assert taken == [(10, "Switch", "preemption"), (11, "Switch", "scale-up"),
                     (14, "Recover", "preemption")]
    assert 1 not in v.layout.device_of and 3 not in v.layout.device_of
    assert set(v.layout.device_of) <= {0, 2, 4, 5}


def test_replay_a_kill_on_a_doomed_device_is_still_recovered():
    taken, v = replay([(10, "notice", [3]), (10, "kill", [3])])
    # The notice switched 3 out first, so its death later costs nothing: the job is steady.
    assert taken[0][1:] == ("Switch", "preemption") and taken[1][1] == "Idle"
    assert 3 not in v.layout.device_of


# -- exit_is_failure: the one exit rule of both front ends ----------------------------------------
@pytest.mark.parametrize("member, released, code, failure", [
    (True, False, 1, True),            # a member crashed
    (True, False, -9, True),           # killed (a notice that ran out, an OOM kill)
    (True, False, None, True),         # its pod is gone, the code unknown: without notice
    (True, False, 0, False),           # a leaver done with its part of the switch
    (True, True, None, False),         # a pod the front end deleted after switching it off
    (False, False, 1, False),          # a standby (joiner) that stopped: not in the layout
    (False, False, None, False),
])
def test_exit_is_failure(member, released, code, failure):
    assert decide.exit_is_failure(member=member, released=released, code=code) is failure

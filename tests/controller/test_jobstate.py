"""The job's state and its reducer (dynatrain/controller/jobstate.py): ``decide(state, event)
-> (state, actions)`` as tables of event sequences, and the overlap property's scenarios
(dynatrain/bench/overlap.py, run on real workers by test_overlap.py) replayed as pure events
against an executor with no agents. No process, no clock, no network: the whole file runs in
about a second."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dynatrain.agent.v1 import agent_pb2 as pb
from dynatrain.bench import overlap
from dynatrain.controller import decide as rules
from dynatrain.controller import inbox as ev
from dynatrain.controller import jobstate as js
from dynatrain.controller.jobstate import (Abort, Answered, Close, Committed, JobState, Log,
                                           SwitchBegan, SwitchEnded, Tick, Watch, Workers)
from dynatrain.controller.policy import Policy
from dynatrain.spec.hardware import PROFILES
from dynatrain.spec.job import job_from_manifest, load_job
from dynatrain.vps.layout import parse_layout

ROOT = Path(__file__).resolve().parents[2]
PROFILE = replace(PROFILES["cpu"], shared_cores=0, memory_bytes=4 << 30)
JOB = load_job(ROOT / "examples" / "quickstart.yaml")           # global batch 12, 1-4 workers
THREE = parse_layout("dp=3").with_devices([0, 1, 2])


def running(devices=(0, 1, 2), layout=THREE, job=JOB) -> JobState:
    """A job whose agents on ``devices`` answer and that runs ``layout``."""
    s, _ = js.decide_all(JobState(job=job), [ev.DeviceUp(d, None) for d in devices])
    return js.decide(s, js.Adopted(layout))[0] if layout is not None else s


def tick(s: JobState, now: float = 100.0, **kw):
    return js.decide(s, Tick(now=now, policy=kw.pop("policy", Policy(margin=100.0)),
                             profile=PROFILE, last_step_at=now, give_up_s=600.0, **kw))


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


# -- who takes part ------------------------------------------------------------------------------
@pytest.mark.parametrize("case, events, want", [
    ("a device comes up", [ev.DeviceUp(3, None)],
     dict(agents={0, 1, 2, 3}, usable=(0, 1, 2, 3), failed=set(), lost=())),
    ("up, then left: gone, its connection closed", [ev.DeviceUp(3, None), ev.DeviceLeft(3)],
     dict(agents={0, 1, 2}, usable=(0, 1, 2))),
    ("a notice: not usable, still an agent", [ev.Notice(2, 30.0, at=5.0)],
     dict(agents={0, 1, 2}, usable=(0, 1), doomed={2: 35.0})),
    ("a member fails: failed, lost, gone", [ev.DeviceFailed(1, "killed")],
     dict(agents={0, 2}, usable=(0, 2), failed={1}, lost=((1, "killed"),))),
    ("a standby fails: gone, not a failure of the job", [ev.DeviceUp(3, None),
                                                         ev.DeviceFailed(3, "crashed")],
     dict(agents={0, 1, 2}, failed=set(), lost=())),
    ("a member fails twice: one loss", [ev.DeviceFailed(1, "a"), ev.DeviceFailed(1, "b")],
     dict(failed={1}, lost=((1, "a"),))),
    ("a notice then the device left: no deadline kept", [ev.Notice(2, 30.0, at=5.0),
                                                         ev.DeviceLeft(2)],
     dict(agents={0, 1}, doomed={})),
])
def test_membership(case, events, want):
    s, _ = js.decide_all(running(), events)
    got = dict(agents=set(s.agents), usable=s.usable, failed=set(s.failed), lost=s.lost,
               doomed=s.doomed)
    assert {k: got[k] for k in want} == want, case


def test_a_device_left_is_closed_now_outside_a_switch_and_later_inside_one():
    _, acts = js.decide(running(), ev.DeviceLeft(2))
    assert Close(2, later=False) in acts and Workers(2) in acts
    flying, _ = js.decide(running(), SwitchBegan(frozenset({0, 1, 2}), THREE, "scale-up"))
    _, acts = js.decide(flying, ev.DeviceLeft(2))
    assert Close(2, later=True) in acts            # the switch in flight may still call it


def test_a_leavers_exit_in_a_switch_counts_only_if_the_switch_fails():
    shrink = SwitchBegan(frozenset({0, 1, 2}), parse_layout("dp=2").with_devices([0, 1]),
                         "rebalance")
    s, acts = js.decide_all(running(), [shrink, ev.DeviceFailed(2, "exited as its part ended")])
    assert not s.failed and s.exits == ((2, "exited as its part ended"),) and 2 not in s.agents
    assert s.leaving == {2} and not any(isinstance(a, Log) for a in acts)
    ok, _ = js.decide(s, SwitchEnded(True))
    assert not ok.failed and ok.flight is None and ok.exits == ()
    bad, acts = js.decide(s, SwitchEnded(False))
    assert bad.failed == {2} and bad.lost == ((2, "exited as its part ended"),)
    assert Log("device 2 failed: exited as its part ended") in acts
    # A member the switch keeps is failed at once, in flight or not.
    s, _ = js.decide_all(running(), [shrink, ev.DeviceFailed(0, "killed")])
    assert s.failed == {0}


def test_a_committed_recovery_clears_the_failed_and_a_restart_clears_everything():
    s, _ = js.decide_all(running(), [ev.DeviceFailed(2, "killed")])
    two = parse_layout("dp=2").with_devices([0, 1])
    s, acts = js.decide_all(s, [SwitchBegan(frozenset({0, 1}), two, "failure"),
                                SwitchEnded(True), Committed(two, 12, "failure",
                                                             recovered=True)])
    assert s.layout == two and not s.failed and s.lost == ((2, "killed"),)
    s, _ = js.decide_all(s, [js.StatusAnswered(0, 20.0), js.StatusFailed(1, 21.0, slow=True)])
    assert s.misses and s.answered
    s, acts = js.decide(s, js.Restarted())
    assert s.layout is None and not s.agents and kinds(acts) == ["Close", "Close", "Workers"]
    assert not s.misses and not s.answered       # the watchdog's clocks went with the agents


def test_a_reconciled_generation_fails_its_devices_without_an_agent():
    s, _ = js.decide_all(running(), [ev.DeviceFailed(2, "killed"), ev.DeviceLeft(1)])
    done = parse_layout("dp=2").with_devices([0, 1])      # completed on 0 and 1; 1 is gone
    s, _ = js.decide(s, js.Reconciled(done, 7))
    assert s.layout == done and s.failed == {1}      # 2 is not in it any more, 1 is lost
    assert s.lost[-1] == (1, "lost while the switch to generation 7 completed")


def test_something_else_is_refused():
    with pytest.raises(TypeError, match="not a job event"):
        js.decide(running(), ("notice", 1, 30.0))


# -- the watchdog --------------------------------------------------------------------------------
def status_failed(device, at, slow=True, judge=True):
    return js.StatusFailed(device, at, slow=slow, error="UNAVAILABLE: connection refused",
                           judge=judge, watchdog_s=4.0)


@pytest.mark.parametrize("case, events, misses, failed", [
    ("a slow call is a miss, not a failure", [js.StatusAnswered(1, 10.0),
                                              status_failed(1, 11.0)], {1: 1}, {}),
    ("misses count in a row", [js.StatusAnswered(1, 10.0), status_failed(1, 11.0),
                               status_failed(1, 12.0)], {1: 2}, {}),
    ("an answer clears them", [status_failed(1, 11.0), js.StatusAnswered(1, 12.0)], {}, {}),
    ("silent for the watchdog's time: hung", [js.StatusAnswered(1, 10.0),
                                              status_failed(1, 14.5)],
     {}, {1: "hung: no answer to Status for 4.5 s (watchdog 4 s)"}),
    ("refused: gone at once", [js.StatusAnswered(1, 10.0), status_failed(1, 10.5, slow=False)],
     {}, {1: "stopped answering: UNAVAILABLE: connection refused"}),
    ("no verdict while a switch watches", [js.StatusAnswered(1, 10.0),
                                           status_failed(1, 20.0, judge=False),
                                           status_failed(1, 21.0, slow=False, judge=False)],
     {1: 1}, {}),
    ("the clock starts at the first call when none answered", [status_failed(1, 50.0),
                                                              status_failed(1, 53.0)],
     {1: 2}, {}),
])
def test_the_watchdog(case, events, misses, failed):
    s, _ = js.decide_all(running(), events)
    assert dict(s.misses) == misses, case
    assert dict(s.lost) == failed and set(s.failed) == set(failed), case
    if failed:                                   # a failed member is gone, its clock too
        assert not set(failed) & s.agents and not set(failed) & dict(s.answered).keys()


# -- where a recovery goes ------------------------------------------------------------------------
def test_a_recovery_is_placed_over_the_devices_left_without_the_failed_or_noticed():
    s, _ = js.decide_all(running((0, 1, 2, 3), parse_layout("dp=4").with_devices([0, 1, 2, 3])),
                         [ev.DeviceFailed(1, "killed"), ev.Notice(3, 30.0, at=0.0)])
    _, acts = js.decide(s, js.PlaceRecovery(Policy(margin=100.0), PROFILE))
    (placed,) = acts
    assert placed.failed == (1,) and set(placed.layout.device_of) == {0, 2}


def test_a_recovery_with_no_layout_left_gives_up_saying_why():
    two = parse_layout("dp=2").with_devices([0, 1])
    s, _ = js.decide_all(running((0, 1), two, job=replace(JOB, min_workers=2)),
                         [ev.DeviceFailed(1, "killed")])
    _, acts = js.decide(s, js.PlaceRecovery(Policy(margin=100.0), PROFILE))
    (give_up,) = acts
    assert isinstance(give_up, rules.GiveUp)
    assert give_up.why.startswith("devices [1] failed and no layout fits the 1 devices left")


def held(device, steps=(), mirror_of=-1, mirrors=(), checkpoint=("", 0)):
    """A survivor's Status as a recovery reads it (the agent's own message)."""
    return pb.StatusResponse(device=device, snapshot_steps=list(steps), mirror_of=mirror_of,
                             mirror_steps=list(mirrors), previous_mirror_of=-1,
                             checkpoint=checkpoint[0], checkpoint_step=checkpoint[1])


PP2 = parse_layout("pp=2").with_devices([0, 1])      # device 1 holds the only second stage


@pytest.mark.parametrize("case, holdings, want", [
    ("the newest step the survivor holds, the dead stage's from its mirror",
     {0: held(0, [9, 10], mirror_of=1, mirrors=[9, 10])}, js.RestoreFrom(PP2, (1,), 10, ((1, 0),))),
    ("a mirror of an older step only: that step",
     {0: held(0, [9, 10], mirror_of=1, mirrors=[9])}, js.RestoreFrom(PP2, (1,), 9, ((1, 0),))),
    ("no mirror of the dead stage: the newest checkpoint a survivor wrote",
     {0: held(0, [9, 10], checkpoint=("/ckpt/8", 8))}, js.FromCheckpoint("/ckpt/8", 8)),
    ("neither: the job stops, saying why and what to set", {0: held(0, [9, 10])},
     rules.GiveUp("devices [1] failed and no copy of their state survives in memory (their "
                  "buddies are gone too, or spec.recovery.mirror is off), and there is no "
                  "checkpoint to fall back on (set spec.checkpoint.intervalSteps); the job "
                  "stops at step 10")),
])
def test_what_a_recovery_restores_from(case, holdings, want):
    s, _ = js.decide_all(running((0, 1), PP2), [js.Progressed(10), ev.DeviceFailed(1, "killed")])
    one = parse_layout("dp=1").with_devices([0])
    _, acts = js.decide(s, js.Holdings(one, (1,), holdings, devices_per_node=8))
    assert acts == (want,), case


# -- requests and their answers ------------------------------------------------------------------
def answers(acts) -> list[tuple[str, str]]:
    return [(a.request.state, a.request.answer) for a in acts if isinstance(a, Answered)]


def test_a_request_is_pending_then_applied_when_its_switch_commits():
    pp = parse_layout("pp=3")
    s, acts = js.decide_all(running(), [js.Progressed(9), ev.LayoutRequested(pp)])
    assert answers(acts) == [("pending", "requested at step 9")]
    assert s.job.mode == "fixed" and s.auto_job == JOB and s.pending_request.layout == pp
    s, acts = js.decide(s, Committed(pp.with_devices([0, 1, 2]), 11, "requested"))
    assert answers(acts) == [("applied", "applied at step 11 (requested)")]
    assert s.requests[-1].applied_step == 11 and s.pending_request is None


def test_a_request_for_the_running_shape_is_applied_at_once_and_a_newer_one_supersedes():
    s, acts = js.decide(running(), ev.LayoutRequested(parse_layout("dp=3")))
    assert answers(acts) == [("applied", "already running")]
    s, _ = js.decide(s, ev.LayoutRequested(parse_layout("pp=3")))
    s, acts = js.decide(s, ev.LayoutRequested(parse_layout("tp=3")))
    assert answers(acts) == [("superseded", "superseded by the request for dp=1,tp=3,pp=1"),
                             ("pending", "requested at step 0")]


def test_a_spec_back_to_auto_withdraws_the_request_and_forgets_the_auto_spec():
    fixed = replace(JOB, mode="fixed", layout=parse_layout("pp=3"))
    s, acts = js.decide_all(running(), [ev.SpecEdited(fixed), ev.SpecEdited(JOB)])
    assert answers(acts)[-1] == ("superseded", "withdrawn: parallelism.mode is auto again")
    assert s.job == JOB and s.auto_job is None and s.pending_request is None


def test_a_request_the_solver_cannot_meet_is_refused_and_the_job_runs_on_as_before():
    s, _ = js.decide(running(), ev.LayoutRequested(parse_layout("tp=3")))   # heads: no
    s, acts = tick(s)
    (answer,) = answers(acts)
    assert answer[0] == "refused" and answer[1]
    assert s.job == JOB and s.auto_job is None              # the spec before the request
    assert not any(isinstance(a, rules.Switch) for a in acts)


def test_a_finished_job_refuses_every_open_request_saying_so():
    s, _ = js.decide_all(running(), [js.Progressed(40), ev.LayoutRequested(parse_layout("pp=3"))])
    s, acts = tick(s, finished=True)
    assert answers(acts) == [("refused", "not applied: the job finished at step 40 first "
                                         "(requested at step 40)")]
    assert s.pending_request is None and kinds(acts) == ["Log", "Answered"]


# -- a tick's decision, and a Prepare in flight ----------------------------------------------------
@pytest.mark.parametrize("case, events, tick_kw, want", [
    ("steady: nothing to run", [], {}, []),
    ("a member failed: recover", [ev.DeviceFailed(1, "killed")], {}, ["Recover"]),
    ("a notice on a member: switch it out", [ev.Notice(2, 30.0, at=0.0)], {}, ["Switch"]),
    ("a join: scale up", [ev.DeviceUp(3, None)], {}, ["Switch"]),
    ("stalled past give-up", [], {"last_step_at": -1000.0}, ["GiveUp"]),
    ("a suspect waits for the watchdog", [ev.DeviceUp(3, None), js.StatusAnswered(1, 98.0),
                                          js.StatusFailed(1, 99.0, slow=True, watchdog_s=4.0)],
     {}, []),
])
def test_a_tick_returns_what_the_rules_decide(case, events, tick_kw, want):
    s, _ = js.decide_all(running(), events)
    now = 100.0
    t = Tick(now=now, policy=Policy(margin=100.0, cooldown_s=0.0), profile=PROFILE,
             give_up_s=600.0, **{"last_step_at": now, **tick_kw})
    _, acts = js.decide(s, t)
    assert [k for k in kinds(acts) if k not in ("Log", "Answered")] == want, case


@pytest.mark.parametrize("case, events, aborted", [
    ("nothing new", [], None),
    ("a device of the target left", [ev.DeviceLeft(3)], "device(s) [3] lost"),
    ("a notice on the target", [ev.Notice(1, 30.0, at=0.0)],
     "preemption notice for device(s) [1], which the target uses"),
    ("a request over a voluntary switch", [ev.LayoutRequested(parse_layout("pp=2"))],
     "layout dp=1,tp=1,pp=2 was requested"),
    ("a device not taking part joins: merged later", [ev.DeviceUp(4, None)], None),
])
def test_a_prepare_in_flight_is_aborted_only_when_a_signal_makes_its_target_wrong(
        case, events, aborted):
    four = parse_layout("dp=4").with_devices([0, 1, 2, 3])
    s, _ = js.decide_all(running((0, 1, 2, 3)),
                         [SwitchBegan(frozenset({0, 1, 2, 3}), four, "scale-up")] + events)
    _, acts = js.decide(s, Watch(now=1.0))
    assert [a.why for a in acts if isinstance(a, Abort)] == ([aborted] if aborted else []), case


# -- the overlap property's scenarios, replayed as events ---------------------------------------
class Replay:
    """The executor with no agents: a tick's :class:`~.decide.Switch` is prepared across one
    step, so the next step's events land while it is in flight (then a :class:`Watch` says
    whether they made it wrong); a recovery restores over the survivors at once. Joiners come
    up four steps after their join, as a worker takes seconds to start (the scenarios count
    on it). Everything the job decides is :func:`.jobstate.decide`'s."""

    def __init__(self, job, initial: int):
        self.policy = Policy(cooldown_s=0.0)
        self.state, _ = js.decide_all(JobState(job=job),
                                      [ev.DeviceUp(d, None) for d in range(initial)])
        self.flying: rules.Decision | None = None
        self.arriving: list[tuple[int, list[int]]] = []
        self.next_id = initial
        self.answers: list[tuple[str, str]] = []
        self.acted: list[tuple[int, str, tuple[int, ...]]] = []
        """(step, reason, devices of the target) of every switch committed."""
        self.aborted: list[tuple[int, str]] = []

    def apply(self, e) -> tuple:
        self.state, acts = js.decide(self.state, e)
        self.answers += answers(acts)
        return acts

    def event(self, step: int, e: dict) -> None:
        kind = next(k for k in e if k != "atStep")
        body = e[kind]
        if kind == "join":
            self.arriving.append((step + 4, list(range(self.next_id, self.next_id + body))))
            self.next_id += body
        elif kind == "layout":
            self.apply(ev.LayoutRequested(parse_layout(body)))
        else:
            # The scenario names workers by their start order, which is their device id.
            (victim,) = body["workers"]
            if kind in ("preempt", "evict"):
                self.apply(ev.Notice(victim, 30.0, at=float(step)))
            else:                               # kill, hang (the watchdog's verdict)
                self.apply(ev.DeviceFailed(victim, kind))

    def commit(self, step: int, d: rules.Decision, *, recovered: bool = False) -> None:
        self.apply(SwitchEnded(True))
        self.apply(Committed(d.layout, step, d.reason, recovered=recovered,
                             displaced="re-requested after the recovery" if recovered else ""))
        self.acted.append((step, d.reason, tuple(d.layout.device_of)))
        if d.reason in rules.VOLUNTARY:
            self.policy.last_voluntary = float(step)
        for dev in set(self.state.doomed) - set(d.layout.device_of):   # left: their pods go
            self.apply(ev.DeviceLeft(dev))

    def tick(self, step: int) -> None:
        for at, new in [a for a in self.arriving if a[0] <= step]:
            self.arriving.remove((at, new))
            for d in new:
                self.apply(ev.DeviceUp(d, None))
        self.apply(js.Progressed(step))
        if self.flying is not None:
            aborts = [a for a in self.apply(Watch(now=float(step))) if isinstance(a, Abort)]
            if aborts:
                self.apply(SwitchEnded(False))
                self.aborted.append((step, aborts[0].why))
            else:
                self.commit(step, self.flying)
            self.flying = None
        for _ in range(4):                       # the real loop ticks several times a step
            acts = self.apply(Tick(now=float(step), policy=self.policy, profile=PROFILE,
                                   last_step_at=float(step), give_up_s=600.0))
            todo = [a for a in acts if isinstance(a, (rules.Switch, rules.Recover,
                                                      rules.GiveUp, rules.Park))]
            assert not any(isinstance(a, (rules.GiveUp, rules.Park)) for a in todo), \
                (step, todo)
            if not todo:
                return
            (a,) = todo
            s = self.state
            if isinstance(a, rules.Recover):     # recovery.recover: over the survivors
                (placed,) = self.apply(js.PlaceRecovery(self.policy, PROFILE))
                assert isinstance(placed, js.Place), (step, placed)
                self.apply(SwitchBegan(frozenset(s.members) | frozenset(placed.layout.device_of),
                                       placed.layout, "failure"))
                self.commit(step, rules.Decision(placed.layout, "failure", None),
                            recovered=True)
                continue
            involved = frozenset(s.members) | frozenset(a.decision.layout.device_of)
            self.apply(SwitchBegan(involved, a.decision.layout, a.decision.reason))
            if s.layout is None:                 # the start: nothing to wait for
                self.commit(step, a.decision)
                continue
            self.flying = a.decision             # committed at the next step, after its events
            return


def replay_scenario(sc: dict) -> Replay:
    job = job_from_manifest(overlap.job_manifest())
    r = Replay(job, sc["initialWorkers"])
    due: dict[int, list] = {}
    for e in sc["events"]:
        due.setdefault(e["atStep"], []).append(e)
    for step in range(overlap.STEPS):
        for e in due.get(step, []):
            r.event(step, e)
        r.tick(step)
        s = r.state
        live = set(s.agents) - set(s.doomed)
        # Acted on within a step: the running layout (or the target in flight) holds no
        # device that is gone, dead or doomed.
        target = r.flying.layout if r.flying is not None else s.layout
        assert set(target.device_of) <= live, (sc, step, target, live)
    r.tick(overlap.STEPS)                        # the last switch in flight ends
    return r


def check(r: Replay) -> None:
    """What overlap.judge asks of a run with events, as far as the state says it."""
    s = r.state
    assert s.layout is not None and not s.failed and s.flight is None
    for req in s.requests:                        # every request answered
        assert req.state in ("applied", "waiting", "superseded", "refused", "pending"), req
        assert req.answer, req
    last = s.pending_request
    if last is not None:                          # open: it says what it waits for
        assert last.layout.world > len(s.usable) or last.state == "pending", last
    if s.job.mode == "auto":                      # growth took what was there
        assert s.layout.world >= min(4, len(s.usable)) or s.layout.world == 4


def test_the_issues_scenario_a_notice_a_join_a_request_and_a_kill_a_few_steps_apart():
    # test_overlap.py's first scenario, on real workers there: each event lands while the
    # previous one is handled.
    r = replay_scenario({"initialWorkers": 4, "events": [
        {"atStep": 10, "preempt": {"workers": [3], "noticeSeconds": 30}},
        {"atStep": 11, "join": 2},
        {"atStep": 12, "layout": "dp=1,tp=2,pp=2"},
        {"atStep": 14, "kill": {"workers": [1]}},
    ]})
    check(r)
    (req,) = r.state.requests
    assert req.state == "applied", req          # once the joiners are up there is room
    assert r.state.layout.to_text() == "dp=1,tp=2,pp=2"
    assert [x[1] for x in r.acted].count("failure") == 1
    assert r.state.lost == ((1, "kill"),)


def test_a_kill_while_a_switch_prepares_aborts_it_and_the_job_recovers():
    # Device 3 is noticed at step 10: the switch that takes it out is in flight when 0, a
    # device of its target, is killed. The Prepare is aborted, and the job recovers.
    r = replay_scenario({"initialWorkers": 4, "events": [
        {"atStep": 10, "preempt": {"workers": [3], "noticeSeconds": 30}},
        {"atStep": 11, "kill": {"workers": [0]}},
    ]})
    check(r)
    assert r.aborted == [(11, "device(s) [0] lost")]
    assert [x[:2] for x in r.acted if x[0] >= 10] == [(11, "failure")]
    assert 0 not in r.state.layout.device_of and 3 not in r.state.layout.device_of


@pytest.mark.parametrize("seed", range(60))
def test_random_overlapping_events_replayed(seed):
    check(replay_scenario(overlap.random_scenario(seed)))

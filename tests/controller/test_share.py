"""The rule that divides a pool's GPUs between jobs (controller/share.py), by hand-worked cases:
gang minimums, max-min fair extras, priority levels, contention, and the sequences of the
issue's scenarios replayed as successive claims."""

from __future__ import annotations

import pytest

from dynatrain.controller.share import Claim, Share, divide


def job(name, held=0, waiting=0, *, lo=2, hi=4, prio=0, started=False, created=None,
        pool="p", gpus=1):
    return Claim(job=name, pool=pool, priority=prio, started=started,
                 created=created or f"2026-01-01T00:00:0{ord(name[-1]) % 10}Z",
                 min_workers=lo, max_workers=hi, gpus=gpus, held=held, waiting=waiting)


def workers(shares):
    return {k: s.workers for k, s in shares.items()}


def test_two_equal_jobs_on_six_gpus_settle_on_three_each():
    # A got 4, B 2 (and waits for 2 more): B is below its fair share and waits, so the pool
    # is contended and A's share (3) binds.
    s = divide([job("a", 4, 0, started=True), job("b", 2, 2, started=True)])
    assert workers(s) == {"a": 3, "b": 3}
    assert s["a"].contended and s["a"].cap(4) == 3 and s["b"].cap(4) == 3
    # Settled: each holds its share; the pending pods are demand, not contention.
    s = divide([job("a", 3, 1, started=True), job("b", 3, 1, started=True)])
    assert workers(s) == {"a": 3, "b": 3} and not s["a"].contended
    assert s["a"].cap(4) == 4


def test_a_third_job_takes_its_minimum_from_the_jobs_above_their_share():
    # C arrives with its pods waiting: 6 GPUs held, three minimums of 2 fit, nothing extra.
    s = divide([job("a", 3, 1, started=True), job("b", 3, 1, started=True), job("c", 0, 4)])
    assert workers(s) == {"a": 2, "b": 2, "c": 2} and s["c"].contended
    # Before its pods exist C waits for nothing: no contention yet, A and B keep theirs.
    s = divide([job("a", 3, 1, started=True), job("b", 3, 1, started=True), job("c", 0, 0)])
    assert not s["a"].contended and s["a"].cap(4) == 4


def test_a_gang_that_does_not_fit_gets_nothing_so_two_jobs_never_deadlock():
    # Two jobs of minimum 3 on 4 GPUs, each holding 2 and waiting for a third: the older one
    # gets its minimum (and the spare GPU), the younger nothing, so it lets its pods go.
    s = divide([job("a", 2, 1, lo=3), job("b", 2, 1, lo=3)])
    assert workers(s) == {"a": 4, "b": 0} and s["b"].contended
    assert s["b"].cap(4) == 0


def test_a_started_job_is_served_before_an_older_one_that_has_not_started():
    s = divide([job("a", 0, 3, lo=3, created="2026-01-01T00:00:00Z"),
                job("b", 4, 0, lo=3, started=True, created="2026-01-02T00:00:00Z")])
    assert workers(s) == {"a": 0, "b": 4}
    assert not s["b"].contended                   # a waits, but not below its share (0)


def test_higher_priority_is_served_in_full_before_lower():
    # A low job holds all 4; a high job arrives wanting 4: the low job's share is 0.
    s = divide([job("low", 4, 0, prio=100, started=True), job("high", 0, 4, prio=1000)])
    assert workers(s) == {"low": 0, "high": 4}
    # The high job at minWorkers 2, maximum 2: the low job keeps the other two.
    s = divide([job("low", 4, 0, prio=100, started=True),
                job("high", 0, 2, hi=2, prio=1000)])
    assert workers(s) == {"low": 2, "high": 2}


def test_fair_extras_count_gpus_and_ties_go_to_the_older_job():
    # 9 GPUs: a (2 GPUs/worker, min 1) and b (1 GPU/worker, min 1); extras go to whoever holds
    # the fewest GPUs in its share.
    s = divide([job("a", 3, 1, lo=1, hi=8, gpus=2, started=True),
                job("b", 3, 1, lo=1, hi=8, started=True)])
    # Minimums: a 2 GPUs, b 1 (6 left). Then b (1 < 2) -> 2; tie 2-2 to the older a -> 4;
    # b -> 3, b -> 4; tie 4-4 to a, which needs 2 of the 1 left: b -> 5. 4 + 5 = 9.
    assert workers(s) == {"a": 2, "b": 5}
    # Odd extras between equals: the older job gets the odd one.
    s = divide([job("a", 4, 1, hi=8), job("b", 3, 1, hi=8)])
    assert workers(s) == {"a": 4, "b": 3}


def test_pools_are_divided_apart():
    s = divide([job("a", 4, 0, pool="h100"), job("b", 0, 2, pool="a100")])
    assert workers(s) == {"a": 4, "b": 0}
    # b waits for capacity, not for another job: its own pool holds nothing to divide.
    assert not s["a"].contended and not s["b"].contended and s["b"].cap(4) == 4


def test_the_why_names_the_figures():
    s = divide([job("a", 4, 0, started=True), job("b", 2, 2, started=True)])
    assert "share 3 workers (3 GPUs) of the 6 GPUs" in s["a"].why
    assert "contended: b waits below its share" in s["a"].why


def test_bad_claims_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="gpus per worker must be >= 1"):
        job("a", gpus=0)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        job("a", held=-1)
    with pytest.raises(ValueError, match="one claim per job"):
        divide([job("a"), job("a")])


def test_scenario_replayed_two_jobs_then_a_third_then_it_ends():
    """The must-show scenario as successive pool states, each the result of acting on the
    shares before: every job settles, nobody waits for ever."""
    a = dict(held=4, waiting=0)
    b = dict(held=2, waiting=2)
    # 1. A got 4 first: B waits below its share; A is capped at 3 and shrinks live.
    s = divide([job("a", **a, started=True), job("b", **b, started=True)])
    assert s["a"].cap(4) == 3
    # 2. A shrank; B's waiting pod took the GPU; B deletes its other waiting pod (cap 3).
    s = divide([job("a", 3, 0, started=True), job("b", 3, 1, started=True)])
    assert workers(s) == {"a": 3, "b": 3} and not s["a"].contended
    # 3. C arrives; its pods wait: A and B are capped at 2, C at 2.
    s = divide([job("a", 3, 1, started=True), job("b", 3, 1, started=True), job("c", 0, 4)])
    assert [s[j].cap(4) for j in "abc"] == [2, 2, 2]
    # 4. Settled at 2/2/2: no one waits below its share.
    s = divide([job("a", 2, 0, started=True), job("b", 2, 0, started=True),
                job("c", 2, 0, started=True)])
    assert not s["c"].contended
    # 5. C ends (its claim goes): A and B grow into the freed GPUs (uncontended: max).
    s = divide([job("a", 2, 2, started=True), job("b", 2, 2, started=True)])
    assert s["a"].cap(4) == 4 and not s["a"].contended


def test_share_cap_is_the_wanted_count_when_uncontended():
    assert Share(2, False, "").cap(4) == 4 and Share(2, True, "").cap(4) == 2
    assert Share(6, True, "").cap(4) == 4


# -- the share in the decision function (event replays, no processes) -----------------------------

def _decide_setup():
    from dataclasses import replace as _replace
    from pathlib import Path

    from dynatrain.spec.hardware import PROFILES
    from dynatrain.spec.job import load_job
    root = Path(__file__).resolve().parents[2]
    job = load_job(root / "examples" / "quickstart.yaml")           # 1..4 workers
    profile = _replace(PROFILES["cpu"], shared_cores=0, memory_bytes=4 << 30)
    return job, profile


def test_replayed_a_job_over_its_share_shrinks_live_and_does_not_grow_past_it():
    from dataclasses import replace as _replace

    from dynatrain.controller import decide
    from dynatrain.controller.decide import Idle, Switch, View
    from dynatrain.controller.policy import Policy
    from dynatrain.vps.layout import parse_layout
    job, profile = _decide_setup()
    four = parse_layout("dp=4").with_devices([0, 1, 2, 3])
    policy = Policy(margin=100.0, cooldown_s=0.0)
    v = View(now=100.0, layout=four, usable=(0, 1, 2, 3), step=20, last_step_at=99.9,
             give_up_s=600.0)
    assert isinstance(decide.next_action(v, policy, job, profile), Idle)      # no share: keep
    a = decide.next_action(_replace(v, share=2), policy, job, profile)
    assert isinstance(a, Switch) and a.decision.reason == "rebalance"
    assert a.decision.layout.world == 2
    assert set(a.decision.layout.device_of) <= {0, 1, 2, 3}
    # At its share with more devices usable (pods not yet gone): no growth past the share.
    two = a.decision.layout
    after = _replace(v, layout=two, share=2, now=200.0)
    assert isinstance(decide.next_action(after, policy, job, profile), Idle)
    # The share lifted (the pool no longer contended): it grows again.
    grow = decide.next_action(_replace(after, share=None), policy, job, profile)
    assert isinstance(grow, Switch) and grow.decision.reason == "scale-up"


def test_replayed_a_share_under_the_minimum_never_starts_and_never_fails_a_running_job():
    from dataclasses import replace as _replace

    from dynatrain.controller import decide
    from dynatrain.controller.decide import Idle, View
    from dynatrain.controller.policy import Policy
    from dynatrain.vps.layout import parse_layout
    job, profile = _decide_setup()
    job = _replace(job, min_workers=2)
    policy = Policy(margin=100.0, cooldown_s=0.0)
    start = View(now=1.0, layout=None, usable=(0, 1), last_step_at=1.0, give_up_s=600.0,
                 share=1)
    assert isinstance(decide.next_action(start, policy, job, profile), Idle)
    running = View(now=100.0, layout=parse_layout("dp=2").with_devices([0, 1]),
                   usable=(0, 1), step=20, last_step_at=99.9, give_up_s=600.0, share=1)
    # A running job is not shrunk under its minimum by a share (a higher priority takes
    # those GPUs through the scheduler's preemption, which is a notice).
    assert isinstance(decide.next_action(running, policy, job, profile), Idle)


def test_a_floor_keeps_a_just_admitted_gang_while_the_freed_gpu_is_placed():
    """The CI livelock replayed: A and B shrank from 3 to 2 for C; C has one pod placed and
    one waiting for the GPU just freed. Counting only what is held (5), C's gang of 2 does not
    fit beside A's and B's minimums and C would give up its pods; the pool's floor (the 6 it
    held a moment ago) keeps C's share, so the others stay capped for it."""
    now = [job("a", 2, 0, started=True), job("b", 2, 0, started=True), job("c", 1, 1)]
    s = divide(now)
    # The old count: C is told to wait, and A may grow into the very GPU C waits for.
    assert workers(s) == {"a": 3, "b": 2, "c": 0}
    s = divide(now, {"p": 6})
    assert workers(s) == {"a": 2, "b": 2, "c": 2}
    assert s["a"].contended and s["a"].cap(4) == 2         # nobody grows into C's GPU
    assert "of the 6 GPUs its pool's 3 jobs hold" in s["c"].why
    # A floor never shrinks the pool, and it is per pool.
    assert workers(divide(now, {"p": 3})) == workers(divide(now))
    assert workers(divide(now, {"other": 6})) == workers(divide(now))

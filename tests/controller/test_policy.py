"""The controller's policy over the solver: when it switches, why, and onto which devices."""

from dataclasses import replace
from pathlib import Path

import pytest

from dynatrain.controller.costmodel import SolverError
from dynatrain.spec.hardware import PROFILES
from dynatrain.spec.job import load_job
from dynatrain.controller.policy import Policy
from dynatrain.vps.layout import parse_layout

ROOT = Path(__file__).resolve().parents[2]
# Every worker a device of its own, as on a cluster (and as `dynatrain run` models it).
PROFILE = replace(PROFILES["cpu"], shared_cores=0, memory_bytes=4 << 30)


@pytest.fixture
def job():
    return load_job(ROOT / "examples" / "quickstart.yaml")


def test_start_uses_the_workers_and_fits(job):
    d = Policy().decide(job, PROFILE, None, [0, 1, 2, 3], set(), 0)
    assert d.reason == "start" and sorted(d.layout.device_of) == [0, 1, 2, 3]
    assert d.estimate.fits


def test_notice_forces_a_switch_off_the_doomed_device(job):
    p = Policy()
    current = p.decide(job, PROFILE, None, [0, 1, 2, 3], set(), 0).layout
    d = p.decide(job, PROFILE, current, [0, 1, 2], {3}, 10)
    assert d.reason == "preemption" and 3 not in d.layout.device_of
    assert set(d.layout.device_of) <= {0, 1, 2}


def test_new_capacity_grows_to_the_maximum_after_the_cooldown(job):
    p = Policy(margin=100.0, cooldown_s=3600)    # growth does not wait for an estimate
    three = p.decide(job, PROFILE, None, [0, 1, 2], set(), 0).layout
    d = p.decide(job, PROFILE, three, [0, 1, 2, 3, 4], set(), 20)
    assert d is not None and d.reason == "scale-up" and 3 in d.layout.device_of
    assert d.layout.world == 4              # 5 devices: no layout of a 12-batch uses 5
    p.record_voluntary()
    assert p.decide(job, PROFILE, three, [0, 1, 2, 3], set(), 21) is None   # cooling down


def test_better_layout_for_the_same_devices_needs_the_margin(job):
    poor = parse_layout("tp=4").with_devices([0, 1, 2, 3])
    assert Policy(margin=100.0).decide(job, PROFILE, poor, [0, 1, 2, 3], set(), 20) is None
    d = Policy(margin=1.0).decide(job, PROFILE, poor, [0, 1, 2, 3], set(), 20)
    assert d is not None and d.reason == "better-layout" and d.layout.to_text() != "dp=1,tp=4,pp=1"
    assert d.estimate.tokens_per_second > 0


def test_no_voluntary_switch_near_the_end(job):
    p = Policy(margin=1.0, min_steps_left=5)
    two = p.decide(job, PROFILE, None, [0, 1], set(), 0).layout
    assert p.decide(job, PROFILE, two, [0, 1, 2, 3], set(), job.training.steps - 2) is None


def test_requested_layout_wins_and_keeps_data_in_place(job):
    p = Policy()
    current = p.decide(job, PROFILE, None, [0, 1, 2, 3], set(), 0).layout
    fixed = replace(job, mode="fixed", layout=parse_layout("dp=1,tp=2,pp=2"))
    d = p.decide(fixed, PROFILE, current, [0, 1, 2, 3], set(), 30)
    assert d.reason == "requested" and d.layout.to_text() == "dp=1,tp=2,pp=2"
    assert sorted(d.layout.device_of) == [0, 1, 2, 3]
    assert p.decide(fixed, PROFILE, d.layout, [0, 1, 2, 3], set(), 31) is None


def test_too_few_workers_is_an_error_naming_min_workers(job):
    strict = replace(job, min_workers=3)
    current = Policy().decide(strict, PROFILE, None, [0, 1, 2, 3], set(), 0).layout
    with pytest.raises(SolverError, match="minWorkers"):
        Policy().decide(strict, PROFILE, current, [0, 1], {2, 3}, 5)


def test_parallelism_limits_bound_the_solver(job):
    from dynatrain.spec.job import Limits

    free = Policy().decide(job, PROFILE, None, [0, 1, 2, 3], set(), 0).layout
    bounded = replace(job, limits=Limits(max_pp=1, max_tp=1, zero_stages=(0,)))
    d = Policy().decide(bounded, PROFILE, None, [0, 1, 2, 3], set(), 0)
    assert d.layout.pp == 1 and d.layout.tp == 1 and d.layout.zero == 0
    assert free.world == d.layout.world == 4


def test_scaling_down_keeps_the_devices_that_move_the_fewest_bytes(job):
    import itertools

    from dynatrain.vps.placement import place_devices
    from dynatrain.vps.planner import plan_switch

    # Four pipeline stages on devices 5, 3, 0, 6 (rank order); two workers wanted.
    current = parse_layout("dp=1,tp=1,pp=4").with_devices([5, 3, 0, 6])
    d = Policy(cooldown_s=3600).decide(replace(job, workers=2), PROFILE, current,
                                       [0, 3, 5, 6], set(), 10)
    assert d.reason == "scale-down" and d.layout.world == 2
    moved = {keep: sum(plan_switch(job.model, current, place_devices(
        job.model, current, d.estimate.layout, keep)).need.values())
        for keep in itertools.combinations([0, 3, 5, 6], 2)}
    best = min(moved.values())
    assert sorted(d.layout.device_of) == [5, 6]       # first and last stage (embeddings)
    assert moved[(5, 6)] == best and sorted(moved.values())[1] > best
    assert moved[(0, 3)] > best                       # the lowest ids would move more


def test_scaling_down_waits_for_nothing_and_stops_at_the_wanted_count(job):
    p = Policy(cooldown_s=3600)
    p.record_voluntary()                              # a cooldown does not hold it back
    current = parse_layout("dp=4,tp=1,pp=1").with_devices([0, 1, 2, 3])
    d = p.decide(replace(job, workers=3), PROFILE, current, [0, 1, 2, 3], set(), 10)
    assert d.reason == "scale-down" and d.layout.world <= 3
    assert p.decide(replace(job, workers=4), PROFILE, current, [0, 1, 2, 3], set(), 10) is None

"""The running job's measurements fed back to the cost model (#38 item 1): the ratios by hand,
the calibrated profile's estimates, the ratios kept over generations, and decisions replayed
that change with them (minEfficiency releases a worker over slow links; a layout the job ran
and measured slower is not chosen again as better); a live run logs its calibration."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from dynatrain.controller import decide, feedback
from dynatrain.controller.costmodel import Estimate, estimate
from dynatrain.controller.decide import Idle, Switch, View
from dynatrain.controller.feedback import Factors, Feedback, calibrated, factors
from dynatrain.controller.measured import MIN_STEPS, StepCosts
from dynatrain.controller.policy import Policy
from dynatrain.spec.hardware import PROFILES
from dynatrain.spec.job import job_from_manifest as parse_job
from dynatrain.vps.layout import parse_layout
from dynatrain.vps.presets import PRESETS

H100 = PROFILES["h100"]
DP4 = parse_layout("dp=4,tp=1,pp=1").with_devices([0, 1, 2, 3])


def measured(compute: dict[int, float], step: float, layout=DP4, generation: int = 3):
    costs = StepCosts(alpha=1.0)
    for _ in range(1 + MIN_STEPS):
        for d in layout.device_of:
            costs.add(d, generation, {"step": step, "compute": compute[d],
                                      "communication": step - compute[d], "redundancy": 0.0})
    return costs.measurement(layout, predicted_seconds=0.1)


def predicted(**breakdown) -> Estimate:
    parts = {**dict(compute=0.0, bubble=0.0, tp_comm=0.0, ep_comm=0.0, pp_comm=0.0,
                    dp_comm=0.0, zero_comm=0.0, optimizer=0.0, other=0.0), **breakdown}
    return Estimate(layout=DP4, tokens_per_second=1.0, step_seconds=sum(parts.values()),
                    memory_bytes=0, breakdown=parts, fits=True)


def step5(k: int) -> float:
    """1.05^k, as the ratios are rounded."""
    return round(math.exp(k * math.log1p(0.05)), 4)


def test_the_ratios_by_hand():
    # Predicted: 100 ms computing + 20 ms optimizer, 10 + 20 ms of collectives.
    p = predicted(compute=0.100, optimizer=0.020, tp_comm=0.010, dp_comm=0.020)
    # Measured: devices 0-2 compute 230-250 ms, device 3 is a straggler at 600 ms; the step
    # is 660 ms. Compute: the stage's median, 245 ms, over 120 ms = 2.04 -> 1.05^15 = 2.079
    # (the straggler is its own rule's business, not the profile's). Waits: 660 - 600 = 60 ms
    # (what the slowest device, which waits for no one, spends in collectives) over 30 ms =
    # 2.0 -> 1.05^14 = 1.980.
    m = measured({0: 0.240, 1: 0.250, 2: 0.230, 3: 0.600}, step=0.660)
    assert factors(m, p) == Factors(step5(15), step5(14)) == Factors(2.0789, 1.9799)


def test_memory_measured_over_its_prediction_shrinks_the_room_a_layout_may_fill():
    costs = StepCosts(alpha=1.0)
    for _ in range(1 + MIN_STEPS):
        for d in DP4.device_of:
            costs.add(d, 3, {"step": 0.3, "compute": 0.2, "communication": 0.1,
                             "redundancy": 0.0, "memory": float(3 << 30)})
    m = costs.measurement(DP4, predicted_seconds=0.3)
    est = replace(predicted(compute=0.1, dp_comm=0.05), memory_bytes=2 << 30)
    # 3 GiB measured over 2 GiB predicted: 1.5 -> 1.05^8 = 1.4775.
    assert factors(m, est).memory == step5(8) == 1.4775
    model, lay = PRESETS["gpt-350m"], parse_layout("dp=2")
    kw = dict(global_batch_size=32, seq_len=1024)
    need = estimate(model, lay, H100, **kw).memory_bytes
    room = replace(H100, memory_bytes=int(need * 1.2))          # fits with 20% to spare
    assert estimate(model, lay, room, **kw).fits
    # Measured to need 48% more than predicted: it no longer fits.
    assert not estimate(model, lay, calibrated(room, Factors(memory=step5(8))), **kw).fits
    # A model that overestimates memory never makes more room.
    assert calibrated(room, Factors(memory=0.5)).memory_bytes == room.memory_bytes


def test_a_layout_with_nothing_to_wait_for_says_nothing_about_the_links():
    m = measured({0: 0.2, 1: 0.2, 2: 0.2, 3: 0.2}, step=0.25)
    assert factors(m, predicted(compute=0.1)).waits == 1.0
    # More than 30x off: the profile describes other devices (CPU workers priced as H100s);
    # scaling it by one clamped ratio would skew compute against communication. Not used.
    assert factors(measured({d: 50.0 for d in range(4)}, step=50.0),
                   predicted(compute=0.001, dp_comm=0.001)) is None
    assert factors(measured({d: 0.2 for d in range(4)}, step=50.0),
                   predicted(compute=0.1, dp_comm=0.001)) is None


def test_the_calibrated_profile_scales_each_part_of_an_estimate():
    model, lay = PRESETS["gpt-350m"], parse_layout("dp=4")
    kw = dict(global_batch_size=32, seq_len=1024)
    base = estimate(model, lay, H100, **kw).breakdown
    slow = estimate(model, lay, calibrated(H100, Factors(2.0, 3.0)), **kw).breakdown
    assert slow["compute"] == pytest.approx(2 * base["compute"], rel=1e-12)
    assert slow["optimizer"] == pytest.approx(2 * base["optimizer"], rel=1e-12)
    assert slow["other"] == pytest.approx(3 * base["other"], rel=1e-12)       # a latency
    # The gradient all-reduce: its link time x3, its bucket packing (memory-bound) x2.
    assert 2 * base["dp_comm"] < slow["dp_comm"] < 3 * base["dp_comm"]
    assert calibrated(H100, Factors()) is H100
    assert "measured: compute x2.00, waits x3.00, memory x1.00" in \
        calibrated(H100, Factors(2.0, 3.0)).name


def test_the_ratios_of_the_last_generations_are_averaged():
    fb = Feedback()
    assert fb.factors == Factors()
    p = predicted(compute=0.1, dp_comm=0.1)
    for gen, (c, w) in enumerate([(0.4, 0.1), (0.2, 0.2), (0.2, 0.4), (0.2, 0.8)], 1):
        fb.add(gen, measured({d: c for d in range(4)}, step=c + w, generation=gen), p)
    # Generations 2-4 are kept (2x compute each; waits 2x, 4x, 8x): geometric means 2 and 4.
    assert sorted(fb.by_generation) == [2, 3, 4]
    assert fb.factors == Factors(step5(14), step5(28))
    assert fb.steps == {"dp=4,tp=1,pp=1": pytest.approx(1.0)}


# -- decisions that change with the measured figures ---------------------------------------------
def job(**spec) -> object:
    doc = {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
           "metadata": {"name": "fb"},
           "spec": {"model": {"preset": "gpt-350m"}, "resources": {"gpus": 1},
                    "elastic": {"minWorkers": 1, "maxWorkers": 8},
                    "parallelism": {"mode": "auto", "rebalance": {"enabled": True}},
                    "globalBatchSize": 32, "training": {"steps": 100, "seqLen": 1024}}}
    for key, value in spec.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value}
    return parse_job(doc)


def test_over_links_measured_30x_slower_a_second_worker_does_not_pay():
    # The second worker must add 0.9 of the per-worker throughput of 2. On the H100 preset it
    # adds 17,563 tok/s, over 0.9 x 17,756; over links 30x slower than the preset (a network
    # that is not the datasheet's), 13,613, under 0.9 x 15,780: one worker.
    j = job(elastic={"minEfficiency": 0.9})
    assert Policy().efficient_workers(j, H100, 8) == 2
    slow_links = calibrated(H100, Factors(1.0, 30.0))
    assert Policy().efficient_workers(j, slow_links, 8) == 1
    assert "2: 31,561 tok/s (15,780/worker)" in Policy().efficiency_note(j, slow_links, 8)


def test_a_layout_the_job_ran_and_measured_slower_is_not_chosen_again_as_better():
    j = job(elastic={"maxWorkers": 4})
    tp4 = parse_layout("dp=1,tp=4,pp=1").with_devices([0, 1, 2, 3])
    base = dict(now=100.0, layout=tp4, usable=(0, 1, 2, 3), step=10, last_step_at=99.9,
                give_up_s=600.0)
    policy = Policy(cooldown_s=0.0)
    # The cost model prefers another layout of the 4 devices to tp=4 ...
    first = decide.next_action(View(**base), policy, j, H100)
    assert isinstance(first, Switch) and first.decision.reason == "better-layout", first
    better = first.decision.layout.to_text()
    # ... but the job ran it, and it measured slower than tp=4 does: it stays.
    ran = {better: 0.30, tp4.to_text(): 0.25}
    assert isinstance(decide.next_action(View(**base, measured_steps=ran), policy, j, H100),
                      Idle)
    # Measured faster by more than the margin: the model's choice stands.
    ran = {better: 0.20, tp4.to_text(): 0.25}
    again = decide.next_action(View(**base, measured_steps=ran), policy, j, H100)
    assert isinstance(again, Switch) and again.decision.layout.to_text() == better


def test_the_decisions_read_the_calibrated_profile_only_with_rebalance_on():
    from dynatrain.controller.core import JobController
    from dynatrain.controller.jobstate import JobState

    for enabled in (True, False):
        ctl = JobController.__new__(JobController)
        ctl.state = JobState(job(parallelism={"rebalance": {"enabled": enabled}}))
        ctl.profile, ctl.feedback = H100, Feedback()
        ctl.feedback.by_generation[1] = Factors(step5(14), step5(22))
        want = calibrated(H100, Factors(step5(14), step5(22))) if enabled else H100
        assert ctl.decision_profile == want, enabled


def test_the_log_line_says_whether_a_generation_calibrated():
    fb = Feedback()
    fb.add(1, measured({d: 0.2 for d in range(4)}, step=0.3, generation=1),
           predicted(compute=0.1, dp_comm=0.1))
    assert feedback.describe(fb, 1).startswith(
        "calibrated: compute x1.98, waits x1.00, memory x1.00 the cost model's figures, "
        "measured over 1 generation(s)")
    # 50 s measured against 1 ms predicted: CPU workers priced as H100s.
    fb.add(2, measured({d: 50.0 for d in range(4)}, step=50.0, generation=2),
           predicted(compute=0.001, dp_comm=0.001))
    assert feedback.describe(fb, 2).startswith(
        "not calibrated: generation 2 measured over 30x off the cost model's compute or waits")
    assert fb.factors == Factors(step5(14), 1.0)      # the first generation's, as they were

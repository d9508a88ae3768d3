"""The measured step cost (dynatrain.controller.measured): smoothing, stages, the ratio to the
cost model's prediction, by hand-computed cases (no processes). A local run that reports these
figures is in test_run.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dynatrain.controller.measured import MIN_STEPS, StepCosts
from dynatrain.vps.layout import parse_layout

# Ranks in tp, dp, pp order: stage 0 holds devices 4 and 5, stage 1 devices 6 and 7.
PIPE = parse_layout("dp=2,tp=1,pp=2").with_devices([4, 5, 6, 7])


def _step(step: float, compute: float, communication: float = 0.0) -> dict[str, float]:
    return {"step": step, "compute": compute, "communication": communication,
            "redundancy": step - compute - communication}


def test_the_first_step_is_left_out_and_the_rest_smoothed():
    costs = StepCosts(alpha=0.5)
    for step in (10.0, 1.0, 3.0):          # 10 s: the generation's warm-up step
        costs.add(4, 1, _step(step, step))
    dev = costs.devices[4]
    assert (dev.seen, dev.steps) == (3, 2)
    assert dev.means["step"] == pytest.approx(0.5 * 1.0 + 0.5 * 3.0)      # 2.0


def test_a_stage_is_as_slow_as_its_slowest_device_and_the_job_as_its_slowest_step():
    costs = StepCosts(alpha=1.0)            # the newest step only: figures read off directly
    split = {4: _step(0.50, 0.30, 0.15), 5: _step(0.50, 0.20, 0.25),
             6: _step(0.45, 0.10, 0.30), 7: _step(0.50, 0.05, 0.40)}
    for _ in range(1 + MIN_STEPS):
        for device, values in split.items():
            costs.add(device, 2, values)
    m = costs.measurement(PIPE, predicted_seconds=0.40)
    assert m is not None and m.steps == MIN_STEPS and m.generation == 2
    assert m.stage_compute == (0.30, 0.10)
    assert m.imbalance == pytest.approx(0.30 / 0.20)                       # 1.5
    assert m.step_seconds == 0.50 and m.ratio == pytest.approx(0.50 / 0.40)  # 1.25
    assert m.communication_seconds == 0.40
    assert m.summary()["stage_compute_seconds"] == [0.3, 0.1]
    assert "x1.25" in str(m) and "imbalance 1.50" in str(m)


def test_forward_backward_and_memory_are_shown_by_stage_and_device():
    costs = StepCosts(alpha=1.0)
    parts = {4: (0.10, 0.18, 3.0), 5: (0.12, 0.20, 2.5),     # forward, backward, GiB
             6: (0.09, 0.06, 1.0), 7: (0.04, 0.10, 1.5)}     # stage 2: 6 slower, 7 more bwd
    for _ in range(1 + MIN_STEPS):
        for device, (fwd, bwd, gib) in parts.items():
            costs.add(device, 2, {**_step(0.5, fwd + bwd + 0.01), "forward": fwd,
                                  "backward": bwd, "memory": gib * (1 << 30)})
    m = costs.measurement(PIPE, predicted_seconds=0.40, predicted_memory=2 << 30)
    # Each stage's forward and backward are its slowest device's (in compute), so they add
    # up to no more than the stage's compute: stage 2's are device 6's 0.09 + 0.06 of its
    # 0.16, not the per-part maxima 0.09 + 0.10 of two devices (a CI run on 2026-11-29, dp=4
    # with shares 6+9+6+3, measured such a sum above its compute). The device with the most
    # memory.
    assert m.stage_compute == pytest.approx((0.33, 0.16))
    assert m.stage_forward == (0.12, 0.09) and m.stage_backward == (0.20, 0.06)
    for f, b, c in zip(m.stage_forward, m.stage_backward, m.stage_compute):
        assert f + b <= c
    assert m.memory_bytes == 3 << 30 and m.predicted_memory_bytes == 2 << 30
    assert "forward/backward 0.120+0.200/0.090+0.060" in str(m)
    assert "memory 3.00 GiB vs 2.00 predicted" in str(m)
    assert m.summary()["stage_backward_seconds"] == [0.2, 0.06]
    # Workers that report no split: nothing is printed of it.
    plain = StepCosts(alpha=1.0)
    for _ in range(1 + MIN_STEPS):
        for device in PIPE.device_of:
            plain.add(device, 2, _step(0.5, 0.3))
    assert "forward" not in str(plain.measurement(PIPE, 0.4))
    assert "memory" not in str(plain.measurement(PIPE, 0.4))


def test_no_measurement_until_every_device_has_its_steps():
    costs = StepCosts()
    for _ in range(1 + MIN_STEPS):
        for device in (4, 5, 6):            # device 7 has reported nothing yet
            costs.add(device, 1, _step(1.0, 0.5))
    assert costs.measurement(PIPE, 1.0) is None
    costs.add(7, 1, _step(1.0, 0.5))        # its warm-up step: still none counted
    assert costs.steps(PIPE) == 0 and costs.measurement(PIPE, 1.0) is None


def test_a_new_generation_starts_again_and_an_older_ones_records_are_ignored():
    costs = StepCosts(alpha=1.0)
    for _ in range(3):
        costs.add(4, 1, _step(2.0, 2.0))
    costs.add(4, 2, _step(9.0, 9.0))        # the new layout's warm-up
    costs.add(4, 1, _step(5.0, 5.0))        # a late record of the old generation
    costs.add(4, 2, _step(1.0, 1.0))
    assert costs.generation == 2 and costs.devices[4].steps == 1
    assert costs.devices[4].means["step"] == 1.0


def test_without_a_prediction_the_ratio_is_zero_and_not_printed():
    costs = StepCosts(alpha=1.0)
    one = parse_layout("dp=1").with_devices([3])
    for _ in range(1 + MIN_STEPS):
        costs.add(3, 1, _step(0.2, 0.2))
    m = costs.measurement(one, predicted_seconds=0.0)
    assert m.ratio == 0.0 and "predicted" not in str(m) and m.imbalance == 1.0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"alpha=0 must be in \(0, 1\]"):
        StepCosts(alpha=0)
    with pytest.raises(ValueError, match=r"\['wait'\] are not among"):
        StepCosts().add(0, 1, {"step": 1.0, "wait": 0.5})


def test_an_moe_jobs_tokens_per_expert_show_its_skew_and_its_busiest_ep_rank():
    # 4 experts, ep=2: rank 0 holds experts 0-1, rank 1 experts 2-3. Two data-parallel ranks
    # report each step; the sums run over the generation.
    lay = parse_layout("dp=2,ep=2").with_devices([0, 1])
    costs = StepCosts(alpha=1.0)
    for _ in range(1 + MIN_STEPS):
        for device, tokens in ((0, (10, 20, 5, 5)), (1, (20, 10, 5, 5))):
            costs.add(device, 3, _step(0.1, 0.1))
            costs.add_experts(device, 3, tokens)
    m = costs.measurement(lay, predicted_seconds=0.1)
    steps = 1 + MIN_STEPS
    assert m.expert_tokens == (30 * steps, 30 * steps, 10 * steps, 10 * steps) and m.ep == 2
    assert m.expert_skew == pytest.approx(30 / 20)              # busiest 30 of a mean 20
    assert m.ep_imbalance == pytest.approx(60 / 40)             # rank 0: 60 of a mean 40
    assert m.summary()["ep_imbalance"] == 1.5 and "over the 2 EP ranks 1.50" in str(m)
    # Even routing over the ranks, skewed within one: the exchange waits for nobody.
    assert replace(m, stage_expert_tokens=((30, 10, 10, 30),)).ep_imbalance == 1.0
    assert replace(m, ep=1).ep_imbalance == 1.0
    # A new generation (another layout) counts afresh; a record of an old one is ignored.
    costs.add(0, 4, _step(0.1, 0.1))
    costs.add_experts(0, 3, (1, 1, 1, 1))
    assert costs.expert_tokens == {}
    costs.add_experts(0, 4, (1, 2, 3, 4))
    assert costs.expert_tokens == {0: [1, 2, 3, 4]}
    with pytest.raises(ValueError, match="3 experts reported, 4 before"):
        costs.add_experts(1, 4, (1, 2, 3))
    # Dense: nothing reported, nothing shown.
    dense = StepCosts(alpha=1.0)
    for _ in range(1 + MIN_STEPS):
        dense.add(0, 1, _step(0.1, 0.1))
        dense.add(1, 1, _step(0.1, 0.1))
        dense.add_experts(0, 1, ())
    m = dense.measurement(parse_layout("dp=2").with_devices([0, 1]), predicted_seconds=0.1)
    assert m.expert_tokens == () and "expert_tokens" not in m.summary() and "EP" not in str(m)


def test_each_pipeline_stage_shows_its_own_layers_routing():
    # pp=2, dp=2, ep=2 (ranks: stage 0 devices 4 and 5, stage 1 devices 6 and 7). Stage 0's
    # layers send most tokens to experts 0-1 (EP rank 0); stage 1's route evenly.
    costs = StepCosts(alpha=1.0)
    sent = {4: (30, 30, 5, 5), 5: (25, 25, 10, 10), 6: (10, 10, 10, 10), 7: (10, 10, 10, 10)}
    for _ in range(1 + MIN_STEPS):
        for device, tokens in sent.items():
            costs.add(device, 1, _step(0.1, 0.1))
            costs.add_experts(device, 1, tokens)
    m = costs.measurement(parse_layout("dp=2,pp=2,ep=2").with_devices([4, 5, 6, 7]), 0.1)
    steps = 1 + MIN_STEPS
    assert m.stage_expert_tokens == ((55 * steps, 55 * steps, 15 * steps, 15 * steps),
                                     (20 * steps,) * 4)
    assert m.stage_ep_imbalance == pytest.approx((110 * 2 / 140, 1.0))   # 1.571, 1.0
    assert m.ep_imbalance == pytest.approx((75 + 75) * 2 / 220)          # all stages: 1.364
    assert "(by stage 1.57/1.00)" in str(m), str(m)
    assert m.summary()["stage_ep_imbalance"] == [1.5714, 1.0]

"""Live stage rebalancing from measured costs (#38): the rule (dynatrain.controller.decide
.rebalance, .balanced_stages) as hand-computed cases and event replays without processes, its
spec section, and one run on real workers with one device slowed (DYNATRAIN_SLOWDOWN), against
the same run without rebalancing.

``benchmarks/rebalance.py`` prints the step times side by side with every uneven split."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from dynatrain.controller import decide, layercost
from dynatrain.controller.costmodel import estimate
from dynatrain.controller.decide import Idle, Switch, View, balanced_stages
from dynatrain.controller.measured import MIN_STEPS, StepCosts
from dynatrain.controller.policy import Policy, estimate_kwargs
from dynatrain.spec.hardware import PROFILES
from dynatrain.spec.job import JobError, job_from_manifest as parse_job
from dynatrain.vps.faults import slowdown
from dynatrain.vps.layout import parse_layout

PROFILE = replace(PROFILES["cpu"], shared_cores=0, memory_bytes=4 << 30)
PIPE = parse_layout("dp=1,tp=1,pp=2").with_devices([0, 1])     # gpt-tiny: 4 layers, 2 + 2


def manifest(rebalance: dict | None = None, mode: str = "auto", steps: int = 40) -> dict:
    """gpt-tiny on 2 workers where the only layout is dp=1,tp=1,pp=2: a global batch of 1
    leaves dp=1, and maxTP=1 leaves the pipeline."""
    par = {"mode": mode, **({"limits": {"maxTP": 1}} if mode == "auto" else
                            {"layout": "dp=1,tp=1,pp=2"})}
    if rebalance is not None:
        par["rebalance"] = rebalance
    return {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": "reb"},
            "spec": {"model": {"preset": "gpt-tiny"}, "resources": {"gpus": 0},
                     "elastic": {"minWorkers": 2, "maxWorkers": 2}, "parallelism": par,
                     "globalBatchSize": 1, "training": {"steps": steps, "seqLen": 64}}}


JOB = parse_job(manifest({"enabled": True}))


def measured(compute: tuple[float, float], step: float = 0.10, layout=PIPE):
    """A measurement of ``layout`` whose stages computed ``compute`` seconds per step."""
    costs = StepCosts(alpha=1.0)
    for _ in range(1 + MIN_STEPS):
        for rank, device in enumerate(layout.device_of):
            stage = layout.coords(rank)[0]
            costs.add(device, 3, {"step": step, "compute": compute[stage],
                                  "communication": step - compute[stage], "redundancy": 0.0})
    return costs.measurement(layout, predicted_seconds=0.02)


def view(m, **kw) -> View:
    base = dict(now=100.0, layout=PIPE, usable=(0, 1), step=10, last_step_at=99.9,
                give_up_s=600.0, measurement=m, switch_cost_s=0.05)
    return View(**{**base, **kw})


def act(v: View, job=JOB, policy: Policy | None = None):
    return decide.next_action(v, policy or Policy(), job, PROFILE)


# -- the split ------------------------------------------------------------------------------------
@pytest.mark.parametrize("compute, stages, expected", [
    # 2 + 2 layers, stage 1's device 3x slower: per layer 0.01 and 0.03 s. Layers go one at a
    # time where they cost least: (1,1) -> stage 0 at 0.02 vs 0.06 -> (2,1) -> 0.03 vs 0.06
    # -> (3,1): slowest stage 0.03 s (was 0.06).
    ((0.02, 0.06), (2, 2), (3, 1)),
    ((0.04, 0.04), (2, 2), (2, 2)),               # even: no change
    ((0.06, 0.02), (2, 2), (1, 3)),               # the mirror image
    # 3 stages of 4 layers, the middle 2x slower: per layer 0.01, 0.02, 0.01. Greedy from
    # (1,1,1): 0.02/0.04/0.02 -> stage 0 (2,1,1), then stage 2 (2,1,2) [0.03 < 0.04, tie on
    # the earlier], ... -> (5,2,5): 0.05, 0.04, 0.05.
    ((0.04, 0.08, 0.04), (4, 4, 4), (5, 2, 5)),
])
def test_balanced_stages_by_hand(compute, stages, expected):
    assert balanced_stages(compute, stages) == expected


def test_what_a_stage_computes_whatever_its_layers_stays_with_it():
    # 8 layers on 2 stages, 4 + 4, measured 0.4 s and 0.7 s, of which 0.4 s on stage 1 is the
    # head and loss: its layers cost 0.075 s each, stage 0's 0.1 s. 6 + 2 then gives
    # max(0.6, 0.4 + 0.15) = 0.6 s, 5 + 3 max(0.5, 0.625) = 0.625 s. Spread over the layers
    # (0.175 s each on stage 1) the head would seem to leave with them, and 5 + 3 (0.525 s
    # by that reckoning, 0.625 s in fact) would win.
    assert balanced_stages((0.4, 0.7), (4, 4), (0.0, 0.4)) == (6, 2)
    assert balanced_stages((0.4, 0.7), (4, 4)) == (5, 3)


def test_the_per_layer_model_is_the_cost_model_on_every_split():
    job = parse_job(manifest())
    model = layercost.stage_model(job, PIPE, (2, 2), PROFILE)
    assert model is not None
    (fixed0, fixed1), (layer0, layer1) = model
    assert layer0 == pytest.approx(layer1, rel=1e-12)           # the blocks are alike
    # Stage 0's embedding lookup is small; stage 1's final norm, head and loss over gpt-tiny's
    # 2,048-token vocabulary cost most of a block.
    assert 0 < fixed0 < 0.1 * layer0 and 0.5 * layer1 < fixed1 < layer1, model
    for split in ((1, 3), (3, 1)):
        priced = estimate(job.model, replace(PIPE, devices=None, stages=split), PROFILE,
                          **estimate_kwargs(job)).stage_compute
        assert priced == pytest.approx((fixed0 + split[0] * layer0, fixed1 + split[1] * layer1),
                                       rel=1e-9)
    # A middle stage holds layers only; with one layer on a stage the model adds one to it.
    (f0, f_mid, f2), _ = layercost.stage_model(job, parse_layout("pp=3"), (2, 1, 1), PROFILE)
    assert f_mid == pytest.approx(0.0, abs=1e-12) and f2 == pytest.approx(fixed1, rel=1e-9)
    # Nothing to move: every stage holds one layer.
    assert layercost.stage_model(job, parse_layout("pp=4"), (1, 1, 1, 1), PROFILE) is None


def test_balanced_stages_refuses_mismatched_input():
    with pytest.raises(ValueError, match="must name the same stages"):
        balanced_stages((0.1, 0.2), (4,))


# -- the rule -----------------------------------------------------------------------------------
def test_a_slow_stage_is_rebalanced_live():
    a = act(view(measured((0.02, 0.06))))
    assert isinstance(a, Switch) and a.decision.reason == "rebalance"
    assert a.decision.layout.stages == (3, 1)
    assert a.decision.layout.device_of == (0, 1)          # the same devices, layers moved


@pytest.mark.parametrize("case, kw, job, policy", [
    ("off by default", {}, parse_job(manifest()), None),
    ("under the threshold (1.10 < 1.15)", {"measurement": measured((0.0380, 0.0456))}, JOB,
     None),
    ("a request waits: it is the user's layout",
     {"request": decide.Request(parse_layout("dp=2"))}, JOB, None),
    ("the switch would not pay back: 0.03 s x 50 steps < 2 s", {"switch_cost_s": 2.0}, JOB,
     None),
    ("near the job's end", {"step": 38}, JOB, None),
    ("within the voluntary cooldown", {}, JOB, Policy(last_voluntary=95.0)),
    ("a measurement of another layout", {"measurement": measured(
        (0.02, 0.06), layout=parse_layout("dp=1,tp=1,pp=2,stages=3+1").with_devices([0, 1]))},
     JOB, None),
])
def test_no_rebalance_when(case, kw, job, policy):
    v = view(kw.pop("measurement", measured((0.02, 0.06))), **kw)
    a = act(v, job, policy)
    assert not (isinstance(a, Switch) and a.decision.reason == "rebalance"), case


def test_replayed_a_rebalance_is_judged_again_on_its_own_measurement():
    # Events as the controller sees them: a measurement of the even split (stage 1 slow),
    # the rebalance to 3+1, then the new generation's own measurement, now even enough.
    first = act(view(measured((0.02, 0.06))))
    assert isinstance(first, Switch)
    rebalanced = first.decision.layout
    after = measured((0.030, 0.032), step=0.07, layout=rebalanced)
    nothing = act(view(after, layout=rebalanced, now=200.0))
    assert isinstance(nothing, Idle)
    # The policy never takes the split back as a "better layout" (it prices degrees only).
    assert isinstance(act(view(None, layout=rebalanced, now=300.0)), Idle)


# -- the spec -----------------------------------------------------------------------------------
def test_the_spec_section_and_its_errors():
    job = parse_job(manifest({"enabled": True, "threshold": 1.3, "paybackSteps": 20}))
    assert (job.rebalance.enabled, job.rebalance.threshold, job.rebalance.payback_steps) == \
        (True, 1.3, 20)
    assert not parse_job(manifest()).rebalance.enabled
    with pytest.raises(JobError, match=r"rebalance.threshold=1.0 must be > 1"):
        parse_job(manifest({"enabled": True, "threshold": 1.0}))
    with pytest.raises(JobError, match=r"rebalance applies only to mode auto"):
        parse_job(manifest({"enabled": True}, mode="fixed"))


def test_the_slowdown_setting_is_checked(monkeypatch):
    monkeypatch.setenv("DYNATRAIN_SLOWDOWN", "device:1,factor:2.5")
    assert slowdown(1) == 2.5 and slowdown(0) == 1.0
    monkeypatch.setenv("DYNATRAIN_SLOWDOWN", "device:1")
    with pytest.raises(ValueError, match=r"is not 'device:D,factor:F'"):
        slowdown(1)
    monkeypatch.setenv("DYNATRAIN_SLOWDOWN", "device:1,factor:0.5")
    with pytest.raises(ValueError, match=r"factor 0.5 must be >= 1"):
        slowdown(1)


# -- real workers -------------------------------------------------------------------------------
def _run(tmp: Path, name: str, doc: dict) -> dict:
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(doc))
    summary = tmp / f"{name}.json"
    env = {**os.environ, "DYNATRAIN_SLOWDOWN": "device:1,factor:3"}
    proc = subprocess.run([sys.executable, "-m", "dynatrain", "run", str(tmp / f"{name}.yaml"),
                           "--run-dir", str(tmp / name), "--summary-json", str(summary)],
                          capture_output=True, text=True, timeout=300, env=env)
    print(proc.stdout[-4000:], proc.stderr[-2000:])
    assert proc.returncode == 0, f"exit {proc.returncode}"
    return json.loads(summary.read_text())


@pytest.mark.slow
def test_a_slowed_stage_is_rebalanced_live_and_trains_the_same(tmp_path):
    on = _run(tmp_path, "on", manifest({"enabled": True}))
    off = _run(tmp_path, "off", manifest())
    [switch] = on["switches"]
    assert switch["reason"] == "rebalance" and switch["to"] == "dp=1,tp=1,pp=2,stages=3+1"
    before, after = on["measurements"]
    # Device 1 computes 3x slower: its stage measured the slower, and the split evened them.
    assert before["stage_compute_seconds"][1] > before["stage_compute_seconds"][0]
    assert after["imbalance"] < before["imbalance"]
    assert on["samples_exactly_once"] and off["switches"] == []
    # The same layers in another split: the same arithmetic, bit for bit.
    assert on["losses"] == off["losses"]

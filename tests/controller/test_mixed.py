"""Devices of different speeds in one job (#38 item 4): dynatrain/controller/mixed.py as
hand-computed cases, and the decision that uses it as event replays, without processes."""

from __future__ import annotations

from dataclasses import replace

from dynatrain.controller import decide, mixed
from dynatrain.controller.decide import Switch, View
from dynatrain.controller.policy import Policy, estimate_kwargs
from dynatrain.spec.hardware import PROFILES
from dynatrain.spec.job import job_from_manifest as parse_job
from dynatrain.vps.layout import parse_layout

PROFILE = replace(PROFILES["cpu"], shared_cores=0, memory_bytes=4 << 30)
H100, A100 = PROFILES["h100"].flops_per_second, PROFILES["a100"].flops_per_second


def manifest(mode: str = "auto", workers: int = 2) -> dict:
    """gpt-tiny (4 layers) where the only layouts are pipelines: a global batch of 1 leaves
    dp=1 and maxTP=1 leaves pp."""
    par = ({"mode": "auto", "limits": {"maxTP": 1}} if mode == "auto"
           else {"mode": "fixed", "layout": f"dp=1,tp=1,pp={workers}"})
    return {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": "mixed"},
            "spec": {"model": {"preset": "gpt-tiny"}, "resources": {"gpus": 0},
                     "elastic": {"minWorkers": workers, "maxWorkers": workers},
                     "parallelism": par, "globalBatchSize": 1,
                     "training": {"steps": 40, "seqLen": 64}}}


JOB = parse_job(manifest())


def test_each_stage_gets_devices_of_one_speed_the_fastest_first():
    # dp=2, pp=2 (order tp-dp-pp: ranks 0,1 are stage 0). Devices 1 and 3 are twice as fast:
    # they make stage 0, whatever their ids; ties go to the lower id.
    lay = parse_layout("dp=2,tp=1,pp=2").with_devices([0, 1, 2, 3])
    order = mixed.stage_order(lay, {0: 1.0, 1: 2.0, 2: 1.0, 3: 2.0})
    assert order == (1, 3, 0, 2)
    assert [lay.coords(r)[0] for r in range(4)] == [0, 0, 1, 1]


def test_layers_go_in_proportion_to_each_stages_speed():
    # 2 + 2 layers; stage 0's device twice as fast: per layer 0.5 and 1. One at a time where
    # it costs least: (1,1) -> stage 0 (1.0 vs 2.0) -> (2,1) -> stage 0 (1.5 vs 2.0) -> (3,1).
    lay = parse_layout("dp=1,tp=1,pp=2").with_devices([0, 1])
    out = mixed.weighted(lay, {0: 1.0, 1: 2.0}, num_layers=4)
    assert out.device_of == (1, 0) and out.stages == (3, 1)
    # An H100 stage and an A100 stage (650 vs 250 TFLOP/s in the presets): 3 + 1 as well
    # (per layer 1/650 and 1/250: the 4th layer costs 4/650 < 2/250 on the H100).
    out = mixed.weighted(lay, {0: A100, 1: H100}, num_layers=4)
    assert out.device_of == (1, 0) and out.stages == (3, 1)
    # 12 layers on 3 stages of speeds 1, 2, 3 (fastest first: 3, 2, 1): 6 + 4 + 2.
    lay3 = parse_layout("dp=1,tp=1,pp=3").with_devices([0, 1, 2])
    out = mixed.weighted(lay3, {0: 1.0, 1: 2.0, 2: 3.0}, num_layers=12)
    assert out.device_of == (2, 1, 0) and out.stages == (6, 4, 2)


def test_nothing_is_weighed_without_a_pipeline_an_unknown_speed_or_a_real_difference():
    pipe = parse_layout("dp=1,tp=1,pp=2").with_devices([0, 1])
    flat = parse_layout("dp=2").with_devices([0, 1])
    assert mixed.weighted(flat, {0: 1.0, 1: 2.0}, 4) is flat
    assert mixed.weighted(pipe, {0: 1.0}, 4) is pipe                      # device 1 unknown
    assert mixed.weighted(pipe, {0: 1.0, 1: 1.04}, 4) is pipe             # within SPREAD


def test_a_split_that_would_not_fit_keeps_even_stages_on_sorted_devices():
    lay = parse_layout("dp=1,tp=1,pp=2").with_devices([0, 1])
    kw = estimate_kwargs(JOB)
    assert mixed.weigh(JOB, lay, {0: 1.0, 1: 2.0}, PROFILE, kw).stages == (3, 1)
    tiny = replace(PROFILE, memory_bytes=1)
    out = mixed.weigh(JOB, lay, {0: 1.0, 1: 2.0}, tiny, kw)
    assert out.stages is None and out.device_of == (1, 0)
    # A fixed layout is the user's: left as asked.
    fixed = parse_job(manifest("fixed"))
    assert mixed.weigh(fixed, lay, {0: 1.0, 1: 2.0}, PROFILE, kw) is lay


def view(**kw) -> View:
    base = dict(now=100.0, layout=None, usable=(0, 1), step=0, last_step_at=99.9,
                give_up_s=600.0)
    return View(**{**base, **kw})


def test_replay_a_job_on_two_gpu_models_starts_weighted_and_stays_so():
    policy = Policy()
    speeds = {0: A100, 1: H100}
    a = decide.next_action(view(speeds=speeds), policy, JOB, PROFILE)
    assert isinstance(a, Switch) and a.decision.reason == "start"
    started = a.decision.layout
    assert started.to_text() == "dp=1,tp=1,pp=2,stages=3+1" and started.device_of == (1, 0)
    # Running so, the policy finds nothing better: the even split is not "another layout".
    a = decide.next_action(view(layout=started, step=10, speeds=speeds), policy, JOB, PROFILE)
    assert not isinstance(a, Switch), a
    # Alike devices start even, as before.
    a = decide.next_action(view(speeds={0: H100, 1: H100}), policy, JOB, PROFILE)
    assert a.decision.layout.to_text() == "dp=1,tp=1,pp=2"
    a = decide.next_action(view(), policy, JOB, PROFILE)
    assert a.decision.layout.to_text() == "dp=1,tp=1,pp=2"

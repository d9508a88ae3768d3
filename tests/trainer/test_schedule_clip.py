"""The learning-rate schedule, the clipping norm's ownership rule and their configuration errors.

Fast, single-process checks (no worker processes): the schedule against torch's own
``torch.optim.lr_scheduler`` classes (the same construction the plain-PyTorch reference trains
with), the rule that decides which rank counts which gradient shard in the global norm (every
element of the logical model exactly once, in every layout), and the messages a bad schedule,
floor or clip threshold gets. The manifest's field errors for the same values are in
tests/controller/test_job_scenario.py. Training with both, under every layout and across a live
switch, is in test_equivalence.py and test_switch.py.
"""

import numpy as np
import pytest
import torch

from dynatrain.trainer.config import ConfigError, make_config
from dynatrain.trainer.schedule import LRSchedule, ScheduleError
from dynatrain.vps.layout import bind, parse_layout
from dynatrain.vps.mapping import counts_once, rank_shards
from dynatrain.vps.presets import PRESETS

from reference_model import torch_schedule

SCHEDULES = [
    (LRSchedule(), 6),
    (LRSchedule(warmup_steps=4), 8),
    (LRSchedule(warmup_steps=1, decay="cosine"), 10),
    (LRSchedule(warmup_steps=3, decay="cosine", min_lr=3e-4), 10),
    (LRSchedule(warmup_steps=3, decay="cosine", decay_steps=7, min_lr=1e-4), 7),
    (LRSchedule(warmup_steps=5, decay="linear", decay_steps=20, min_lr=2e-4), 30),
    (LRSchedule(decay="linear"), 12),
    (LRSchedule(decay="cosine", min_lr=1e-4), 12),
]


@pytest.mark.parametrize("schedule,total", SCHEDULES, ids=[str(s) for s, _ in SCHEDULES])
def test_schedule_follows_torchs_schedulers(schedule, total):
    cfg = make_config("gpt-tiny", "dp=1", lr=3e-3, lr_schedule=schedule, total_steps=total)
    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=cfg.lr)
    sched = torch_schedule(opt, cfg)
    # Cosine annealing is periodic past its end, where ours stays at the floor: compare the
    # steps up to the decay's end (the ones a job of total_steps takes).
    end = schedule.resolved(total).decay_steps or total
    for step in range(min(total, end) if schedule.decay != "constant" else total):
        want = opt.param_groups[0]["lr"]
        assert cfg.lr_at(step) == pytest.approx(want, rel=1e-9, abs=1e-15), (step, want)
        opt.step()
        sched.step()
    if schedule.decay != "constant":       # past the end: the floor, for ever
        assert cfg.lr_at(end) == pytest.approx(schedule.min_lr, abs=1e-15)
        assert cfg.lr_at(10 * end) == pytest.approx(schedule.min_lr, abs=1e-15)


def test_warmup_rises_to_the_peak_and_never_exceeds_it():
    s = LRSchedule(warmup_steps=4, decay="cosine", decay_steps=10, min_lr=1e-4)
    lrs = [s.lr(1e-3, i) for i in range(12)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert max(lrs) == pytest.approx(1e-3) and min(lrs) == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))            # decays monotonically


@pytest.mark.parametrize("kw, fragment", [
    (dict(decay="step"), "decay='step' is not one of constant, cosine, linear"),
    (dict(warmup_steps=-1), "warmupSteps=-1 must be an integer >= 0"),
    (dict(warmup_steps=5, decay="cosine", decay_steps=5), "decaySteps=5 must exceed"),
    (dict(min_lr=-1e-3), "minLearningRate=-0.001 must be a number >= 0"),
])
def test_a_bad_schedule_names_its_field_and_value(kw, fragment):
    with pytest.raises(ScheduleError) as e:
        LRSchedule(**kw)
    assert fragment in str(e.value)


@pytest.mark.parametrize("kw, fragment", [
    (dict(lr=1e-3, lr_schedule=LRSchedule(decay="cosine", min_lr=1e-2)),
     "min_lr=0.01 exceeds the peak lr=0.001"),
    (dict(grad_clip=-1.0), "grad_clip=-1.0 must be >= 0 (0: no clipping)"),
    (dict(precision="fp8"), "precision='fp8' is not one of fp32, bf16"),
])
def test_a_bad_training_config_fails_before_any_process(kw, fragment):
    with pytest.raises(ConfigError) as e:
        make_config("gpt-tiny", "dp=2", **kw)
    assert fragment in str(e.value)


# Layouts where a naive sum would count something twice: DP replicas, TP-replicated norms and
# routers, GQA kv heads replicated over TP (moe-tiny has 2 kv heads), the tied embedding on the
# first and last stage, expert replicas over expert-DP; and ZeRO / EP shards that must all count.
OWNERSHIP = [
    ("gpt-tiny", "dp=4"), ("gpt-tiny", "tp=4,pp=2"), ("gpt-tiny", "dp=2,pp=3,zero=1"),
    ("gpt-tiny", "dp=2,tp=2,pp=2,zero=3"), ("moe-tiny", "tp=4"), ("moe-tiny", "dp=4,ep=2"),
    ("moe-tiny", "dp=4,ep=2,zero=1,tp=2"), ("moe-tiny", "pp=2,dp=2,ep=2,zero=3"),
    ("moe-tiny", "dp=2,tp=4,ep=2,pp=2,zero=1"),
]


@pytest.mark.parametrize("model,layout", OWNERSHIP)
def test_the_norm_counts_every_gradient_element_exactly_once(model, layout):
    """What each rank counts in the clipping norm covers the logical model exactly once."""
    m = PRESETS[model]
    bound = bind(parse_layout(layout), m)
    seen = {t.name: np.zeros(t.shape, dtype=np.int32) for t in m.tensors}
    for rank in range(bound.world):
        for rs in rank_shards(bound, rank):
            if rs.state == "exp_avg" and counts_once(bound, rs.tensor, "exp_avg", rank):
                for piece in rs.pieces:
                    seen[rs.tensor.name][tuple(slice(a, b) for a, b in piece.box)] += 1
    for name, count in seen.items():
        assert count.min() == 1 and count.max() == 1, (layout, name, count.min(), count.max())

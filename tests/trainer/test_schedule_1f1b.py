"""1F1B beside GPipe, and activation checkpointing: less activation memory, the same training.

Two gloo ranks on CPU run gpt-tiny at pp=2 with 8 micro-batches per step (global batch 8,
micro-batch 1). Every run happens in the same two processes, one after the other, from the same
seeded initial state: GPipe; 1F1B; a run that switches live GPipe -> 1F1B -> GPipe at step
boundaries (the trainer rebuilt from the previous one's local state, as a switch delivers it;
the planner moves no bytes for it); 1F1B with activation checkpointing. Losses and final states
(params, masters, AdamW moments) must be bit-identical across all of them, since every schedule
accumulates the micro-batches' gradients in the same order and recomputation repeats the same
arithmetic.

Peak activation memory is measured per rank with :class:`ActivationMeter`: the bytes of
storages that autograd keeps saved for backward (CPU has no ``max_memory_allocated``), and
compared with what the cost model predicts for each schedule.
"""

import hashlib
from dataclasses import replace

import pytest

from dynatrain.controller.costmodel import SolverError, estimate
from dynatrain.spec.hardware import PROFILES
from dynatrain.controller.solver import solve
from dynatrain.trainer.config import make_config
from dynatrain.trainer.groups import build_groups
from dynatrain.trainer.launch import run_ranks
from dynatrain.trainer.trainer import Trainer
from dynatrain.vps.layout import bind, parse_layout
from dynatrain.vps.planner import plan_switch

STEPS = 3
KW = dict(global_batch_size=8, micro_batch_size=1, seq_len=32, lr=3e-3, eps=1e-6, grad_clip=3.0)
GPIPE, ONE_F_ONE_B = "pp=2", "pp=2,schedule=1f1b"


def _digest(trainer) -> dict[str, str]:
    """A hash of every local state tensor's bytes (params, masters, moments)."""
    return {f"{n}/{s}": hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()
            for (n, s), (t, _) in sorted(trainer.local_state().tensors.items())}


def _run(groups, schedules: list[str], checkpointing: bool = False):
    """Train len(schedules) steps, step i under layout ``schedules[i]``; a change of layout
    rebuilds the trainer from the previous one's local state, as a live switch does."""
    trainer, losses, peaks = None, [], []
    for text in schedules:
        cfg = make_config("gpt-tiny", text, activation_checkpointing=checkpointing, **KW)
        if trainer is None or trainer.lay.schedule != cfg.layout.schedule:
            trainer = Trainer(cfg, groups, state=trainer.local_state() if trainer else None)
            trainer.measure_activations = True
        r = trainer.train_step()
        losses.append(r.loss)
        peaks.append(r.activation_bytes)
    return losses, max(peaks), _digest(trainer)


def _ranks(rank, device, results):
    cfg = make_config("gpt-tiny", GPIPE, **KW)
    groups = build_groups(bind(cfg.layout, cfg.model), rank)
    runs = {
        "gpipe": _run(groups, [GPIPE] * STEPS),
        "1f1b": _run(groups, [ONE_F_ONE_B] * STEPS),
        "switched": _run(groups, [GPIPE, ONE_F_ONE_B, GPIPE]),
        "1f1b+checkpointing": _run(groups, [ONE_F_ONE_B] * STEPS, checkpointing=True),
    }
    results.put(("runs", (rank, runs)))


@pytest.fixture(scope="module")
def runs():
    by_rank = {}
    run_ranks(_ranks, (), world=2, backend="gloo", messages=2,
              on_message=lambda kind, payload: by_rank.__setitem__(*payload),
              what="1F1B vs GPipe", timeout_s=300)
    return by_rank


def test_1f1b_holds_less_activation_memory_than_gpipe_with_equal_losses(runs):
    for rank, r in runs.items():
        gpipe, one = r["gpipe"], r["1f1b"]
        assert one[0] == gpipe[0], (rank, one[0], gpipe[0])          # bit-identical losses
        assert one[2] == gpipe[2], rank                              # and training state
        # Stage s holds min(m, pp - s) of the m = 8 micro-batches: 2 on stage 0, 1 on the
        # last; every micro-batch saves the same bytes, so the ratios are exact.
        assert gpipe[1] == (8 // (2 - rank)) * one[1], (rank, gpipe[1], one[1])


def test_measured_activations_match_the_cost_model(runs):
    """Stage 0 (blocks and the embedding) within 20% (measured: 8% below; checkpointed 17%
    below, the recomputed block's transients); the last stage at most the prediction: its
    count of three logits copies is the vocab-parallel cross-entropy's (tp > 1), while with
    tp = 1 F.cross_entropy keeps one (measured 30-60% below)."""
    profile = PROFILES["h100"]          # activations depend on the model only, not the device
    model = make_config("gpt-tiny", GPIPE, **KW).model
    for text, key, ckpt in ((GPIPE, "gpipe", False), (ONE_F_ONE_B, "1f1b", False),
                            (ONE_F_ONE_B, "1f1b+checkpointing", True)):
        predicted = estimate(model, parse_layout(text), profile, global_batch_size=8,
                             seq_len=32, activation_checkpointing=ckpt).stage_activations
        first, last = runs[0][key][1], runs[1][key][1]
        assert abs(first - predicted[0]) / predicted[0] < 0.2, (key, first, predicted)
        assert last <= predicted[1], (key, last, predicted)


def test_a_live_switch_between_schedules_keeps_training_bit_identical(runs):
    cfg = make_config("gpt-tiny", GPIPE, **KW)
    plan = plan_switch(cfg.model, cfg.layout, parse_layout(ONE_F_ONE_B))
    assert not plan.transfers and not any(plan.need.values())       # a switch moves nothing
    for rank, r in runs.items():
        assert r["switched"][0] == r["gpipe"][0], rank
        assert r["switched"][2] == r["gpipe"][2], rank


def test_activation_checkpointing_keeps_training_bit_identical_in_less_memory(runs):
    for rank, r in runs.items():
        ckpt, one = r["1f1b+checkpointing"], r["1f1b"]
        assert ckpt[0] == one[0], rank
        assert ckpt[2] == one[2], rank
        assert ckpt[1] < one[1] / 2, (rank, ckpt[1], one[1])


# -- the memory model and the solver (pure, no processes) ------------------------------------

def _tight(extra_bytes: int):
    """The H100 profile with ``extra_bytes`` above its reserved memory."""
    h100 = PROFILES["h100"]
    return replace(h100, memory_bytes=h100.reserved_bytes + extra_bytes)


SOLVE = dict(global_batch_size=64, seq_len=128)


def test_the_solver_takes_1f1b_only_where_gpipe_does_not_fit():
    model = make_config("gpt-tiny", GPIPE, **KW).model
    roomy = solve(model, 2, PROFILES["h100"], **SOLVE)
    assert roomy.layout.schedule == "gpipe", roomy
    # 100 MB: under GPipe dp=2 needs 398 MB of activations (32 micro-batches per rank), pp=2
    # 537 MB (64); under 1F1B 12 MB and 9 MB. With pp = 1, 1F1B is one forward and one
    # backward per micro-batch: gradient accumulation holding one micro-batch.
    fastest = solve(model, 2, _tight(100 << 20), **SOLVE)
    assert fastest.layout.to_text() == "dp=2,tp=1,pp=1,schedule=1f1b", fastest
    tight = solve(model, 2, _tight(100 << 20), **SOLVE, allow=lambda lay: lay.pp == 2)
    assert tight.layout.to_text() == "dp=1,tp=1,pp=2,schedule=1f1b", tight
    gpipe = estimate(model, parse_layout(GPIPE), _tight(100 << 20), **SOLVE)
    assert not gpipe.fits and tight.fits
    assert tight.step_seconds == gpipe.step_seconds        # the schedule costs no time
    with pytest.raises(SolverError, match="activationCheckpointing"):
        solve(model, 2, _tight(1 << 20), **SOLVE)


def test_activation_checkpointing_in_the_memory_and_time_model():
    model = make_config("gpt-tiny", GPIPE, **KW).model
    for text in (GPIPE, ONE_F_ONE_B, "dp=1"):
        plain = estimate(model, parse_layout(text), PROFILES["h100"], **SOLVE)
        ckpt = estimate(model, parse_layout(text), PROFILES["h100"], **SOLVE,
                        activation_checkpointing=True)
        assert ckpt.memory_breakdown["activations"] < plain.memory_breakdown["activations"] / 2
        # one more forward of the blocks: between 0 and 1/3 more compute
        assert plain.breakdown["compute"] < ckpt.breakdown["compute"] \
            < 4 / 3 * plain.breakdown["compute"], text


def test_a_live_switch_through_the_transition_engine_moves_nothing_and_keeps_the_losses():
    """The real switch (agent-side machinery: prepare in the background, transfer, rebuild the
    trainer under the new layout), GPipe -> 1F1B: the state arrives bit for bit (checked
    against DCP's resharding), no byte crosses the network, and the losses are exactly those
    of the same steps under GPipe alone."""
    from dynatrain.bench.switch import bench_switch
    from dynatrain.trainer.launch import run_local

    kw = dict(global_batch_size=8, seq_len=16)
    r = bench_switch(make_config("gpt-tiny", GPIPE, **kw), make_config("gpt-tiny", ONE_F_ONE_B,
                                                                       **kw),
                     steps_before=2, steps_after=2, timeout_s=300, restart_fresh=False,
                     baseline=False)
    assert r["bitwise_equal"], r
    assert r["bytes_network"] == 0, r
    plain = run_local(make_config("gpt-tiny", GPIPE, **kw), 4)
    assert r["losses_before"] + r["losses_after"] == plain.losses, (r, plain.losses)


def test_spec_training_activation_checkpointing_reaches_the_trainer_config():
    from pathlib import Path

    import yaml

    from dynatrain.spec.job import JobError, job_from_manifest

    doc = yaml.safe_load((Path(__file__).parents[2] / "examples" / "quickstart.yaml").read_text())
    doc["spec"].setdefault("training", {})["activationCheckpointing"] = True
    job = job_from_manifest(doc)
    assert job.training.activation_checkpointing
    assert job.train_config(parse_layout(ONE_F_ONE_B)).activation_checkpointing
    doc["spec"]["training"]["activationCheckpointing"] = "yes"
    with pytest.raises(JobError, match=r"spec.training.activationCheckpointing='yes'"):
        job_from_manifest(doc)

"""The chaos bench's own logic: the trial plan and the judging (the runs are in
tests/controller/test_chaos.py). A judge that cannot say "corrupted" would prove nothing."""

from __future__ import annotations

import torch

from dynatrain.bench import chaos as bc
from dynatrain.trainer.redundancy import buddy_map
from dynatrain.trainer.state import FullState, local_from_full
from dynatrain.trainer.state_io import write_state
from dynatrain.vps.layout import bind, parse_layout
from dynatrain.vps.presets import PRESETS


def test_the_plan_mixes_every_kind_and_layout_and_kills_buddy_pairs():
    trials = bc.plan_trials(30, seed=0, steps=16)
    assert {t.kind for t in trials} == set(bc.KINDS)
    assert {t.layout for t in trials} == set(bc.LAYOUTS)
    assert all(3 <= t.at_step < 16 - 5 for t in trials)
    pairs = [t for t in trials if len(t.victims) == 2]
    assert pairs and all(t.kind == "step" for t in pairs)
    for t in pairs:
        lay = parse_layout(t.layout).with_devices(range(4))
        a, b = t.victims
        assert buddy_map(lay)[a] == b or buddy_map(lay)[b] == a
    assert bc.plan_trials(30, seed=0, steps=16) == trials        # reproducible


def _spec(**kw):
    return bc.TrialSpec(index=0, kind="step", layout="dp=4", victims=[1], at_step=5, **kw)


def test_judging_outcomes():
    assert bc._judge(_spec(), None, 240.0, None).outcome == "hung"
    assert bc._judge(_spec(), {"outcome": "clean_failure", "message": "no copy"}, 1,
                     None).outcome == "clean_failure"
    raw = {"outcome": "finished", "steps": 16, "exactly_once": True, "recoveries": [],
           "first_step_end": {}, "kills": [{"device": 1, "time": 10.0}], "faults": [],
           "restarts": []}
    assert bc._judge(_spec(), raw, 1, None).outcome == "error"        # no recovery recorded
    rec = {"step": 5, "to": "dp=3", "generation": 2, "phases": {"from_checkpoint": 0.0}}
    ok = dict(raw, recoveries=[rec], first_step_end={"1": 5.0, "2": 10.4})
    r = bc._judge(_spec(), ok, 1, None)
    assert r.outcome == "recovered" and r.restored_step == 5 and abs(r.mttr_seconds - 0.4) < 1e-9
    twice = dict(ok, exactly_once=False)
    assert bc._judge(_spec(), twice, 1, None).outcome == "corrupted"


def _dump(directory, tag: str, layout: str, full: FullState) -> None:
    lay = parse_layout(layout)
    bound = bind(lay.with_devices(range(lay.world)), PRESETS["gpt-tiny"])
    directory.mkdir(parents=True, exist_ok=True)
    for rank in range(lay.world):
        # As agent.worker_loop._dump_state writes it: safetensors + JSON, no pickle.
        write_state(directory / f"{tag}-rank{rank}.safetensors",
                    local_from_full(full, bound, rank), layout=layout, world=lay.world)


def test_restored_states_are_compared_bit_for_bit(tmp_path, monkeypatch):
    model = PRESETS["gpt-tiny"]
    g = torch.Generator().manual_seed(0)
    full = FullState({(t.name, k): torch.randn(t.shape, generator=g)
                      for t in model.tensors for k in ("param", "exp_avg", "exp_avg_sq")},
                     step=7, data_position=56)
    specs = [bc.TrialSpec(0, "step", "dp=2", [1], at_step=7, steps=16),
             bc.TrialSpec(1, "step", "dp=2", [0], at_step=7, steps=16)]
    _dump(tmp_path / "trial-0-step" / "dumps", "gen2", "tp=2", full)      # restored exactly
    bad = FullState(dict(full.tensors), 7, 56)
    key = sorted(bad.tensors)[0]
    bad.tensors[key] = bad.tensors[key].clone()
    bad.tensors[key].view(-1)[123] += 1e-6                                 # one element off
    _dump(tmp_path / "trial-1-step" / "dumps", "gen2", "dp=1", bad)

    def reference(spec, root, timeout_s):                                  # the failure-free run
        _dump(root / f"trial-{spec.index}-reference" / "dumps", "step7", spec.layout, full)
        return {"outcome": "finished"}, 1.0

    monkeypatch.setattr(bc, "_spawn_trial", reference)
    results = [bc.TrialResult(s.index, s.kind, s.layout, s.victims, outcome="recovered",
                              restored_step=7) for s in specs]
    bc._check_states(results, specs, tmp_path, 60, lambda *_: None)
    assert results[0].outcome == "recovered", results[0].message
    assert results[1].outcome == "corrupted" and "1 tensors differ" in results[1].message


def test_two_runs_split_one_plan():
    # `--first-trial`: CI runs trials 0-5 on gloo and 6-9 on nccl-sim, together the ten trials
    # of one plan (every kind under nccl-sim, the buddy pair included).
    whole = bc.plan_trials(10, seed=0, steps=16)
    assert bc.plan_trials(6, seed=0, steps=16) + bc.plan_trials(4, seed=0, steps=16,
                                                                 first=6) == whole
    rest = bc.plan_trials(4, seed=0, steps=16, first=6)
    assert [t.index for t in rest] == [6, 7, 8, 9]
    assert {t.kind for t in rest} == set(bc.KINDS)
    assert any(len(t.victims) == 2 for t in rest)


def test_workers_lost_to_the_nccl_watchdog_are_counted_from_their_logs(tmp_path):
    # What dynatrain.vps.ncclsim prints: before it takes a process down (TORCH_NCCL_ASYNC_
    # ERROR_HANDLING 1 or 3), and in the error of an op whose communicator it aborted (2),
    # which the worker prints when its generation is interrupted.
    (tmp_path / "worker-0.log").write_text("device 0: step 3\n")
    (tmp_path / "worker-1.log").write_text(
        "[nccl-sim watchdog] allreduce on group gen1/dp/0-1 (rank 1 of 2) ran 60.1 s, past its "
        "timeout of 60 s; TORCH_NCCL_ASYNC_ERROR_HANDLING=3: taking the process down\n")
    (tmp_path / "worker-2.log").write_text(
        "device 2: generation 1 interrupted: allreduce: the watchdog aborted the communicator: "
        "allreduce passed its timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING=2)\n")
    (tmp_path / "worker-3.log").write_text(
        "device 3: generation 1 interrupted: allreduce: the communicator was aborted "
        "(ncclCommAbort)\n")                         # the recovery's own abort: not counted
    assert bc.watchdog_victims(tmp_path) == ([1], [2])
    assert bc.watchdog_victims(tmp_path / "missing") == ([], [])
    import inspect

    from dynatrain.vps import ncclsim
    watch = inspect.getsource(ncclsim._watch)            # the strings are the watchdog's own
    assert bc.WATCHDOG_KILL in watch and bc.WATCHDOG_ABORT in watch

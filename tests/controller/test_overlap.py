"""Events that overlap: a notice, joins, a requested layout, a kill and a hang a few steps
apart, on real worker processes, against the same job without events.

Each run must end with the losses of the run without events, every sample read exactly once
(from the workers' own reports), every requested layout applied or answered, and every event
taken in within one step of its due step, whatever switch or recovery was in flight.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynatrain.bench import overlap

pytestmark = pytest.mark.slow
STEPS = overlap.STEPS
CI_SEEDS = (0, 1)
"""Random scenarios run in CI (about 30 s each); DYNATRAIN_OVERLAP_SEEDS=N runs N more."""


def run(tmp: Path, name: str, scenario: dict | None, env: dict | None = None, *,
        layout: str | None = None, workers: int = 5, watchdog: float = 4.0,
        backend: str = "") -> dict:
    job = overlap.job_manifest(max_workers=workers, watchdog_s=watchdog)
    if layout:
        job["spec"]["parallelism"] = {"mode": "fixed", "layout": layout}
    out = overlap.run(tmp, name, job, scenario, env=env, backend=backend)
    print(out["stdout"][-8000:])
    assert out["returncode"] == 0, f"exit {out['returncode']}"
    return out


def check_run(out: dict, reference: dict) -> None:
    """What every run with events must show, whatever the events were: the losses of the
    run without events, every sample read exactly once, every request applied or answered,
    every notice and kill acted on within one step (see overlap.judge)."""
    assert overlap.judge(out, reference) == []
    assert out["samples_consumed"] == STEPS * overlap.GLOBAL_BATCH


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("reference"), "reference", None)


def test_a_notice_a_join_a_request_and_a_kill_a_few_steps_apart(tmp_path, reference):
    # The scenario: each event lands while the previous one is being handled.
    scenario = {"initialWorkers": 4, "events": [
        {"atStep": 10, "preempt": {"workers": [3], "noticeSeconds": 30}},
        {"atStep": 11, "join": 2},
        {"atStep": 12, "layout": "dp=1,tp=2,pp=2"},
        {"atStep": 14, "kill": {"workers": [1]}},
    ]}
    out = run(tmp_path, "overlap", scenario)
    check_run(out, reference)
    # The request is answered, and once two joiners are up there is room for it: applied.
    (req,) = out["requests"]
    assert req["state"] == "applied", req
    assert out["switches"][-1]["to"] == "dp=1,tp=2,pp=2"
    assert [r["reason"] for r in out["recoveries"]] == ["failure"]
    assert "layout request dp=1,tp=2,pp=2" in out["stdout"]


def test_under_nccl_semantics_the_same_events_end_the_same_way(tmp_path, reference):
    # The workers on nccl-sim (dynatrain.vps.ncclsim): a dead peer's collectives hang rather
    # than fail, and only an abort frees a thread stuck in one. Before abandon aborted the
    # generation's groups, a survivor waited for the group's timeout (60 s) until the
    # watchdog aborted the communicator (or, with torch's default error handling, killed
    # the survivor); now the abandon does it at once.
    scenario = {"initialWorkers": 4, "events": [
        {"atStep": 10, "preempt": {"workers": [3], "noticeSeconds": 30}},
        {"atStep": 11, "join": 2},
        {"atStep": 14, "kill": {"workers": [1]}},
    ]}
    out = run(tmp_path, "nccl-sim", scenario, backend="nccl-sim")
    check_run(out, reference)                   # the losses of the gloo run, bit for bit
    assert [r["reason"] for r in out["recoveries"]] == ["failure"]
    logs = "\n".join(p.read_text() for p in (tmp_path / "nccl-sim").glob("worker-*.log"))
    assert "nccl-sim watchdog" not in logs and "watchdog aborted" not in logs
    assert "the communicator was aborted (ncclCommAbort)" in logs
    # Every communicator, the transfers' pairs included, was made in a Prepare, in the
    # background, none at its first use (inside a pause or a step).
    assert "at first use" not in logs


def test_a_hung_worker_is_declared_failed_and_recovered_like_a_dead_one(tmp_path, reference):
    scenario = {"initialWorkers": 3, "events": [{"atStep": 8, "hang": {"workers": [2]}}]}
    out = run(tmp_path, "hang", scenario)
    check_run(out, reference)
    assert "hung: no answer to Status" in out["stdout"]
    assert "declared failed by the controller; killed" in out["stdout"]
    (rec,) = out["recoveries"]
    assert rec["workers_after"] == 2        # the layout for two is the solver's (measured cores)
    # found by the watchdog (4 s here; the "hung" line above names it), not by a
    # collective's 60-second timeout. (A bound on the run's wall time here failed once on a
    # loaded machine: the detection's own message is the evidence that cannot.)
    # The recovery is from memory, at the last step whose every mirror arrived. The hang
    # lands once the controller saw step 8; step 8's mirror to the buddy completes inside
    # step 9 (Redundancy.wait_mirror), so a worker stopped before that leaves step 7 as the
    # last whole copy (CI, 2026-11-28: restored 7). Step 7's mirrors had all arrived: a rank
    # finishes step 8 only after them.
    assert rec["phases"]["restored_step"] >= 7
    assert rec["phases"]["from_checkpoint"] == 0


def test_a_worker_that_hangs_but_answers_status_is_found_by_its_waiting_peers(tmp_path,
                                                                              reference):
    # The training thread of device 1 stops before its 11th step while its agent answers
    # Status: no exit, no missed call. Its peers wait for it in the step's all-reduce; the
    # watchdog blames the member that waits for nothing.
    out = run(tmp_path, "stuck", {"initialWorkers": 3, "events": []},
              env={"DYNATRAIN_FAULT": "device:1,at:step,mode:hang,skip:10"})
    check_run(out, reference)
    assert "wait for it in a collective" in out["stdout"]
    (rec,) = out["recoveries"]
    # From memory, at step 10 or 9: the peers wait in step 11's gradient all-reduce, before
    # they wait for step 10's mirrors (Redundancy.wait_mirror), so whether those count is a
    # race (CI, 2026-11-29: restored 9); step 9's had all arrived, as every rank finished 10.
    assert rec["workers_after"] == 2 and rec["phases"]["restored_step"] in (9, 10)
    assert rec["phases"]["from_checkpoint"] == 0


def test_a_member_that_just_joined_is_not_the_single_point_of_loss(tmp_path, reference):
    # A pipeline grows by a stage; the joiner dies as the switch ends, before it mirrored the
    # stage it now holds alone. The running generation has no whole copy of any step: the
    # recovery goes back to the generation before the switch (its snapshots are kept two
    # steps after a planned switch) and re-plans from its layout. Before, the job stopped.
    scenario = {"initialWorkers": 2, "events": [
        {"atStep": 3, "join": 1},
        {"atStep": 4, "layout": "dp=1,tp=1,pp=3"},
    ]}
    out = run(tmp_path, "joiner", scenario, env={"DYNATRAIN_FAULT": "device:2,at:switched"},
              layout="dp=1,tp=1,pp=2", workers=3)
    check_run(out, reference)
    # Which generation holds the whole state depends on a race the test cannot order: the
    # joiner dies once its own part of the switch ended, while the other members may still be
    # in the switch's last exchange with it. If at least one of them completed the switch, the
    # running generation lacks the joiner's stage and the recovery goes back to the generation
    # before it (the member whose switch failed counts there too: test_recovery_choice.py
    # pins that choice without processes). If both failed, the switch failed everywhere and
    # the members restore their own snapshots of the generation they still run. Either way
    # the job goes on from memory.
    went_back = "of the generation before the last switch" in out["stdout"]
    switch_failed = "switch to dp=1,tp=1,pp=3 failed" in out["stdout"]
    assert went_back or switch_failed, out["stdout"]
    (rec,) = out["recoveries"]
    # back on the two devices left (the request for three stages cannot run there)
    assert rec["workers_after"] == 2 and rec["phases"]["from_checkpoint"] == 0
    (req,) = out["requests"]
    assert req["state"] in ("waiting", "refused") and "failure" in out["stdout"]


def test_an_evicted_worker_is_switched_out_live_within_its_grace_period(tmp_path, reference):
    # Kubernetes' planned removals (pod deletion, Eviction API, drain, spot shutdown) arrive
    # as SIGTERM with a grace period. The worker trains on and says it is leaving in its
    # Status; the controller switches it out (a preemption, not a failure) and it exits 0.
    scenario = {"initialWorkers": 4, "events": [
        {"atStep": 8, "evict": {"workers": [3], "graceSeconds": 30}}]}
    out = run(tmp_path, "evict", scenario)
    check_run(out, reference)
    assert "device 3 is leaving" in out["stdout"]
    assert out["recoveries"] == [], out["recoveries"]
    (sw,) = out["switches"]
    assert sw["reason"] == "preemption" and sw["workers_after"] == 3, sw
    assert 3 not in out["decisions"][-1]["devices"]
    assert "notice expired, killed" not in out["stdout"]     # it left long before the kill
    log = (tmp_path / "evict" / "worker-3.log").read_text()
    assert "told to leave (SIGTERM)" in log


def test_an_eviction_whose_grace_runs_out_before_the_switch_is_a_failure(tmp_path, reference):
    # The evicted worker's own preparation of the switch that would take it out hangs (a
    # fault point), so its 3 s of grace run out first: the kill is a failure, recovered from
    # the in-memory copies, and the job still ends as the run without events.
    scenario = {"initialWorkers": 4, "events": [
        {"atStep": 8, "evict": {"workers": [3], "graceSeconds": 3}}]}
    out = run(tmp_path, "evict-late", scenario,
              env={"DYNATRAIN_FAULT": "device:3,at:prepare,mode:hang,skip:1"})
    check_run(out, reference)
    assert "device 3 is leaving" in out["stdout"]
    assert "worker 3: notice expired, killed" in out["stdout"]
    assert [r["reason"] for r in out["recoveries"]] == ["failure"], out["recoveries"]
    assert not any(s["reason"] == "preemption" and s["result"] == "success"
                   for s in out["switches"])


def test_with_preemption_policy_ignore_an_eviction_is_not_acted_on(tmp_path, reference):
    # spec.preemptionPolicy: Ignore (e.g. cordons for maintenance that will not take the
    # node): the notice changes nothing; a worker that does go at its deadline is a failure,
    # recovered from memory like any other.
    job = overlap.job_manifest(max_workers=5, watchdog_s=4.0)
    job["spec"]["preemptionPolicy"] = "Ignore"
    out = overlap.run(tmp_path, "ignore", job, {"initialWorkers": 4, "events": [
        {"atStep": 8, "evict": {"workers": [3], "graceSeconds": 2}}]})
    print(out["stdout"][-6000:])
    assert out["returncode"] == 0
    assert "device 3 is leaving" not in out["stdout"]
    assert "worker 3: notice expired, killed" in out["stdout"]
    assert [r["reason"] for r in out["recoveries"]] == ["failure"], out["recoveries"]
    assert out["samples_exactly_once"]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(out["losses"], reference["losses"]))


def _seeds() -> list[int]:
    extra = int(os.environ.get("DYNATRAIN_OVERLAP_SEEDS", "0") or 0)
    return list(CI_SEEDS) + list(range(100, 100 + extra))


@pytest.mark.parametrize("seed", _seeds())
def test_random_overlapping_events_end_as_the_run_without_events(tmp_path, reference, seed):
    # The property: whatever the events and however they overlap, the job ends as if none
    # had happened (losses, data), and nothing was dropped or handled late.
    scenario = overlap.random_scenario(seed)
    print("scenario:", scenario)
    out = run(tmp_path, f"seed{seed}", scenario)
    check_run(out, reference)
    assert len(out["events"]) == len(scenario["events"])


def test_scenarios_overlap_and_stay_runnable():
    # The generator itself: deliberate overlaps, every kind, never below two live workers.
    kinds, gaps = set(), []
    for seed in range(200):
        sc = overlap.random_scenario(seed)
        steps = [e["atStep"] for e in sc["events"]]
        assert 3 <= len(steps) <= 6 or steps[-1] > STEPS - 15
        assert steps == sorted(steps) and steps[-1] <= STEPS - 12
        gaps += [b - a for a, b in zip(steps, steps[1:])]
        alive = sc["initialWorkers"]
        for e in sc["events"]:
            kind = next(k for k in e if k != "atStep")
            kinds.add(kind)
            alive += e.get("join", 0) - (1 if kind in ("preempt", "evict", "kill", "hang")
                                         else 0)
            assert 2 <= alive <= 5
        assert sum(1 for e in sc["events"] if "hang" in e) <= 1
    assert kinds == {"preempt", "evict", "join", "layout", "kill", "hang"}
    assert gaps.count(0) > 20 and gaps.count(1) > 50        # same step, and the next

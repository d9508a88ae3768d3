"""``dynatrain bench goodput``: the trace format and its errors, the accounting on synthetic step
timelines (exact), and one short run of both modes on a tiny trace (structural facts only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dynatrain.bench import goodput as gp
from dynatrain.bench.goodput import StepSpan, TraceError
from dynatrain.controller.scenario import ScenarioError

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "examples" / "quickstart.yaml")


def _doc(*events, **top):
    return {"job": QUICKSTART, "checkpointEvery": 4, **top, "events": list(events)}


# -- the trace ------------------------------------------------------------------------------------
def test_parse_a_trace_sorted_by_time():
    t = gp.parse_trace(_doc({"atSeconds": 9, "join": {"count": 2}},
                            {"atSeconds": 1.5, "preempt": {"count": 1, "noticeSeconds": 3}},
                            {"atSeconds": 4, "kill": {"count": 1}}, steps=30, initialWorkers=3))
    assert [(e.at_seconds, e.kind, e.count, e.notice_seconds) for e in t.events] == [
        (1.5, "preempt", 1, 3.0), (4.0, "kill", 1, 0.0), (9.0, "join", 2, 0.0)]
    assert (t.checkpoint_every, t.steps, t.initial_workers) == (4, 30, 3)


@pytest.mark.parametrize("doc, words", [
    ([], "expected a mapping"),
    (_doc({"atSeconds": 1, "kill": {"count": 1}}, bogus=1), "unknown keys ['bogus']"),
    ({"job": QUICKSTART, "events": [{"atSeconds": 1, "kill": {"count": 1}}]},
     "checkpointEvery=None"),
    (_doc(), "events=[] must be a non-empty list"),
    (_doc({"atSeconds": -1, "kill": {"count": 1}}), "events[0].atSeconds=-1"),
    (_doc({"atSeconds": "soon", "kill": {"count": 1}}), "events[0].atSeconds='soon'"),
    (_doc({"atSeconds": 1}), "events[0] must have atSeconds and exactly one of"),
    (_doc({"atSeconds": 1, "kill": {"count": 1}, "join": {"count": 1}}), "exactly one of"),
    (_doc({"atSeconds": 1, "kill": {"count": 1}}, {"atSeconds": 2, "join": {"count": 0}}),
     "events[1].join.count=0"),
    (_doc({"atSeconds": 1, "preempt": {"count": 1}}), "events[0].preempt.noticeSeconds=None"),
    (_doc({"atSeconds": 1, "preempt": {"count": 1, "noticeSeconds": 0}}),
     "events[0].preempt.noticeSeconds=0"),
    (_doc({"atSeconds": 1, "kill": {"workers": [3]}}), "events[0].kill.workers"),
    (_doc({"atSeconds": 1, "kill": {"count": 1, "noticeSeconds": 4}}),
     "events[0].kill: unknown keys ['noticeSeconds']"),
    (_doc({"atSeconds": 1, "join": 1}), "events[0].join must be {count: N}"),
])
def test_bad_traces_name_the_event_and_field(doc, words):
    with pytest.raises(TraceError) as e:
        gp.parse_trace(doc, source="t.yaml")
    assert words in str(e.value) and str(e.value).startswith("t.yaml")
    assert isinstance(e.value, ScenarioError)          # the CLI reports it as a user error


def _write(tmp_path, doc) -> Path:
    path = tmp_path / "trace.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_capacity_must_stay_within_the_jobs_bounds(tmp_path):
    # quickstart: 1..4 workers, 4 at the start.
    with pytest.raises(TraceError, match=r"events\[0\]\.join\.count=1 .* more than "
                                         r"spec\.elastic\.maxWorkers=4"):
        gp.load_trace(_write(tmp_path, _doc({"atSeconds": 1, "join": {"count": 1}})))
    with pytest.raises(TraceError, match=r"events\[1\]\.kill\.count=2 .* leaves 0 workers"):
        gp.load_trace(_write(tmp_path, _doc(
            {"atSeconds": 1, "preempt": {"count": 2, "noticeSeconds": 1}},
            {"atSeconds": 2, "kill": {"count": 2}})))
    with pytest.raises(TraceError, match="no such file"):
        gp.load_trace(_write(tmp_path, {**_doc({"atSeconds": 1, "kill": {"count": 1}}),
                                        "job": "nope.yaml"}))


def test_load_sets_steps_and_checkpoints_in_the_job(tmp_path):
    trace, manifest = gp.load_trace(_write(tmp_path, _doc({"atSeconds": 1, "kill": {"count": 1}},
                                                          steps=12)))
    assert manifest["spec"]["training"]["steps"] == 12
    assert manifest["spec"]["checkpoint"]["intervalSteps"] == 4
    assert trace.initial_workers == 4                        # from spec.elastic.maxWorkers


def test_the_shipped_trace_is_valid():
    trace, manifest = gp.load_trace(ROOT / "examples" / "spot-trace.yaml")
    assert len(trace.events) >= 6 and manifest["spec"]["training"]["steps"] >= 200
    assert trace.initial_workers == 4 and manifest["spec"]["model"]["preset"] == "gpt-tiny"
    assert {e.kind for e in trace.events} == set(gp.KINDS)


def test_cli_reports_a_bad_trace(tmp_path):
    from dynatrain.cli.app import main

    path = _write(tmp_path, _doc({"atSeconds": 1, "preempt": {"count": 1}}))
    assert main(["bench", "goodput", "--trace", str(path)]) == 2


# -- the accounting -------------------------------------------------------------------------------
def _line(gen, steps, t0, dt=1.0):
    return [StepSpan(s, gen, t0 + i * dt, t0 + (i + 1) * dt) for i, s in enumerate(steps)]


def test_no_events_every_step_counts():
    r = gp.account(_line(1, range(1, 11), 100.0))
    assert r == {"goodput": 1.0, "wall_seconds": 10.0, "counted_seconds": 10.0,
                 "steps_lost": 0, "lost_seconds": 0.0, "steps": 10}


def test_a_restart_loses_the_steps_since_the_checkpoint_and_the_gap():
    # Steps 1..7 at t=0..7; restart (checkpoint 4) takes 5 s; steps 5..10 again at t=12..18.
    spans = _line(1, range(1, 8), 0.0) + _line(2, range(5, 11), 12.0)
    r = gp.account(spans)
    assert r["steps"] == 10 and r["steps_lost"] == 3            # 5, 6, 7 trained twice
    assert r["wall_seconds"] == 18.0 and r["counted_seconds"] == 10.0
    assert r["lost_seconds"] == 3.0 and r["goodput"] == pytest.approx(10 / 18)
    assert gp.restart_steps_lost([{"from_step": 7, "checkpoint_step": 4}]) == 3


def test_a_step_trained_three_times_counts_once():
    spans = (_line(1, range(1, 7), 0.0) + _line(2, range(5, 7), 10.0)
             + _line(3, range(5, 9), 20.0))
    r = gp.account(spans)
    assert r["steps_lost"] == 4 and r["counted_seconds"] == 8.0 and r["wall_seconds"] == 24.0
    assert gp.restart_steps_lost([{"from_step": 6, "checkpoint_step": 4},
                                  {"from_step": 6, "checkpoint_step": 4}]) == 4


def test_a_live_switch_loses_no_step_only_its_pause():
    spans = _line(1, range(1, 6), 0.0) + _line(2, range(6, 11), 5.5)
    r = gp.account(spans)
    assert r["steps_lost"] == 0 and r["goodput"] == pytest.approx(10 / 10.5)


def test_time_to_first_step_is_to_the_first_layout_decided_after_the_event():
    spans = (_line(1, range(1, 6), 0.0) + _line(2, range(6, 8), 7.0)
             + _line(3, range(8, 11), 12.0))
    # Decided at 6 (generation 2 starts at 7), and at 11 (generation 3 at 12).
    assert gp.time_to_first_step(5.0, spans, [0.0, 6.0, 11.0]) == 3.0   # 8 - 5
    # A layout decided before the event does not answer it, even if it started after it.
    assert gp.time_to_first_step(6.5, spans, [0.0, 6.0, 11.0]) == 13.0 - 6.5
    assert gp.time_to_first_step(11.5, spans, [0.0, 6.0, 11.0]) is None
    assert gp.account([])["goodput"] == 0.0


# -- both modes, end to end -----------------------------------------------------------------------
@pytest.mark.slow
def test_both_modes_on_a_tiny_trace(tmp_path):
    path = _write(tmp_path, _doc({"atSeconds": 1, "kill": {"count": 1}},
                                 {"atSeconds": 2, "join": {"count": 1}},
                                 steps=16, initialWorkers=2))
    proc = subprocess.run([sys.executable, "-m", "dynatrain", "bench", "goodput", "--trace",
                           str(path), "--json", "--keep", str(tmp_path / "keep")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    for key in ("live", "restart", "goodput_ratio", "trace_events", "checkpoint_every",
                "wall_seconds"):
        assert key in r
    for mode in gp.MODES:
        run = r[mode]
        assert run["outcome"] == "finished" and run["steps"] == 16
        assert run["samples_exactly_once"] is True
        assert 0 < run["goodput"] <= 1 and run["steps_lost"] >= 0
        for key in ("wall_seconds", "counted_seconds", "lost_seconds", "events", "restarts"):
            assert key in run
    live, restart = r["live"], r["restart"]
    assert live["restarts"] == [] and live["recoveries"] >= 1    # the kill, recovered live
    # The restart run: one restart per capacity event, each back to its newest checkpoint.
    assert len(restart["events"]) == 2 and len(restart["restarts"]) == 2
    for rs in restart["restarts"]:
        assert rs["checkpoint_step"] % 4 == 0
        assert 0 <= rs["from_step"] - rs["checkpoint_step"] <= 4
    assert restart["steps_lost"] == gp.restart_steps_lost(restart["restarts"])
    assert r["goodput_ratio"] == pytest.approx(live["goodput"] / restart["goodput"])
    assert all("time_to_first_step" in e for e in restart["events"])

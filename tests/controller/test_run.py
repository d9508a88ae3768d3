"""`dynatrain run` end to end: the quickstart with its scenario (shrink, grow, re-layout) on
real worker processes, scraped by a real Prometheus, against the same job without switches.

What a person watching the run sees is checked against the run's own summary: the loss series
Prometheus scraped from the workers, step for step; the TensorBoard events the job's rank 0
wrote, read back by TensorBoard's own reader (every step's loss, one marker per switch); the
step lines in the rank-0 worker's log."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness.prometheus_server import PrometheusServer, require_prometheus

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SCENARIO = ROOT / "examples" / "scenario.yaml"
pytestmark = pytest.mark.slow


def _run(tmp: Path, name: str, *extra: str) -> dict:
    summary = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "dynatrain", "run", str(QUICKSTART), "--summary-json",
           str(summary), "--run-dir", str(tmp / name), *extra]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0, f"exit {proc.returncode}"
    out = json.loads(summary.read_text())
    out["stdout"], out["wall"] = proc.stdout, time.monotonic() - t0
    return out


def _values(result) -> list[float]:
    return [float(r["value"][1]) for r in result]


@pytest.fixture
def prometheus():
    """A real Prometheus scraping every 0.2 s: faster than the quickstart's steps, so that
    its loss series has (nearly) every step."""
    with PrometheusServer(require_prometheus(), scrape_interval="200ms") as server:
        yield server


def test_quickstart_with_switches_follows_the_run_without(tmp_path, prometheus):
    sd = prometheus.workdir / "targets.json"
    started = time.time()
    elastic = _run(tmp_path, "elastic", "--scenario", str(SCENARIO), "--prometheus-sd", str(sd),
                   "--report", str(tmp_path / "report"))
    steps = elastic["steps"]
    assert steps == 80
    reasons = [s["reason"] for s in elastic["switches"]]
    assert {"preemption", "scale-up", "requested"} <= set(reasons), elastic["switches"]
    for s in elastic["switches"]:
        assert s["pause_seconds"] > 0 and s["from"] != s["to"] and s["result"] == "success"
    assert any(s["bytes"] > 0 for s in elastic["switches"])
    shrink = next(s for s in elastic["switches"] if s["reason"] == "preemption")
    grow = next(s for s in elastic["switches"] if s["reason"] == "scale-up")
    assert shrink["workers_after"] < shrink["workers_before"]
    assert grow["workers_after"] > grow["workers_before"]
    assert elastic["switches"][-1]["to"].startswith("dp=1,tp=2,pp=2")
    # every sample of the stream consumed exactly once, across all switches
    assert elastic["samples_exactly_once"] and elastic["samples_consumed"] == steps * 12
    for line in ("SWITCH", "preemption", "step"):
        assert line in elastic["stdout"]
    # Each layout that ran long enough was measured against the cost model: a stage's compute
    # is part of its slowest device's step, and the last layout has two stages.
    measured = elastic["measurements"]
    assert measured and measured[-1]["layout"].startswith("dp=1,tp=2,pp=2"), measured
    assert len(measured[-1]["stage_compute_seconds"]) == 2
    for m in measured:
        assert 0 < max(m["stage_compute_seconds"]) <= m["step_seconds"], m
        assert m["predicted_seconds"] > 0 and m["ratio"] > 0, m
        assert f"measured {m['layout']}: step " in elastic["stdout"]

    # the metrics, as a real Prometheus scraped them from the controller and the workers
    def q(expr):
        return _values(prometheus.query(expr))

    assert q('max_over_time(dynatrain_workers{role="controller"}[10m])') == [4.0]
    assert len(q('last_over_time(dynatrain_cost_model_step_seconds{role="controller"}[10m])')) \
        == 2                                        # measured and predicted
    switched = prometheus.query('max_over_time(dynatrain_switches_total{role="controller",'
                                'result="success"}[10m])')
    by_reason = {r["metric"]["reason"]: float(r["value"][1]) for r in switched}
    assert all(by_reason.get(r, 0) >= 1 for r in ("preemption", "scale-up", "requested")), \
        by_reason
    pauses = q('max_over_time(dynatrain_switch_duration_seconds_count{role="controller",'
               'phase="pause"}[10m])')
    assert sum(pauses) >= 3
    assert q('max(max_over_time(dynatrain_switch_bytes_total{role="controller"}[10m]))')[0] > 0
    tps = q('max_over_time(dynatrain_tokens_per_second{role="worker"}[10m])')
    assert tps and all(v > 0 for v in tps)
    assert max(q('max_over_time(dynatrain_step_duration_seconds_count{role="worker"}[10m])')) \
        >= 10
    layouts = prometheus.query('last_over_time(dynatrain_layout_info{role="controller"}[10m])')
    assert {r["metric"]["tp"] for r in layouts} >= {"2"}
    workers_seen = {r["metric"]["device"] for r in prometheus.query(
        'max_over_time(up{role="worker"}[10m]) == 1')}
    assert len(workers_seen) >= 4

    # The picture of the run, its path the last thing said (its content: test_report.py).
    png = tmp_path / "report" / "quickstart-run.png"
    assert elastic["stdout"].rstrip().splitlines()[-1].strip() == f"report: {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000
    _check_loss_series(prometheus, elastic)
    _check_tensorboard(tmp_path / "elastic" / "tensorboard", elastic)
    _check_step_lines(tmp_path / "elastic", elastic)
    times = [r["time"] for r in elastic["step_log"]]
    assert [r["step"] for r in elastic["step_log"]] == list(range(1, steps + 1))
    assert all(t is not None for t in times) and times == sorted(times), times

    # every Grafana panel of the Helm chart's dashboard shows data for this run
    from dynatrain.operator.chart import dashboard_queries

    ended = time.time()
    # (the quickstart manifest names no namespace: it runs as default/quickstart)
    for title, expr in dashboard_queries(rate_interval="1m", variables={
            "namespace": "default", "job": "quickstart"}):
        series = prometheus.query_range(expr, started, ended + 30, step=2)
        values = [float(v) for s in series for _, v in s["values"]]
        finite = [v for v in values if v == v and abs(v) != float("inf")]
        assert finite, f"dashboard panel {title!r} has no data for a real run: {expr}"

    # the same job without switches: the same loss curve
    steady = _run(tmp_path, "steady")
    assert steady["switches"] == [] and steady["samples_exactly_once"]
    assert len(steady["losses"]) == len(elastic["losses"]) == steps
    for step, (a, b) in enumerate(zip(elastic["losses"], steady["losses"]), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} with switches, {b} without"


def _check_loss_series(prometheus, run) -> None:
    """The loss series the workers exported (rank 0's, moving between pods at a switch), as
    Prometheus stored it, equals the run's losses step for step: every scrape pairs a
    ``dynatrain_training_step`` with its ``dynatrain_loss`` (one lock on the worker's side)."""
    def raw(name) -> dict:
        out = {}
        for series in prometheus.query(f'{name}{{role="worker"}}[10m]'):
            for at, v in series["values"]:
                out[(series["metric"]["instance"], at)] = float(v)
        return out

    losses, steps = raw("dynatrain_loss"), raw("dynatrain_training_step")
    assert losses and losses.keys() == steps.keys()
    seen = {}
    for key, loss in losses.items():
        step = int(steps[key])
        assert loss == run["losses"][step - 1], (step, loss, run["losses"][step - 1])
        seen[step] = loss
    # Scraped 5 times a second: the quickstart's steps take longer, bar a few around switches.
    print(f"loss series: {len(seen)} of {run['steps']} steps scraped, every one equal")
    assert len(seen) >= 0.75 * run["steps"], sorted(seen)
    exporters = {key[0] for key in losses}
    assert exporters, "no worker exported the loss"
    # Never two workers at once: one rank 0 at a time.
    at_once = {}
    for instance, at in losses:
        at_once.setdefault(round(at, 1), set()).add(instance)
    assert max(len(v) for v in at_once.values()) == 1


def _check_tensorboard(directory, run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    losses = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(losses) == list(range(1, run["steps"] + 1))
    for step, loss in losses.items():          # TensorBoard keeps float32
        assert loss == pytest.approx(run["losses"][step - 1], rel=1e-6), step
    switches = [s for s in run["switches"] if s["from"]]
    assert [e.step for e in acc.Scalars("events/pause_ms")] == [s["step"] for s in switches]
    markers = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("events/text_summary")]
    assert len(markers) == len(switches)
    for marker, s in zip(markers, switches):
        assert s["reason"] in marker and s["to"] in marker, (marker, s)


def _check_step_lines(run_dir, run) -> None:
    """The job's rank 0 logs a step line every 10 steps (loss to 6 places) and a line per
    switch; exactly one worker says each."""
    lines = [line for log in sorted(run_dir.glob("worker-*.log"))
             for line in log.read_text().splitlines() if "rank 0): " in line]
    said = {}
    for line in lines:
        text = line.split("rank 0): ", 1)[1]
        if text.startswith("step "):
            step = int(text.split()[1].split("/")[0])
            assert step not in said, f"step {step} said twice"
            said[step] = float(text.split("loss ")[1].split()[0])
    assert sorted(said) == list(range(10, run["steps"] + 1, 10)), sorted(said)
    for step, loss in said.items():
        assert loss == pytest.approx(run["losses"][step - 1], abs=1e-6)
    switch_lines = [line for line in lines if "): SWITCH " in line]
    assert len(switch_lines) == len([s for s in run["switches"] if s["from"]]), switch_lines


def test_an_moe_run_measures_its_tokens_per_expert(tmp_path):
    """moe-tiny on dp=2,ep=2: the measurement carries the tokens routed to each of the 8
    experts, summed over the generation's steps (every step routes global batch x seqLen
    tokens to top-2 experts in each of 4 layers), and the busiest EP rank's share."""
    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["metadata"]["name"] = "moe"
    doc["spec"].update({"model": {"preset": "moe-tiny"},
                        "elastic": {"minWorkers": 2, "maxWorkers": 2},
                        "parallelism": {"mode": "fixed", "layout": "dp=2,ep=2"},
                        "globalBatchSize": 4})
    doc["spec"]["training"].update({"steps": 12, "seqLen": 16})
    job = tmp_path / "moe.yaml"
    job.write_text(yaml.safe_dump(doc))
    summary = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, "-m", "dynatrain", "run", str(job), "--summary-json",
                           str(summary), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (m,) = [m for m in json.loads(summary.read_text())["measurements"]
            if m["layout"] == "dp=2,tp=1,pp=1,ep=2"]
    per_step = 4 * 16 * 2 * 4
    assert len(m["expert_tokens"]) == 8 and sum(m["expert_tokens"]) % per_step == 0, m
    assert sum(m["expert_tokens"]) >= m["steps"] * per_step, m
    ranks = [sum(m["expert_tokens"][:4]), sum(m["expert_tokens"][4:])]
    assert m["ep_imbalance"] == pytest.approx(max(ranks) * 2 / sum(ranks), abs=1e-4), m
    assert "experts' tokens max/mean" in proc.stdout

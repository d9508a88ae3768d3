"""`dynatrain run` end to end: the quickstart with its scenario (shrink, grow, re-layout) on
real worker processes, scraped by a real Prometheus, against the same job without switches."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prometheus_server import prometheus  # noqa: F401  (fixture)

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


def test_quickstart_with_switches_follows_the_run_without(tmp_path, prometheus):  # noqa: F811
    sd = prometheus.workdir / "targets.json"
    started = time.time()
    elastic = _run(tmp_path, "elastic", "--scenario", str(SCENARIO), "--prometheus-sd", str(sd))
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

    # the metrics, as a real Prometheus scraped them from the controller and the workers
    def q(expr):
        return _values(prometheus.query(expr))

    assert q('max_over_time(dynatrain_workers{role="controller"}[10m])') == [4.0]
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

"""Two jobs at once under one operator, one Prometheus and one dashboard: each panel shows its own.

Every ``dynatrain_*`` series carries the job's ``namespace`` and ``job`` labels (agent/metrics.py).
Here two small jobs run side by side on the dev cluster (the operator and the pod runner as in
test_operator.py) and make a different number of layout switches each (a requested layout,
``spec.parallelism``); a real Prometheus scrapes the operator's endpoint and every worker's
agent (port 9400 on its loopback pod IP), with the target labels the chart's ServiceMonitor
and PodMonitor give them — including the colliding ones, ``job`` (the scrape job) and, for the
operator, ``namespace`` (its own) — and ``honor_labels: true``, as the monitors set it. Then
every panel of the chart's Grafana dashboard, with ``$namespace``/``$job`` filled in for one
job, must return that job's series only, with values that agree with the job's status (its
workers, generation, layout, the pauses and bytes of its switches in ``status.lastSwitch``).
Deleting one job removes its series from the operator's endpoint, and so from Prometheus.
"""

from __future__ import annotations

import math

import pytest
import yaml
from kubernetes import client

from dynatrain.agent.metrics import SWITCH_BUCKETS
from dynatrain.operator.chart import dashboard_queries
from dynatrain.operator.cluster import METRICS_PORT
from dynatrain.vps.layout import parse_layout
from harness.operator_process import GROUP, PLURAL, VERSION, get as _get, job as _job, wait as _wait
from harness.prometheus_server import PrometheusServer, require_prometheus

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

SWITCHES = {"alpha": 1, "beta": 2}
"""Layout switches each job makes: different counts, so that one job's counters adding into
the other's would show."""
RATE_INTERVAL = "10m"
"""Longer than the test: each rate() and increase() sees every switch of the job."""


def _status(custom, namespace, name) -> dict:
    return _get(custom, namespace, name).get("status", {})


def _other(layout: str) -> str:
    """A two-worker layout that is not ``layout``."""
    return "dp=1,tp=2,pp=1" if parse_layout(layout).dp == 2 else "dp=2,tp=1,pp=1"


def _switch(custom, namespace, name, target: str) -> dict:
    """Request ``target`` and wait for the switch to it; returns ``status.lastSwitch``."""
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {
        "spec": {"parallelism": {"mode": "fixed", "layout": target}}})

    def switched():
        st = _status(custom, namespace, name)
        last = st.get("lastSwitch", {})
        done = (st.get("phase") == "Running" and last.get("to")
                and parse_layout(last["to"]).to_text() == parse_layout(target).to_text())
        return last if done else None

    last = _wait(f"{name}'s switch to {target}", switched, timeout=120)
    assert last["result"] == "success" and last["reason"] == "requested", last
    return last


def _bucket(seconds: float) -> tuple[float, float]:
    """The switch-duration histogram bucket ``seconds`` falls in: (lower, upper] bound."""
    bounds = (0.0, *SWITCH_BUCKETS, math.inf)
    return next((lo, hi) for lo, hi in zip(bounds, bounds[1:]) if seconds <= hi)


@pytest.mark.timeout(600)        # two jobs to start and switch on a small machine
def test_each_panel_shows_one_job(devcluster, kubectl, namespace, operator, tmp_path):
    op, _pods = operator
    core = devcluster.core()
    custom = client.CustomObjectsApi(devcluster.api_client())
    with PrometheusServer(require_prometheus()) as prom:
        # The operator as the ServiceMonitor makes it a target: job = the Service's name,
        # namespace = the operator's own (not the jobs').
        prom.add_targets("dynatrain-metrics", [f"127.0.0.1:{op.metrics_port}"],
                         {"role": "controller", "namespace": "dynatrain-system"})
        for name in SWITCHES:
            doc = _job(name, gpus=1, max_workers=2)
            # A fixed first layout of both workers: the job starts once both are up, so the
            # only switches are the ones requested below. Tensor-parallel first: the switch
            # to dp=2 moves bytes over the network (each worker fetches the half it lacks);
            # dp=2 -> tp=2 moves none (each already holds what it keeps).
            doc["spec"]["parallelism"] = {"mode": "fixed", "layout": "dp=1,tp=2,pp=1"}
            manifest = tmp_path / f"{name}.yaml"
            manifest.write_text(yaml.safe_dump(doc))
            kubectl("apply", "-n", namespace, "-f", str(manifest))

        def running(name):
            st = _status(custom, namespace, name)
            return st if st.get("phase") == "Running" and st.get("workers") == 2 else None

        started = {name: _wait(f"{name} to run on 2 workers", lambda: running(name),
                               timeout=150) for name in SWITCHES}
        # Every worker's agent, as the PodMonitor makes them targets (job = the PodMonitor's
        # <namespace>/<name>, namespace = the pod's).
        for name in SWITCHES:
            pods = core.list_namespaced_pod(namespace,
                                            label_selector=f"dynatrain.io/job={name}").items
            assert len(pods) == 2 and all(p.status.pod_ip for p in pods), pods
            for p in pods:
                prom.add_targets("dynatrain-system/dynatrain-workers",
                                 [f"{p.status.pod_ip}:{METRICS_PORT}"],
                                 {"role": "worker", "namespace": namespace,
                                  "pod": p.metadata.name})
        # Switch only once Prometheus has the jobs' counters at zero: increase() cannot see
        # the increment that creates a series.
        for name in SWITCHES:
            for role in ("controller", "worker"):
                prom.wait_for(f'dynatrain_step{{role="{role}", namespace="{namespace}", '
                              f'job="{name}"}}', lambda r: len(r) == (2 if role == "worker"
                                                                      else 1), timeout=40)

        switches = {name: [] for name in SWITCHES}
        for name, count in SWITCHES.items():
            layout = started[name]["layout"]
            for _ in range(count):
                layout = _other(layout)
                switches[name].append(_switch(custom, namespace, name, layout))
        status = {name: _status(custom, namespace, name) for name in SWITCHES}
        for name, st in status.items():
            assert st["lastSwitch"]["time"] == switches[name][-1]["time"], st
            prom.wait_for(f'dynatrain_generation{{role="controller", namespace="{namespace}", '
                          f'job="{name}"}} == {st["generation"]}', timeout=20)
            # The workers' step has gone past the switches (the steps after them scraped).
            prom.wait_for(f'dynatrain_step{{role="worker", namespace="{namespace}", '
                          f'job="{name}"}} > {switches[name][-1]["step"]}', timeout=30)

        # The dashboard's variables: one namespace (the jobs', not the operator's target
        # label), and in it the two jobs (not the scrape jobs).
        assert prom.label_values("namespace", "dynatrain_step") == [namespace]
        assert prom.label_values("job", f'dynatrain_step{{namespace="{namespace}"}}') == \
            sorted(SWITCHES)
        [up] = prom.query('up{role="controller"}')     # the target's own job is kept for up
        assert up["metric"]["job"] == "dynatrain-metrics"

        at = prom.query("time()")[0]["value"][0]         # every panel read at one instant
        for name in SWITCHES:
            _check_panels(prom, at, namespace, name, status[name], switches[name])

        # Deleting a job drops its series from the operator's endpoint, and Prometheus
        # sees them go (stale at the next scrape); the other job's stay.
        assert _operator_series(op, namespace) == set(SWITCHES)
        kubectl("delete", "dynatrainjob", "alpha", "-n", namespace, "--wait=true",
                "--timeout=60s")
        _wait("alpha's series to leave the operator's /metrics",
              lambda: _operator_series(op, namespace) == {"beta"}, timeout=30)
        prom.wait_for(f'dynatrain_workers{{role="controller", namespace="{namespace}", '
                      'job="alpha"}', lambda r: not r, timeout=20)
        assert prom.query(f'dynatrain_workers{{role="controller", namespace="{namespace}", '
                          'job="beta"}')
        kubectl("delete", "dynatrainjob", "beta", "-n", namespace, "--wait=false")


def _operator_series(op, namespace) -> set[str]:
    """The jobs the operator's endpoint has series of (its own reconcile histogram included)."""
    jobs = set()
    for (name, labels), _ in op.metrics().items():
        labels = dict(labels)
        if name.startswith("dynatrain_") and labels.get("namespace") == namespace:
            jobs.add(labels["job"])
    return jobs


def _check_panels(prom, at, namespace, name, st, switches) -> None:
    """Every panel's query for job ``name``: only its series, and its status's numbers."""
    last = switches[-1]
    pauses = [s["pauseSeconds"] for s in switches]
    layout = parse_layout(st["layout"])
    queries = dashboard_queries(RATE_INTERVAL, variables={"namespace": namespace, "job": name})
    # The job-wide training figures (loss, learning rate, ...) come from the job's rank 0
    # alone: a switch that gives rank 0 to the other pod leaves a moment (until the new one's
    # first step after it is scraped) without them. Read this job's panels at an instant they
    # are there: ``at`` itself, unless it fell in that moment.
    [rank0] = [expr for title, expr in queries if title == "Loss"]
    if not prom.query(rank0, at=at):
        prom.wait_for(rank0, timeout=30)
        at = prom.query("time()")[0]["value"][0]
    by_title: dict[str, list] = {}
    for title, expr in queries:
        result = prom.query(expr, at=at)
        assert result, f"{name}: panel {title!r} shows nothing: {expr}"
        for series in result:
            # Only this job: each panel keeps the identity labels, and they are this job's.
            assert (series["metric"].get("namespace"), series["metric"].get("job")) == \
                (namespace, name), (title, series)
        by_title.setdefault(title, []).append(result)

    def value(result) -> float:
        [series] = result
        return float(series["value"][1])

    assert value(by_title["Workers"][0]) == st["workers"] == 2
    workers, gpus = by_title["Workers and GPUs"]
    assert value(workers) == st["workers"] and value(gpus) == st["workers"] * 1
    assert value(by_title["Generation"][0]) == st["generation"]
    [shown] = by_title["Layout"][0]
    assert {k: int(shown["metric"][k]) for k in ("dp", "tp", "pp", "ep", "zero")} == {
        "dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep,
        "zero": layout.zero}
    assert value(by_title["Training step"][0]) > last["step"]

    # Counters: increase() over a window that holds the whole job, from series that started
    # at 0, extrapolates only to the window's end, by at most 1.1 scrape intervals over the
    # series' span of (samples - 1) intervals: high by 1 % on a job scraped for minutes, by
    # ~12 % on one scraped for 10 s, never low. The other job's bytes would add 50 % or more.
    counts = {(s["metric"]["reason"], s["metric"]["result"]): float(s["value"][1])
              for s in by_title["Switches by reason and result"][0]}
    assert round(counts.pop(("requested", "success"))) == len(switches), counts
    assert all(round(v) == 0 for v in counts.values()), counts
    bytes_moved = {s["metric"]["reason"]: float(s["value"][1])
                   for s in by_title["Bytes moved by switches"][0]}
    assert sum(s["bytes"] for s in switches) > 0
    exact = sum(s["bytes"] for s in switches)
    [samples] = prom.query(f'count_over_time(dynatrain_switch_bytes_total{{role="controller", '
                           f'namespace="{namespace}", job="{name}", reason="requested"}}'
                           f'[{RATE_INTERVAL}])', at=at)
    span = max(1.0, float(samples["value"][1]) - 1)          # in scrape intervals
    assert exact * (1 - 1e-9) <= bytes_moved.pop("requested") <= exact * (1 + 1.2 / span), (
        bytes_moved, exact, span)
    assert all(v == 0 for v in bytes_moved.values()), bytes_moved

    # Histograms: a quantile lies in the bucket of an observed pause (linear interpolation
    # inside it); the mean (rate of the sum over rate of the count: the same extrapolation
    # cancels) is the pauses' mean.
    low, high = _bucket(min(pauses))[0], _bucket(max(pauses))[1]
    for result in by_title["Switch pause p50 / p95 / p99"]:
        assert low <= value(result) <= high, (value(result), pauses)
    p95_by_phase, mean_by_phase = by_title["Switch duration by phase"]
    assert {s["metric"]["phase"] for s in p95_by_phase} == {"prepare", "pause", "transfer"}
    [p95] = [s for s in p95_by_phase if s["metric"]["phase"] == "pause"]
    assert low <= float(p95["value"][1]) <= high
    [mean] = [s for s in mean_by_phase if s["metric"]["phase"] == "pause"]
    assert float(mean["value"][1]) == pytest.approx(sum(pauses) / len(pauses), rel=1e-3,
                                                    abs=1e-5)

    # Throughput and step time: the workers' own, finite and positive.
    for title in ("Step time p50 / p95", "Tokens per second", "Samples per second"):
        for result in by_title[title]:
            assert 0 < value(result) < math.inf, (title, result)
    [split] = by_title["Step time split"]
    phases = {s["metric"]["phase"]: float(s["value"][1]) for s in split}
    assert phases.keys() == {"compute", "communication", "redundancy"}, phases
    assert phases["compute"] > 0 and all(0 <= v < math.inf for v in phases.values()), phases

    # The training figures, rank 0's, one line per job (each panel's query returned one
    # series, checked by value()): a real loss, the job's learning rate (its spec has no
    # schedule: constant), a modelled MFU that is a fraction (the panel shows it in percent).
    assert 0 < value(by_title["Loss"][0]) < math.inf
    assert 0 < value(by_title["Gradient norm"][0]) < math.inf
    assert value(by_title["Learning rate"][0]) == pytest.approx(
        _job(name)["spec"]["training"]["learningRate"], rel=1e-6)
    assert 0 < value(by_title["MFU"][0]) <= 1

    # The switches annotation: this job's, as many as it made, each with its reason.
    marks = {(s["metric"]["reason"], s["metric"]["result"]): float(s["value"][1])
             for s in by_title["Switches"][0]}
    assert marks.keys() == {("requested", "success")}, marks
    assert round(marks["requested", "success"]) == len(switches), marks

"""The Grafana dashboard's PromQL, checked by a real Prometheus parser.

Every query of every panel (charts/dynatrain/dashboards/dynatrain.json, as listed by
:func:`dynatrain.operator.chart.dashboard_queries` with the Grafana variables filled in) must parse and
type-check in the ``prometheus`` binary, and may only use metric names that DynaTrain exports
(agent/metrics.py). Whether the queries return the right numbers from a real run is another
test's job (tests/k8s/test_metrics_per_job.py: two jobs at once, each panel showing only its
own); this one catches a broken query without needing a run.

The dashboard shows one job: its ``namespace`` and ``job`` variables are the labels every
DynaTrain series carries (the DynaTrainJob's namespace and name), and every selector filters on
both. ``job`` is also the label Prometheus gives every scraped series (the scrape config's
name): the series' own must win, which is what ``honor_labels: true`` on the scrape config does
(the chart's ServiceMonitor and PodMonitor set it; tests/agent/test_metrics.py shows what Prometheus
does without it). The name ``job`` is kept, not a ``dynatrain_job`` of our own, so that a job's
series read the same in PromQL as in ``kubectl get dynatrainjob -n <namespace> <job>``.

The annotation that marks layout switches on every graph is a query too, checked like the
panels'. The job-wide training figures (loss, learning rate, gradient norm, MFU, samples) come
from the job's rank 0 alone and move from pod to pod when a switch changes rank 0: their panels
take the max over the workers by (namespace, job), so that a handover does not split the line,
which :func:`test_training_panels_follow_rank_0_across_pods` shows on a real Prometheus.
"""

from __future__ import annotations

import json
import math
import re
import time

import pytest

from dynatrain.operator import chart
from dynatrain.agent.metrics import REASONS, STEP_PHASES, Metrics, TrainingSample
from harness.prometheus_server import PrometheusServer, require_prometheus

QUERIES = chart.dashboard_queries(rate_interval="1m")


@pytest.fixture(scope="module")
def prometheus():
    """One server for all the queries: parsing needs no data and no scrape targets."""
    with PrometheusServer(require_prometheus()) as server:
        yield server


def _exported_names() -> set[str]:
    """Every series name a DynaTrain process exposes (histograms with their suffixes)."""
    # Labelled series exist once used: one reason and one step make every name appear.
    # The training figures exist on the job's rank 0 (owner), the checkpoint's with them, and
    # the GPU memory on a GPU worker.
    metrics = Metrics(namespace="default", job="quickstart", reasons=("preemption",))
    metrics.observe_step(0.1, 1000.0, 1, phases=dict.fromkeys(STEP_PHASES, 0.03),
                         training=TrainingSample(step=1, loss=5.0, learning_rate=3e-4,
                                                 grad_norm=1.0, samples=12, mfu=0.4),
                         owner=True)
    metrics.observe_checkpoint(1)
    metrics.set_gpu_memory(1 << 30, 2 << 30)
    names = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def test_every_panel_has_a_query_and_no_variable_is_left():
    titles = {title for title, _ in QUERIES}
    assert len(QUERIES) >= 10 and len(titles) >= 8
    for title, expr in QUERIES:
        assert "$" not in expr, (title, expr)


def test_queries_use_only_exported_metrics():
    exported = _exported_names()
    for title, expr in QUERIES:
        used = set(re.findall(r"\b(dynatrain_[a-z_]+)\b", expr))
        assert used and used <= exported, (title, used - exported)


def test_switch_queries_read_the_controller_only():
    # Workers also count every switch they take part in: without the role filter a switch
    # would be counted once per worker.
    for title, expr in QUERIES:
        if "dynatrain_switch" in expr:
            assert expr.count("dynatrain_switch") == expr.count('role="controller"'), (title, expr)


def _dashboard() -> dict:
    return json.loads(chart.DASHBOARD.read_text())


def test_namespace_and_job_variables_list_the_jobs_one_at_a_time():
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    namespace, job = variables["namespace"], variables["job"]
    assert namespace["query"]["query"] == "label_values(dynatrain_step, namespace)"
    assert job["query"]["query"] == 'label_values(dynatrain_step{namespace="$namespace"}, job)'
    for v in (namespace, job):
        assert v["type"] == "query" and v["definition"] == v["query"]["query"]
        # One value each: the selectors below match it exactly (=, not =~).
        assert not v["multi"] and not v["includeAll"], v["name"]


def test_every_selector_filters_by_namespace_and_job():
    # Raw expressions, before substitution: every dynatrain_ selector, in every panel and
    # annotation.
    raw = [expr for _, expr in chart.dashboard_exprs()]
    assert len(raw) == len(QUERIES)
    for expr in raw:
        selectors = re.findall(r"\b(dynatrain_[a-z_]+)(\{[^}]*\})?", expr)
        assert selectors, expr
        for name, matchers in selectors:
            assert 'namespace="$namespace"' in matchers and 'job="$job"' in matchers, \
                (name, expr)


def test_substituted_variables_reach_every_query():
    for title, expr in chart.dashboard_queries(variables={"namespace": "team-a",
                                                          "job": "llama"}):
        assert 'namespace="team-a"' in expr and 'job="llama"' in expr, (title, expr)


def test_every_aggregation_keeps_the_job_labels():
    # Each result series must say whose it is (tests/k8s/test_metrics_per_job.py checks every
    # one against the job asked for): every `by (...)` keeps namespace and job, none drops
    # labels with `without`.
    for title, expr in QUERIES:
        assert " without " not in expr, (title, expr)
        for grouping in re.findall(r"\bby \(([^)]*)\)", expr):
            labels = {label.strip() for label in grouping.split(",")}
            assert {"namespace", "job"} <= labels, (title, expr)


# -- the training figures --------------------------------------------------------------------

JOB_WIDE = ("dynatrain_loss", "dynatrain_learning_rate", "dynatrain_grad_norm", "dynatrain_mfu",
            "dynatrain_samples_total", "dynatrain_training_step",
            "dynatrain_checkpoint_age_seconds", "dynatrain_checkpoint_step")
"""The figures only the job's rank 0 exports (agent/metrics.py), one pod at a time."""
TRAINING_PANELS = {"Loss": "dynatrain_loss", "Learning rate": "dynatrain_learning_rate",
                   "Gradient norm": "dynatrain_grad_norm", "MFU": "dynatrain_mfu",
                   "Samples per second": "dynatrain_samples_total",
                   "Tokens per second": "dynatrain_tokens_per_second"}


def _top_panels() -> list[dict]:
    return _dashboard()["panels"]


def test_training_row_holds_loss_lr_grad_norm_mfu_and_throughput():
    panels = _top_panels()
    rows = {p["title"]: p["gridPos"]["y"] for p in panels if p["type"] == "row"}
    # Near the top: right under the job's stats, above the switches.
    assert rows["Training"] < rows["Layout switches"] and \
        rows["Training"] == min(y for t, y in rows.items() if t != "Job")
    following = sorted(y for y in rows.values() if y > rows["Training"])[0]
    in_row = {p["title"] for p in panels
              if p["type"] != "row" and rows["Training"] < p["gridPos"]["y"] < following}
    assert set(TRAINING_PANELS) <= in_row, in_row
    queries = {}
    for title, expr in QUERIES:
        queries.setdefault(title, []).append(expr)
    for title, metric in TRAINING_PANELS.items():
        assert [re.search(rf"\b{metric}\b", e) is not None for e in queries[title]] == [True], \
            (title, queries[title])
    [mfu] = [p for p in panels if p["title"] == "MFU"]
    # dynatrain_mfu is a fraction (0..1): Grafana's "percentunit" shows 0.42 as 42 %.
    defaults = mfu["fieldConfig"]["defaults"]
    assert defaults["unit"] == "percentunit" and (defaults["min"], defaults["max"]) == (0, 1)
    [split] = [p for p in panels if p["title"] == "Step time split"]
    assert split["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert 'by (namespace, job, phase)' in split["targets"][0]["expr"]


def test_job_wide_figures_are_one_line_per_job_over_the_workers():
    # Rank 0's series moves between pods at a switch: `max by (namespace, job)` over the
    # workers' series (right around the selector, before any rate) joins the pieces into one
    # line; a grouping that kept pod or instance would split it.
    used = set()
    for title, expr in chart.dashboard_exprs():
        for name, matchers in re.findall(r"\b(dynatrain_[a-z_]+)(\{[^}]*\})", expr):
            if name in JOB_WIDE:
                used.add(name)
                assert 'role="worker"' in matchers, (title, expr)
                assert f"max by (namespace, job) ({name}{matchers})" in expr, (title, expr)
    assert {"dynatrain_loss", "dynatrain_learning_rate", "dynatrain_grad_norm",
            "dynatrain_mfu", "dynatrain_samples_total"} <= used, used


def test_panels_do_not_overlap():
    boxes = [(p["title"], p["gridPos"]) for p in _top_panels()]
    for title, g in boxes:
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, title
    for i, (a, ga) in enumerate(boxes):
        for b, gb in boxes[i + 1:]:
            apart = (ga["x"] + ga["w"] <= gb["x"] or gb["x"] + gb["w"] <= ga["x"]
                     or ga["y"] + ga["h"] <= gb["y"] or gb["y"] + gb["h"] <= ga["y"])
            assert apart, (a, ga, b, gb)
    ids = [p["id"] for p in chart._panels(_top_panels())]
    assert len(ids) == len(set(ids)), ids


def test_switches_are_annotations_from_the_controller():
    annotations = {a["name"]: a for a in _dashboard()["annotations"]["list"]}
    switches = annotations["Switches"]
    assert switches["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert switches["enable"] and not switches["hide"]
    # Grafana marks where the value is > 0 (merging points one step apart into a region): the
    # switches counted in each window, by reason and result, only where there were some.
    # The window is $__rate_interval, longer than the step by a scrape interval, so that no
    # switch falls between two windows.
    expr = switches["expr"]
    assert re.fullmatch(r'sum by \(namespace, job, reason, result\) \(increase\('
                        r'dynatrain_switches_total\{role="controller", namespace="\$namespace", '
                        r'job="\$job"\}\[\$__rate_interval\]\)\) > 0', expr), expr
    assert switches["useValueForTime"] is False and switches["step"]
    assert "{{reason}}" in switches["titleFormat"] and "{{result}}" in switches["titleFormat"]
    assert set(switches["tagKeys"].split(",")) == {"reason", "result"}
    # ... and it is among the queries the tests here (and the k8s one) run.
    assert [t for t, _ in QUERIES].count("Switches") == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_training_panels_follow_rank_0_across_pods(prometheus):
    """Two workers' endpoints and a controller's, scraped by a real Prometheus; rank 0 goes
    from pod a to b and back (two switches): each training panel draws one line throughout,
    samples/s is the true rate (a sum of per-pod rates would count pod a's second tenure's
    samples twice), and the annotation marks each switch once, with its reason."""
    ns, job = "team-a", "llama"
    pods = {pod: Metrics(namespace=ns, job=job) for pod in "ab"}
    controller = Metrics(namespace=ns, job=job, reasons=REASONS)
    servers = []
    try:
        for pod, m in pods.items():
            server, port = m.serve()
            servers.append(server)
            prometheus.add_targets(f"worker-{pod}", [f"127.0.0.1:{port}"],
                                   {"role": "worker", "pod": pod})
        server, port = controller.serve()
        servers.append(server)
        prometheus.add_targets("controller", [f"127.0.0.1:{port}"], {"role": "controller"})
        prometheus.wait_for("count(up == 1) == 3", timeout=40)
        prometheus.wait_for('dynatrain_switches_total{role="controller"}', timeout=10)

        step, samples, period = 0, 0, 0.05
        losses, ticks, switched = set(), [], []
        for tenure, owner in enumerate("aba"):
            if tenure:
                switched.append(time.time())
                controller.observe_switch("requested", "success", {"pause": 0.01}, 0)
                pods["b" if owner == "a" else "a"].observe_training_owner(False)
            end = time.time() + 3.0
            while time.time() < end:
                step, samples = step + 1, samples + 12
                loss = 5.0 / math.sqrt(step)
                losses.add(loss)
                figures = TrainingSample(step=step, loss=loss, learning_rate=3e-4,
                                         grad_norm=1.25, samples=samples, mfu=0.375)
                for pod, m in pods.items():
                    m.observe_step(period, 4096.0, step, phases={
                        "compute": 0.03, "communication": 0.01 if pod == "a" else 0.03,
                        "redundancy": 0.005}, training=figures, owner=pod == owner)
                ticks.append((time.time(), samples))
                time.sleep(period)
        time.sleep(2.5)                   # the last steps scraped
        start, stop = ticks[0][0], ticks[-1][0]
    finally:
        prometheus.clear_targets()
        for server in servers:
            server.shutdown()
            server.server_close()

    def run(rate_interval="2s"):             # a step (0.5 s) and a scrape (1 s) at least
        out = {}
        for title, expr in chart.dashboard_queries(rate_interval, variables={
                "namespace": ns, "job": job}):
            out.setdefault(title, []).append(prometheus.query_range(expr, start + 1, stop,
                                                                    step=0.5))
        return out

    panels = run()
    for title in ("Loss", "Learning rate", "Gradient norm", "MFU"):
        [[series]] = panels[title]            # one query, one line: no split at the handovers
        assert series["metric"] == {"namespace": ns, "job": job}, title
        times = [float(t) for t, _ in series["values"]]
        # At most a scrape without it, as the old rank 0 stops and the new one starts.
        assert max(b - a for a, b in zip(times, times[1:])) <= 2.0, (title, times)
        assert times[0] <= start + 2 and times[-1] >= stop - 1, (title, times)
    [[loss]] = panels["Loss"]
    assert {float(v) for _, v in loss["values"]} <= losses
    assert [float(v) for _, v in loss["values"]] == sorted(
        (float(v) for _, v in loss["values"]), reverse=True)
    assert {float(v) for _, v in panels["MFU"][0][0]["values"]} == {0.375}
    assert {float(v) for _, v in panels["Learning rate"][0][0]["values"]} == {3e-4}
    [split] = panels["Step time split"]
    # Averaged over the two workers, by phase.
    assert {s["metric"]["phase"]: float(s["values"][-1][1]) for s in split} == pytest.approx({
        "compute": 0.03, "communication": 0.02, "redundancy": 0.005})

    # Samples/s over one window holding all three tenures: the true rate.
    window = int(stop - start) - 1
    truth = [s for t, s in ticks if t >= stop - window]
    true_rate = (truth[-1] - truth[0]) / window
    [[rate]] = [r for title, r in run(f"{window}s").items() if title == "Samples per second"]
    [series] = rate
    assert float(series["values"][-1][1]) == pytest.approx(true_rate, rel=0.1), true_rate

    # The annotation: Grafana's regions (active points at most one step apart), one per
    # switch, each starting within a window and a scrape of the switch.
    [[marks]] = panels["Switches"]
    assert marks["metric"] == {"namespace": ns, "job": job, "reason": "requested",
                               "result": "success"}
    active = [float(t) for t, v in marks["values"] if float(v) > 0]
    regions = [[active[0]]]
    for t in active[1:]:
        if t - regions[-1][-1] <= 0.5:
            regions[-1].append(t)
        else:
            regions.append([t])
    assert len(regions) == len(switched), (regions, switched)
    for region, at in zip(regions, switched):
        assert at <= region[0] <= at + 2 + 1.5, (region, at)


@pytest.mark.parametrize("title,expr", QUERIES, ids=[f"{i}-{t}" for i, (t, _) in
                                                     enumerate(QUERIES)])
def test_query_parses_in_prometheus(prometheus, title, expr):
    formatted = prometheus.validate_promql(expr)
    assert formatted, (title, expr)

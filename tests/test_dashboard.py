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
(the chart's ServiceMonitor and PodMonitor set it; tests/test_metrics.py shows what Prometheus
does without it). The name ``job`` is kept, not a ``dynatrain_job`` of our own, so that a job's
series read the same in PromQL as in ``kubectl get dynatrainjob -n <namespace> <job>``.
"""

from __future__ import annotations

import json
import re

import pytest

from dynatrain.operator import chart
from dynatrain.agent.metrics import Metrics
from prometheus_server import PrometheusServer, require_prometheus

QUERIES = chart.dashboard_queries(rate_interval="1m")


@pytest.fixture(scope="module")
def prometheus():
    """One server for all the queries: parsing needs no data and no scrape targets."""
    with PrometheusServer(require_prometheus()) as server:
        yield server


def _exported_names() -> set[str]:
    """Every series name a DynaTrain process exposes (histograms with their suffixes)."""
    # Labelled series exist once used: one reason and one step make every name appear.
    metrics = Metrics(namespace="default", job="quickstart", reasons=("preemption",))
    metrics.observe_step(0.1, 1000.0, 1)
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
    # Raw expressions, before substitution: every dynatrain_ selector, in every panel.
    raw = [t["expr"] for p in chart._panels(_dashboard()["panels"])
           for t in p.get("targets", []) if t.get("expr")]
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


@pytest.mark.parametrize("title,expr", QUERIES, ids=[f"{i}-{t}" for i, (t, _) in
                                                     enumerate(QUERIES)])
def test_query_parses_in_prometheus(prometheus, title, expr):
    formatted = prometheus.validate_promql(expr)
    assert formatted, (title, expr)

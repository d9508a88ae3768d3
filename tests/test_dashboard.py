"""The Grafana dashboard's PromQL, checked by a real Prometheus parser.

Every query of every panel (charts/dynatrain/dashboards/dynatrain.json, as listed by
:func:`dynatrain.operator.chart.dashboard_queries` with the Grafana variables filled in) must parse and
type-check in the ``prometheus`` binary, and may only use metric names that DynaTrain exports
(agent/metrics.py). Whether the queries return the right numbers from a real run is another
test's job; this one catches a broken query without needing a run.
"""

from __future__ import annotations

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
    metrics = Metrics(reasons=("preemption",))
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
        used = set(re.findall(r"\b(dynatrain_[a-z_]+)\b", expr)) - {"dynatrain_job"}
        assert used and used <= exported, (title, used - exported)


def test_switch_queries_read_the_controller_only():
    # Workers also count every switch they take part in: without the role filter a switch
    # would be counted once per worker.
    for title, expr in QUERIES:
        if "dynatrain_switch" in expr:
            assert expr.count("dynatrain_switch") == expr.count('role="controller"'), (title, expr)


@pytest.mark.parametrize("title,expr", QUERIES, ids=[f"{i}-{t}" for i, (t, _) in
                                                     enumerate(QUERIES)])
def test_query_parses_in_prometheus(prometheus, title, expr):
    formatted = prometheus.validate_promql(expr)
    assert formatted, (title, expr)

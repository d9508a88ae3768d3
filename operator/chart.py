"""The Helm chart's two checked facts: its CRD copies and its dashboard's queries.

The chart (``charts/dynatrain``) carries a copy of the CRDs, because Helm installs only what
lies in a chart's own ``crds/`` directory. ``crds/`` at the top of the repository stays the one
source: :func:`sync_crd` re-copies it and :func:`crd_in_sync` is what the tests check
(``dynatrain chart check-crd`` on the command line). :func:`dashboard_queries` lists the Grafana
dashboard's PromQL with the Grafana variables substituted, so that tests can hand every panel's
query, and every annotation's (the switches marked on the graphs), to a real Prometheus.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHART_DIR = REPO / "charts" / "dynatrain"
CRD_SOURCE = REPO / "crds" / "dynatrainjob.yaml"
CHART_CRD = CHART_DIR / "crds" / "dynatrainjob.yaml"
CRD_SOURCES = (CRD_SOURCE,)
"""Every CRD file the chart carries a copy of."""
DASHBOARD = CHART_DIR / "dashboards" / "dynatrain.json"


# -- the chart's CRD copy -------------------------------------------------------------------

def _chart_copy(source: Path) -> Path:
    return CHART_DIR / "crds" / source.name


def crd_in_sync() -> bool:
    """Whether the chart's CRDs are byte-identical to their sources in ``crds/``."""
    return all(_chart_copy(src).is_file() and _chart_copy(src).read_bytes() == src.read_bytes()
               for src in CRD_SOURCES)


def sync_crd() -> bool:
    """Copy the CRDs of ``crds/`` into the chart; returns whether anything changed."""
    if crd_in_sync():
        return False
    CHART_CRD.parent.mkdir(parents=True, exist_ok=True)
    for src in CRD_SOURCES:
        shutil.copyfile(src, _chart_copy(src))
    return True


# -- the Grafana dashboard's queries --------------------------------------------------------

# What the dashboard's template variables become outside Grafana: the dashboard shows one job,
# by its namespace and name (every series carries both as labels; see agent/metrics.py), by
# default the quickstart example run locally (`dynatrain run examples/quickstart.yaml`, whose
# manifest names no namespace: "default"); gpus_per_worker is the text box the GPU curve
# multiplies by.
DEFAULT_VARIABLES = {"namespace": "default", "job": "quickstart", "gpus_per_worker": "1"}


def dashboard_queries(rate_interval: str = "1m", *,
                      variables: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` for every query of every panel of the Grafana dashboard,
    then ``(annotation name, PromQL)`` for every Prometheus annotation query (see
    :func:`dashboard_exprs`).

    Grafana's ``$__rate_interval`` becomes ``rate_interval`` and the dashboard's variables
    their values in ``variables`` (default :data:`DEFAULT_VARIABLES`), so the result can be
    run by Prometheus as is. A panel with several queries (e.g. p50, p95, p99) appears once
    per query, under the same title, in the dashboard's order.
    """
    values = {**DEFAULT_VARIABLES, **(variables or {}), "__rate_interval": rate_interval}
    dashboard = json.loads(DASHBOARD.read_text())

    def substitute(expr: str) -> str:
        def repl(m: re.Match) -> str:
            name = m.group(1) or m.group(2)
            if name not in values:
                raise KeyError(f"dashboard query uses ${name}, which has no value; "
                               f"known: {sorted(values)}")
            return values[name]
        # Both Grafana spellings: $name and ${name}.
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)

    return [(title, substitute(expr)) for title, expr in dashboard_exprs(dashboard)]


def dashboard_exprs(dashboard: dict | None = None) -> list[tuple[str, str]]:
    """``(title, PromQL as written, variables and all)`` of every panel query of the
    dashboard (default: the chart's), in its order, then of every annotation that queries
    Prometheus, under the annotation's name (Grafana's built-in annotation has no query). An
    annotation's query may sit at its top level (``expr``, as the chart's do) or, as newer
    Grafana editors save it, under ``target``."""
    if dashboard is None:
        dashboard = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            if target.get("expr"):
                exprs.append((panel["title"], target["expr"]))
    for annotation in dashboard.get("annotations", {}).get("list", []):
        expr = annotation.get("expr") or (annotation.get("target") or {}).get("expr")
        if expr:
            exprs.append((annotation["name"], expr))
    return exprs


def _panels(panels: list[dict]):
    # Rows may nest their panels (a collapsed row keeps them under "panels").
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))

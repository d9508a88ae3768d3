"""``dynatrain chart``: the Helm chart's checked facts, and the pinned helm binary.

``sync-crd`` copies ``crds/`` into ``charts/dynatrain/crds/`` (the one source and its copy),
``check-crd`` exits 1 if they differ (a test runs the same check), ``queries`` prints the
Grafana dashboard's PromQL with its variables filled in, and ``build-helm`` builds (if needed)
the helm of ``tools/helm`` and prints its path.
"""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "chart", help="the Helm chart: CRD copies, dashboard queries, the pinned helm",
        description="The Helm chart's checked facts (its CRD copies, its dashboard's queries) "
        "and the helm binary built from the pinned Go module tools/helm.")
    actions = p.add_subparsers(dest="chart_command", metavar="ACTION", required=True)
    parsers = {}
    for name, help_text in (
            ("sync-crd", "copy crds/*.yaml into charts/dynatrain/crds/"),
            ("check-crd", "exit 1 if the chart's CRDs differ from crds/"),
            ("queries", "print the dashboard's PromQL, one 'title<TAB>query' per line"),
            ("build-helm", "build helm from tools/helm if needed; print its path")):
        parsers[name] = actions.add_parser(name, help=help_text, description=help_text)
        parsers[name].set_defaults(func=run)
    for variable, field, default in (("namespace", "metadata.namespace", "default"),
                                     ("job", "metadata.name", "quickstart")):
        parsers["queries"].add_argument(
            f"--{variable}", default=default,
            help=f"the dashboard's ${variable}: the DynaTrainJob's {field} (default {default})")


def run(args: argparse.Namespace) -> int:
    from dynatrain.operator import chart

    if args.chart_command == "build-helm":
        from dynatrain.devcluster.gobuild import GoBuildError
        from dynatrain.devcluster.helm import ensure_helm
        try:
            print(ensure_helm())
        except GoBuildError as exc:
            print(f"dynatrain chart build-helm: error: {exc}", file=sys.stderr)
            return 1
    elif args.chart_command == "sync-crd":
        changed = chart.sync_crd()
        print(f"{chart.CHART_CRD.relative_to(chart.REPO)}: "
              f"{'updated' if changed else 'already in sync'}")
    elif args.chart_command == "check-crd":
        if not chart.crd_in_sync():
            print(f"the chart's CRDs in {chart.CHART_CRD.parent.relative_to(chart.REPO)} differ "
                  "from crds/; run `dynatrain chart sync-crd`", file=sys.stderr)
            return 1
        print("in sync")
    else:
        for title, expr in chart.dashboard_queries(
                variables={"namespace": args.namespace, "job": args.job}):
            print(f"{title}\t{expr}")
    return 0

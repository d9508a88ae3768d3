"""One operator, many jobs: what it costs the apiserver and how long a reconcile pass takes.

Starts a dev cluster (real kube-apiserver, controller-manager, scheduler; kwok GPU nodes),
`dynatrain operator` as its own process (standalone, one namespace), and the dev cluster's pod
runner, which runs every worker pod as a local process (real agents, real training). Then:

1. an idle window with no job, after as long again to settle: the baseline (the operator's
   watches; the control plane's own traffic, kwok's node heartbeats);
2. ``--jobs`` small jobs (gpt-tiny, one 1-GPU worker each) applied at once; the time until
   every one is Running;
3. a window of ``--seconds`` with every job training.

For each window it prints the requests the operator's own client sent per second (by verb, from
its ``dynatrain_operator_api_requests_total``), every client's requests per second as the
apiserver counts them (``apiserver_request_total``, the independent figure: it includes kopf,
the controller-manager, the scheduler, kwok and the pod runner), and the reconcile passes'
count and latency (``dynatrain_operator_reconcile_seconds``: mean and the bucket bounds of p50
and p99). Timings depend on the machine; nothing is judged. Run:

    .venv/bin/python benchmarks/operator_scale.py [--jobs 20] [--seconds 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))          # tests/harness: the operator as a process

from harness.operator_process import GROUP, PLURAL, VERSION, Operator, job, wait  # noqa: E402

from dynatrain.devcluster import ClusterConfig, DevCluster, NodePool  # noqa: E402
from dynatrain.devcluster.pods import PodRunner  # noqa: E402


def scrape(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def operator_metrics(op: Operator) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=10) as r:
        return scrape(r.read().decode())


def apiserver_metrics(api: client.ApiClient) -> dict:
    # The dev cluster's admin identity is a client certificate, already in the configuration.
    resp = api.call_api("GET", f"{api.configuration.host}/metrics")
    resp.read()
    return scrape(resp.data.decode())


def total(m: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in m.items() if n == name
               and all(dict(ls).get(k) == want for k, want in labels.items()))


def by_label(m: dict, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, ls), v in m.items():
        if n == name:
            key = dict(ls).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def quantile_bound(before: dict, after: dict, q: float) -> float | None:
    """The upper bound of the histogram bucket holding quantile q of the window's passes."""
    name = "dynatrain_operator_reconcile_seconds_bucket"
    per_le: dict[float, float] = {}        # summed over the jobs (one histogram per job)
    for (n, ls), v in after.items():
        if n == name:
            le = float(dict(ls)["le"])
            per_le[le] = per_le.get(le, 0.0) + v - before.get((n, ls), 0.0)
    buckets = sorted(per_le.items())
    count = buckets[-1][1] if buckets else 0
    if not count:
        return None
    for le, c in buckets:
        if c >= q * count:
            return le
    return None


class Window:
    def __init__(self, op, api, seconds):
        self.op, self.api, self.seconds = op, api, seconds

    def run(self, name: str) -> dict:
        o0, a0, t0 = operator_metrics(self.op), apiserver_metrics(self.api), time.monotonic()
        time.sleep(self.seconds)
        o1, a1, t1 = operator_metrics(self.op), apiserver_metrics(self.api), time.monotonic()
        dt = t1 - t0
        verbs0 = by_label(o0, "dynatrain_operator_api_requests_total", "verb")
        verbs1 = by_label(o1, "dynatrain_operator_api_requests_total", "verb")
        passes = (total(o1, "dynatrain_operator_reconcile_seconds_count")
                  - total(o0, "dynatrain_operator_reconcile_seconds_count"))
        spent = (total(o1, "dynatrain_operator_reconcile_seconds_sum")
                 - total(o0, "dynatrain_operator_reconcile_seconds_sum"))
        return {
            "window": name, "seconds": round(dt, 1),
            "operator_requests_per_s": round(
                (sum(verbs1.values()) - sum(verbs0.values())) / dt, 1),
            "operator_requests_per_s_by_verb": {
                v: round((verbs1[v] - verbs0.get(v, 0.0)) / dt, 2) for v in sorted(verbs1)},
            "apiserver_requests_per_s": round(
                (total(a1, "apiserver_request_total") - total(a0, "apiserver_request_total"))
                / dt, 1),
            "reconcile_passes_per_s": round(passes / dt, 1),
            "reconcile_mean_ms": round(1000 * spent / passes, 2) if passes else None,
            "reconcile_p50_le_s": quantile_bound(o0, o1, 0.5),
            "reconcile_p99_le_s": quantile_bound(o0, o1, 0.99),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=20, help="jobs on the operator (default 20)")
    ap.add_argument("--seconds", type=float, default=60.0,
                    help="length of each measurement window (default 60)")
    ap.add_argument("--idle-seconds", type=float, default=20.0,
                    help="length of the no-job window (default 20)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.jobs < 1 or args.seconds <= 0:
        ap.error(f"--jobs={args.jobs} must be >= 1 and --seconds={args.seconds} > 0")
    gpu_nodes = max(2, -(-args.jobs // 8) + 1)
    work = Path(tempfile.mkdtemp(prefix="dynatrain-operator-scale-"))
    config = ClusterConfig(
        pools=(NodePool(count=gpu_nodes, gpus_per_node=8, instance_type="p5.48xlarge"),),
        workdir=work / "cluster", kubeconfig=None, pod_cidr="127.20.0.0/16")
    results = {"jobs": args.jobs, "gpu_nodes": gpu_nodes, "cores": os.cpu_count()}
    with DevCluster(config) as cluster:
        api = cluster.api_client()
        core, custom = cluster.core(), client.CustomObjectsApi(api)
        ext = client.ApiextensionsV1Api(api)
        crd = yaml.safe_load((ROOT / "crds" / "dynatrainjob.yaml").read_text())
        ext.create_custom_resource_definition(crd)
        wait("the CRD to be established", lambda: any(
            c.type == "Established" and c.status == "True"
            for c in ext.read_custom_resource_definition(crd["metadata"]["name"]).status
            .conditions or []), timeout=30)
        ns = "scale"
        core.create_namespace({"metadata": {"name": ns}})
        wait("the namespace's default ServiceAccount", lambda: any(
            sa.metadata.name == "default"
            for sa in core.list_namespaced_service_account(ns).items), timeout=30)
        op = Operator(cluster, ns, work, standalone=True, tick_s=0.5)   # the default tick
        with PodRunner(core, work / "pods", namespace=ns, selector="dynatrain.io/job",
                       cpu_for_gpu_pods=True):        # simulated GPU nodes: no CUDA
            op.start()
            try:
                wait("the operator's metrics", lambda: _up(op), timeout=90)
                time.sleep(args.idle_seconds)        # let start-up traffic settle first
                results["idle"] = Window(op, api, args.idle_seconds).run("idle")
                t0 = time.monotonic()
                for i in range(args.jobs):
                    doc = job(f"job-{i:03d}", gpus=1, max_workers=1)
                    doc["metadata"]["namespace"] = ns
                    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, doc)
                wait(f"all {args.jobs} jobs to run", lambda: _running(custom, ns) >= args.jobs,
                     timeout=60 + 15 * args.jobs, interval=1.0)
                results["seconds_until_all_running"] = round(time.monotonic() - t0, 1)
                results["running"] = Window(op, api, args.seconds).run(f"{args.jobs} jobs")
                results["jobs_running_at_end"] = _running(custom, ns)
            finally:
                op.stop()
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        _print(results)
    return 0


def _up(op) -> bool:
    try:
        operator_metrics(op)
        return True
    except OSError:
        return False


def _running(custom, ns) -> int:
    items = custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
    return sum(1 for j in items if j.get("status", {}).get("phase") == "Running")


def _print(r: dict) -> None:
    print(f"operator scale: {r['jobs']} jobs on {r['gpu_nodes']} GPU nodes "
          f"({r['cores']} cores); all running after {r.get('seconds_until_all_running')} s")
    for key in ("idle", "running"):
        w = r.get(key)
        if not w:
            continue
        print(f"  {w['window']:>8} ({w['seconds']} s): operator {w['operator_requests_per_s']:.1f}"
              f" req/s {w['operator_requests_per_s_by_verb']}; apiserver (all clients) "
              f"{w['apiserver_requests_per_s']} req/s; {w['reconcile_passes_per_s']} passes/s, "
              f"mean {w['reconcile_mean_ms']} ms, p50 <= {w['reconcile_p50_le_s']} s, "
              f"p99 <= {w['reconcile_p99_le_s']} s")


if __name__ == "__main__":
    sys.exit(main())

"""The operator's own cost, as Prometheus metrics: apiserver requests and reconcile passes.

An operator that a cluster admin can leave alone must be cheap for the apiserver whatever the
number of jobs. These two metrics show it, next to the jobs' metrics on the operator's
``/metrics`` endpoint:

``dynatrain_operator_api_requests_total{verb}`` (counter)
    Requests this operator's Kubernetes client sent (``GET``, ``POST``, ``PATCH``,
    ``DELETE``...; a watch counts once, when it starts). kopf's own requests (its watch of
    DynaTrainJobs, finalizers, peering) go through its own client and are not counted.
``dynatrain_operator_reconcile_seconds{namespace, job}`` (histogram)
    Wall time of one reconcile pass of one job (a switch, when a pass makes one, included),
    labelled with the job's namespace and name like the jobs' own series: one histogram per
    live job, removed with the job (:meth:`OperatorMetrics.forget`), so the labels stay as
    bounded as the jobs themselves. Requests are not per job (the shared watches serve all).
"""

from __future__ import annotations

from kubernetes import client
from prometheus_client import CollectorRegistry, Counter, Histogram

RECONCILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.api_requests = Counter(
            "dynatrain_operator_api_requests", "Requests the operator sent to the apiserver.",
            ["verb"], registry=registry)
        self.reconcile = Histogram(
            "dynatrain_operator_reconcile_seconds", "Wall time of one job's reconcile pass.",
            ["namespace", "job"], buckets=RECONCILE_BUCKETS, registry=registry)

    def forget(self, namespace: str, job: str) -> None:
        """Drop a deleted job's series (nothing happens if it has none)."""
        self.reconcile.remove(namespace, job)


class CountingApiClient(client.ApiClient):
    """A Kubernetes client that counts the requests it sends (by HTTP verb)."""

    def __init__(self, *args, metrics: OperatorMetrics, **kwargs):
        super().__init__(*args, **kwargs)
        self._metrics = metrics

    def call_api(self, method, url, *args, **kwargs):
        # Every typed call (CoreV1Api.list_node, a watch's list call ...) ends here.
        self._metrics.api_requests.labels(verb=method.upper()).inc()
        return super().call_api(method, url, *args, **kwargs)

"""The NetworkPolicy of one job's worker pods: who may connect to them, port by port.

Created with the job's other objects (named ``<job>-workers``, owned by the job, labelled
``dynatrain.io/job``), it selects the job's worker pods (``dynatrain.io/job=<job>``) and
admits, ingress only:

(a) **the job's own pods, on every port.** The collectives (gloo's and NCCL's TCP
    connections) and the live switches' state transfers listen on ports chosen at run time
    by the libraries (ephemeral ports), so they cannot be listed: the rule names the peers,
    not the ports. Pods of the same namespace only (a ``podSelector`` without a
    ``namespaceSelector``), so a pod elsewhere that copies the label is not a peer;
(b) **the operator's pods** (``namespaceSelector`` on the operator's namespace, by its
    ``kubernetes.io/metadata.name`` label, and ``podSelector`` on the chart's operator pod
    labels) on the agent port (``spec.agent.port``: Prepare, Commit, Status) and the health
    port :data:`~.cluster.HEALTH_PORT` (plaintext gRPC health, the readinessProbe's);
(c) **the metrics port** :data:`~.cluster.METRICS_PORT` from pods in the namespaces the
    operator's ``--metrics-namespace-selector`` matches (the chart's
    ``networkPolicy.metricsNamespaceSelector``; empty, Kubernetes' own meaning of an empty
    selector: every namespace, since the metrics are read-only numbers and a scrape that
    silently stops is the worse default).

The kubelet's readiness probe comes from the node, not from a pod; the common CNIs (Calico,
Cilium, the AWS VPC CNI's policy agent) do not apply NetworkPolicy to a node's own traffic to
its pods, so the probe needs no rule. Egress is not restricted: workers reach the operator's
rendezvous store (whose pod has a policy of its own, the chart's
``templates/networkpolicy.yaml``), DNS, and wherever their data lives.

A NetworkPolicy is enforced only by a CNI that implements it; on one that does not (the
dev cluster's loopback pod network, kindnet, flannel alone) it is stored and has no effect.
"""

from __future__ import annotations

from .cluster import HEALTH_PORT, JOB_LABEL, METRICS_PORT, names, owner_reference

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Set by the apiserver on every namespace to its name (Kubernetes 1.21+)."""
DEFAULT_OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "dynatrain",
                               "app.kubernetes.io/component": "operator"}
"""The chart's operator pod labels for its default name (the chart passes its own)."""


def policy_name(job: str) -> str:
    return names(job)["service"]           # <job>-workers, as the headless Service


def worker_policy(body: dict, *, agent_port: int, operator_namespace: str,
                  operator_pod_labels: dict[str, str],
                  metrics_namespaces: dict[str, str]) -> dict:
    """The job's NetworkPolicy (a manifest). ``metrics_namespaces``: the matchLabels of the
    namespaces whose pods may scrape the metrics port ({} = every namespace)."""
    n = body["metadata"]["name"]
    job_pods = {"matchLabels": {JOB_LABEL: n}}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": policy_name(n), "labels": {JOB_LABEL: n},
                     "ownerReferences": [owner_reference(body)]},
        "spec": {
            "podSelector": job_pods,
            "policyTypes": ["Ingress"],
            "ingress": [
                # (a) collectives and state transfers: ephemeral ports, so all ports.
                {"from": [{"podSelector": job_pods}]},
                # (b) the operator drives the agents and checks their health.
                {"from": [{"namespaceSelector": {"matchLabels": {
                              NAMESPACE_NAME_LABEL: operator_namespace}},
                           "podSelector": {"matchLabels": dict(operator_pod_labels)}}],
                 "ports": [{"protocol": "TCP", "port": agent_port},
                           {"protocol": "TCP", "port": HEALTH_PORT}]},
                # (c) Prometheus.
                {"from": [{"namespaceSelector": {"matchLabels": dict(metrics_namespaces)}}],
                 "ports": [{"protocol": "TCP", "port": METRICS_PORT}]},
            ],
        },
    }


def spec_differs(obj, want: dict) -> bool:
    """Whether the stored policy's spec (a client model object) differs from the manifest's
    (both in the API's camelCase form; the manifest spells out every field the apiserver
    would default)."""
    global _serializer
    if _serializer is None:      # no request is made: only its JSON form of model objects
        from kubernetes.client import ApiClient
        _serializer = ApiClient()
    have = _serializer.sanitize_for_serialization(obj.spec)
    return _normal(have) != _normal(want["spec"])


_serializer = None


def _normal(spec: dict) -> dict:
    """Empty matchLabels and absent ones mean the same selector; the server drops them."""
    def sel(s):
        return {k: v for k, v in (s or {}).items() if v} if s is not None else None

    out = {"podSelector": sel(spec.get("podSelector")),
           "policyTypes": spec.get("policyTypes"), "ingress": []}
    for rule in spec.get("ingress") or []:
        peers = [{k: sel(v) for k, v in p.items()} for p in rule.get("from") or []]
        ports = [{"protocol": p.get("protocol", "TCP"), "port": p.get("port")}
                 for p in rule.get("ports") or []]
        out["ingress"].append({"from": peers, "ports": ports})
    return out

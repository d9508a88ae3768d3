"""Least privilege, exercised: the operator runs as the chart's ServiceAccount, and a verb taken
out of the chart's ClusterRole shows.

Every operator test runs `dynatrain operator` with a token of the chart's ServiceAccount
(chart_rbac.py; :class:`operator_process.Operator`), so each of them would fail on a verb the
chart lacks. Here: the token is that ServiceAccount's and nobody else's; every request the
operator's code makes (read off operator/*.py: each kubernetes client method it names) and
every one kopf and the client's leader election make for it is granted, asked of the
apiserver's authorizer with that very token, and a few it never makes are not; a ClusterRole
without ``create`` on pods denies exactly that; and an operator under that role says so on the
job (``PodsCreated`` False, reason ``Forbidden``) while the same job runs once the chart's full
role is back.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kubernetes import client, config

from harness.chart_rbac import RELEASE_NAMESPACE, can, chart_identity
from harness.operator_process import ROOT, Operator, condition, get, job, wait

pytestmark = pytest.mark.k8s

OPERATOR_SOURCES = sorted((ROOT / "operator").glob("*.py"))
DROPPED = ("", "pods", "create")
"""The rule the experiment takes out: without it no worker pod can be made."""

# A kubernetes client method's verb and the resource it names (method names are generated from
# the API, e.g. read_namespaced_config_map: GET .../configmaps/NAME).
_VERBS = {"read": "get", "list": "list", "create": "create", "delete": "delete",
          "patch": "patch", "replace": "update"}
_RESOURCES = {"pod": ("", "pods"), "service": ("", "services"), "secret": ("", "secrets"),
              "config_map": ("", "configmaps"), "event": ("", "events"),
              "node": ("", "nodes"), "namespace": ("", "namespaces"),
              # the operator's one custom resource (runtime.GROUP, PLURAL)
              "custom_object": ("dynatrain.io", "dynatrainjobs"),
              # leader election (operator/leader.py): the Lease, in the release's namespace
              "lease": ("coordination.k8s.io", "leases"),
              # each job's NetworkPolicy (operator/netpol.py)
              "network_policy": ("networking.k8s.io", "networkpolicies"),
              # a job's priority in a shared pool (operator/sharing.py)
              "priority_class": ("scheduling.k8s.io", "priorityclasses")}
# Objects whose methods the operator calls: CoreV1Api, CustomObjectsApi, NetworkingV1Api
# (``net``), SchedulingV1Api (``scheduling``), and the CoordinationV1Api that the client's
# LeaseLock keeps as ``api_instance``.
_API_CLASSES = {"CoreV1Api", "CustomObjectsApi", "CoordinationV1Api", "NetworkingV1Api",
                "SchedulingV1Api"}
_CALLERS = r"core|custom|net|api_instance|scheduling"

# Where a request goes: "jobs" (any namespace a DynaTrainJob is in), "release" (the
# operator's own namespace, where its Lease is), "cluster" (cluster-scoped, or all namespaces).
JOBS, RELEASE, CLUSTER = "jobs", "release", "cluster"

# What kopf and the client's leader election do for the operator, which operator/*.py does not
# spell out.
LIBRARIES = [
    ("list", "dynatrain.io", "dynatrainjobs", "", JOBS),      # kopf's watch of the jobs
    ("watch", "dynatrain.io", "dynatrainjobs", "", JOBS),
    ("patch", "dynatrain.io", "dynatrainjobs", "", JOBS),     # finalizer, progress annotations
    ("patch", "dynatrain.io", "dynatrainjobs", "status", JOBS),
    ("list", "apiextensions.k8s.io", "customresourcedefinitions", "", CLUSTER),
    ("watch", "apiextensions.k8s.io", "customresourcedefinitions", "", CLUSTER),
    ("list", "", "namespaces", "", CLUSTER),                  # kopf, serving all namespaces
    ("watch", "", "namespaces", "", CLUSTER),
    ("create", "", "events", "", JOBS),                       # kopf's own Events
    # The pods, Service, ConfigMap and Secret the operator creates name their job as owner
    # with blockOwnerDeletion: the OwnerReferencesPermissionEnforcement admission plugin
    # then requires the right to update the job's finalizers.
    ("update", "dynatrain.io", "dynatrainjobs", "finalizers", JOBS),
    # kubernetes.leaderelection's LeaseLock: read, create, renew (replace) the Lease.
    ("get", "coordination.k8s.io", "leases", "", RELEASE),
    ("create", "coordination.k8s.io", "leases", "", RELEASE),
    ("update", "coordination.k8s.io", "leases", "", RELEASE),
]


# cert-manager's Certificates of a job with spec.agent.issuerRef (operator/jobtls.py
# _issued_pki, through ``self.cert_manager``, a CustomObjectsApi this scan does not read).
CERT_MANAGER = [(verb, "cert-manager.io", "certificates", "", JOBS)
                for verb in ("get", "create", "patch")]

# Kueue's Workloads of a job's queued pods (operator/pods.py _kueue_why, through
# ``self.kueue``, a CustomObjectsApi this scan does not read).
KUEUE = [("list", "kueue.x-k8s.io", "workloads", "", JOBS)]


def operator_requests() -> list[tuple[str, str, str, str, str]]:
    """(verb, group, resource, subresource, scope) of every kubernetes client method that
    operator/*.py names, read off the source: a call added there without its rule in the chart
    fails the tests below."""
    found, unknown = set(), []
    for path in OPERATOR_SOURCES:
        text = path.read_text()
        classes = set(re.findall(r"\bclient\.(\w+Api)\(", text))
        assert classes <= _API_CLASSES, (
            f"{path.name} uses {sorted(classes - _API_CLASSES)}: teach this test its "
            "methods (and the chart its rules)")
        for obj, method in re.findall(rf"\b({_CALLERS})\.([a-z_]+)\b", text):
            m = re.fullmatch(r"(read|list|create|delete|patch|replace)_(namespaced_)?"
                             r"([a-z_]+?)(_status)?(_for_all_namespaces)?", method)
            if not m or m.group(3) not in _RESOURCES:
                unknown.append(f"{path.name}: {obj}.{method}")
                continue
            verb, namespaced, kind, status, _ = m.groups()
            group, resource = _RESOURCES[kind]
            scope = CLUSTER if not namespaced else RELEASE if kind == "lease" else JOBS
            found.add((_VERBS[verb], group, resource, "status" if status else "", scope))
            if verb == "list":            # the informer watches with the same call
                found.add(("watch", group, resource, "", scope))
    assert not unknown, f"calls this test cannot map to a verb and resource: {unknown}"
    return sorted(found)


def all_requests() -> list[tuple[str, str, str, str, str]]:
    return sorted(set(operator_requests()) | set(LIBRARIES) | set(CERT_MANAGER) | set(KUEUE))


def _can(kubeconfig: Path, request, jobs_namespace: str) -> bool:
    verb, group, resource, subresource, scope = request
    namespace = {JOBS: jobs_namespace, RELEASE: RELEASE_NAMESPACE, CLUSTER: ""}[scope]
    return can(kubeconfig, verb, group, resource, subresource, namespace=namespace)


def _denied(kubeconfig: Path, requests, jobs_namespace: str) -> list:
    return [r for r in requests if not _can(kubeconfig, r, jobs_namespace)]


def test_the_operator_code_is_read_for_its_requests():
    # No cluster needed: the parse itself finds what the operator is known to do.
    reqs = operator_requests()
    assert {("create", "", "pods", "", JOBS), ("delete", "", "pods", "", JOBS),
            ("list", "", "pods", "", CLUSTER), ("watch", "", "nodes", "", CLUSTER),
            ("get", "", "secrets", "", JOBS), ("patch", "", "configmaps", "", JOBS),
            ("patch", "dynatrain.io", "dynatrainjobs", "status", JOBS),
            ("create", "", "events", "", JOBS),
            ("create", "networking.k8s.io", "networkpolicies", "", JOBS),
            ("patch", "networking.k8s.io", "networkpolicies", "", JOBS),
            ("get", "scheduling.k8s.io", "priorityclasses", "", CLUSTER)} <= set(reqs), reqs


def test_the_token_is_the_charts_service_account(devcluster):
    identity = chart_identity(devcluster)
    api = config.new_client_from_config(config_file=str(identity.kubeconfig))
    try:
        review = client.AuthenticationV1Api(api).create_self_subject_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    finally:
        api.close()
    assert review.status.user_info.username == identity.user
    assert "system:masters" not in review.status.user_info.groups
    with open(identity.kubeconfig) as f:
        text = f.read()
    assert "client-key-data" not in text and "token:" in text      # a bearer token, no cert


def test_every_request_of_the_operator_is_granted_and_no_more(devcluster, namespace):
    kubeconfig = chart_identity(devcluster).kubeconfig
    # In a namespace the release knows nothing of: the chart's operator serves them all.
    assert _denied(kubeconfig, all_requests(), namespace) == []
    # ... and the token is no admin's: some of what the operator never does.
    never = [("create", "dynatrain.io", "dynatrainjobs", "", JOBS),
             ("list", "", "secrets", "", JOBS), ("update", "", "pods", "", JOBS),
             ("create", "", "pods", "exec", JOBS), ("patch", "", "nodes", "", CLUSTER),
             # the scale subresource is the user's (kubectl scale), never the operator's
             ("patch", "dynatrain.io", "dynatrainjobs", "scale", JOBS),
             ("list", "networking.k8s.io", "networkpolicies", "", JOBS),
             ("create", "rbac.authorization.k8s.io", "clusterroles", "", CLUSTER),
             # Leases only in its own namespace (a Role): not those of other controllers.
             ("update", "coordination.k8s.io", "leases", "", JOBS),
             ("update", "coordination.k8s.io", "leases", "", CLUSTER)]
    assert [r for r in never if _can(kubeconfig, r, namespace)] == []


def test_a_role_without_one_verb_denies_exactly_that(devcluster, namespace):
    crippled = chart_identity(devcluster, drop=DROPPED)
    assert _denied(crippled.kubeconfig, all_requests(), namespace) == [
        ("create", "", "pods", "", JOBS)]


@pytest.mark.slow
def test_without_pods_create_the_job_says_forbidden_and_runs_with_the_charts_role(
        devcluster, kubectl, namespace, operator, tmp_path):
    import yaml

    op, _ = operator                       # the chart's full role: stopped for now
    op.stop()
    custom = client.CustomObjectsApi(devcluster.api_client())
    workdir = tmp_path / "crippled"
    workdir.mkdir()
    crippled = Operator(devcluster, namespace, workdir,
                        kubeconfig=chart_identity(devcluster, drop=DROPPED).kubeconfig)
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(job("rbac", gpus=1, max_workers=1)))
    crippled.start()
    try:
        kubectl("apply", "-n", namespace, "-f", str(manifest))
        cond = wait("PodsCreated False", lambda: (
            c if (c := condition(custom, namespace, "rbac", "PodsCreated"))
            and c["status"] == "False" else None), timeout=90)
        assert cond["reason"] == "Forbidden", cond
        assert "forbidden" in cond["message"] and "pods" in cond["message"], cond
        assert devcluster.core().list_namespaced_pod(namespace).items == []
        # The rest of the job's objects were made: only the one verb was missing.
        assert condition(custom, namespace, "rbac", "ObjectsReady")["status"] == "True"
    finally:
        crippled.stop()
        print(crippled.logs()[-4000:])
    op.start()                             # the chart's own role: the same job runs
    wait("the job to run under the chart's role", lambda: get(
        custom, namespace, "rbac").get("status", {}).get("phase") == "Running", timeout=150)
    assert condition(custom, namespace, "rbac", "PodsCreated")["status"] == "True"
    kubectl("delete", "dynatrainjob", "rbac", "-n", namespace, "--wait=false")

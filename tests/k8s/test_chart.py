"""The Helm chart (charts/dynatrain) with a real helm and a real kube-apiserver.

``helm`` is built from its Go module (``tools/helm``, :func:`dynatrain.devcluster.helm.ensure_helm`), as
the control plane is; without Go these tests skip, and under CI (``CI`` set) they fail, so a
CI run cannot pass by skipping them. The chart must lint, render, and its rendered manifests
must be accepted by the dev cluster's apiserver (server-side apply, strict field validation).
The ServiceAccount's effective rights are then asked of the apiserver's own RBAC authorizer
(SubjectAccessReview), so "least privilege" is checked where it is enforced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from kubernetes import client

from dynatrain.devcluster import helm as dhelm
from dynatrain.devcluster.gobuild import GoUnavailable
from dynatrain.operator import chart
from dynatrain.devcluster.build import ensure_built

pytestmark = pytest.mark.k8s

CHART = chart.CHART_DIR
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"
POD_MONITOR_API = "monitoring.coreos.com/v1/PodMonitor"
OPERATOR_ARGS = ["operator", "--liveness", "http://0.0.0.0:8080/healthz", "--metrics-port", "9090",
                 "--leader-lease", "dynatrain-operator", "--lease-seconds", "10",
                 "--max-pods-per-job", "256", "--gang-wait", "60", "--worker-cpu", "1",
                 "--worker-memory", "4Gi", "--cert-lifetime", "30d"]

# (apiGroup, resource, verbs) the operator needs; the ClusterRole must grant exactly these.
EXPECTED_RULES = {
    # delete: a finished job whose spec.ttlSecondsAfterFinished has passed
    ("dynatrain.io", "dynatrainjobs"): {"get", "list", "watch", "patch", "delete"},
    ("dynatrain.io", "dynatrainjobs/status"): {"patch"},
    ("dynatrain.io", "dynatrainjobs/finalizers"): {"update"},
    ("", "pods"): {"create", "delete", "get", "list", "watch", "patch"},
    # a job's priority in a pool shared with other jobs (operator/sharing.py)
    ("scheduling.k8s.io", "priorityclasses"): {"get"},
    # patch: kept matching the spec; delete: a previous job's of the same name is replaced
    ("", "services"): {"create", "delete", "get", "list", "watch", "patch"},
    ("", "events"): {"create", "patch"},
    ("", "nodes"): {"get", "list", "watch"},
    # create: the agents' token when none is named, and each job's TLS Secrets (operator/pki.py);
    # patch: those rotated in place before their certificates expire
    ("", "secrets"): {"get", "create", "delete", "patch"},
    # a job with spec.agent.issuerRef: its two cert-manager Certificates
    ("cert-manager.io", "certificates"): {"get", "create", "patch"},
    # a job with spec.queueName: why Kueue holds its pods (their Workloads' QuotaReserved)
    ("kueue.x-k8s.io", "workloads"): {"list"},
    # each job's NetworkPolicy (operator/netpol.py), kept like its Service
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "create", "patch", "delete"},   # the job manifest, for workers
    ("", "namespaces"): {"list", "watch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
}
# The leader Lease, in the release namespace only (a Role, not the ClusterRole).
EXPECTED_LEADER_RULES = {("coordination.k8s.io", "leases"): {"get", "create", "update"}}


def _unavailable(reason: str):
    # As in conftest.py: in CI a missing prerequisite is a failure, elsewhere a skip.
    if os.environ.get("CI"):
        pytest.fail(f"chart tests cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def helm(tmp_path_factory):
    """Run the helm built from tools/helm; helm's own config and caches stay in a tmp dir."""
    try:
        binary = dhelm.ensure_helm()
    except GoUnavailable as exc:
        _unavailable(str(exc))
    home = tmp_path_factory.mktemp("helm-home")
    env = {**os.environ, "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_CACHE_HOME": str(home / "cache"), "HELM_DATA_HOME": str(home / "data")}

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(binary), *args], capture_output=True, text=True,
                              timeout=120, env=env, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc
    return run


def render(helm, *args: str, namespace: str = "dynatrain", release: str = "dtj") -> list[dict]:
    out = helm("template", release, str(CHART), "--namespace", namespace, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for d in docs:
        kinds.setdefault(d["kind"], []).append(d)
    return kinds


@pytest.fixture(scope="module")
def kubectl(devcluster):
    binary = ensure_built().path("kubectl")

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(binary), "--kubeconfig", str(devcluster.kubeconfig), *args],
                              capture_output=True, text=True, timeout=120, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc
    return run


# -- without a cluster ---------------------------------------------------------------------

def test_chart_crd_is_a_copy_of_the_source():
    assert chart.crd_in_sync(), (
        f"{chart.CHART_CRD} differs from {chart.CRD_SOURCE}; "
        "run `dynatrain chart sync-crd`")


def test_helm_is_the_pinned_version(helm):
    out = helm("version", "--template", "{{ .Version }}").stdout.strip()
    assert out == dhelm.pinned_version()


def test_helm_lint(helm):
    proc = helm("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout, proc.stdout


def test_template_renders_the_operator(helm):
    kinds = by_kind(render(helm))
    assert set(kinds) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
                          "Service", "ConfigMap", "Role", "RoleBinding", "NetworkPolicy"}
    (deploy,) = kinds["Deployment"]
    # Two replicas, one acting: leader election on a Lease, which a Role grants in the
    # release's namespace and nowhere else.
    assert deploy["spec"]["replicas"] == 2
    (role,) = kinds["Role"]
    assert {(g, r): set(rule["verbs"]) for rule in role["rules"]
            for g in rule["apiGroups"] for r in rule["resources"]} == EXPECTED_LEADER_RULES
    (binding,) = kinds["RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == kinds["ServiceAccount"][0]["metadata"]["name"]
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["dynatrain"]
    assert container["args"] == OPERATOR_ARGS
    assert container["image"] == "dynatrain-operator:0.1.0"   # the slim image
    assert pod["serviceAccountName"] == kinds["ServiceAccount"][0]["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"] and container["resources"]["limits"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "metrics": 9090}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    (service,) = kinds["Service"]
    assert service["spec"]["ports"][0]["port"] == 9090
    assert service["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"][
        "labels"].items()


def test_rbac_is_least_privilege(helm):
    (role,) = by_kind(render(helm))["ClusterRole"]
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field}: {rule}"
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    assert granted == EXPECTED_RULES


def _grants(role: dict) -> dict[tuple[str, str], set[str]]:
    return {(g, r): set(rule["verbs"]) for rule in role["rules"]
            for g in rule["apiGroups"] for r in rule["resources"]}


def test_secret_access_can_be_narrowed_to_listed_namespaces(helm):
    kinds = by_kind(render(helm, "--set", "rbac.secretNamespaces={team-a,team-b}"))
    (cluster_role,) = kinds["ClusterRole"]
    assert ("", "secrets") not in _grants(cluster_role)
    secret_roles = {r["metadata"]["namespace"]: r for r in kinds["Role"]
                    if r["metadata"]["name"].endswith("-secrets")}
    assert set(secret_roles) == {"team-a", "team-b"}
    for ns, role in secret_roles.items():       # the same verbs as the cluster-wide rule
        assert _grants(role) == {("", "secrets"): EXPECTED_RULES[("", "secrets")]}, ns
    bindings = {b["metadata"]["namespace"]: b for b in kinds["RoleBinding"]
                if b["metadata"]["name"].endswith("-secrets")}
    (sa,) = kinds["ServiceAccount"]
    for ns in ("team-a", "team-b"):
        assert bindings[ns]["roleRef"]["name"] == secret_roles[ns]["metadata"]["name"]
        assert bindings[ns]["subjects"] == [{"kind": "ServiceAccount",
                                            "name": sa["metadata"]["name"],
                                            "namespace": "dynatrain"}]


def test_security_values_become_operator_flags_and_the_operators_policy(helm):
    docs = render(helm)
    (deploy,) = by_kind(docs)["Deployment"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    # the job policies admit the operator's pods by these labels: its selector labels
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    selector = deploy["spec"]["selector"]["matchLabels"]
    assert env["DYNATRAIN_OPERATOR_POD_LABELS"] == ",".join(
        f"{k}={v}" for k, v in sorted(selector.items()))
    assert selector.items() <= pod_labels.items()
    # the operator pods' own policy
    (policy,) = by_kind(docs)["NetworkPolicy"]
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": selector}
    assert spec["policyTypes"] == ["Ingress"]
    stores, metrics, health = spec["ingress"]
    assert stores == {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/managed-by": "dynatrain-operator"}}}]}        # every port
    assert metrics == {"from": [{"namespaceSelector": {"matchLabels": {}}}],
                       "ports": [{"protocol": "TCP", "port": 9090}]}
    assert health == {"ports": [{"protocol": "TCP", "port": 8080}]}
    # the values, set
    docs = render(helm, "--set", "allowedImages={registry.example.com/team/,dynatrain:}",
                  "--set", "networkPolicy.metricsNamespaceSelector.matchLabels.team=mon",
                  "--set", "networkPolicy.enabled=false")
    (deploy,) = by_kind(docs)["Deployment"]
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[len(OPERATOR_ARGS):] == [
        "--no-network-policy", "--metrics-namespace-selector", "team=mon",
        "--allowed-images", "registry.example.com/team/,dynatrain:"]
    assert "NetworkPolicy" not in by_kind(docs)
    # every flag the chart can pass is one `dynatrain operator` accepts
    help_text = subprocess.run([sys.executable, "-m", "dynatrain",
                                "operator", "--help"], capture_output=True, text=True,
                               timeout=120).stdout
    for flag in ("--no-network-policy", "--metrics-namespace-selector", "--allowed-images"):
        assert flag in help_text, flag


def test_monitors_only_when_the_api_exists(helm):
    kinds = by_kind(render(helm))
    assert "ServiceMonitor" not in kinds and "PodMonitor" not in kinds
    kinds = by_kind(render(helm, "--api-versions", SERVICE_MONITOR_API,
                           "--api-versions", POD_MONITOR_API))
    (sm,) = kinds["ServiceMonitor"]
    (service,) = kinds["Service"]
    assert sm["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    assert {"targetLabel": "role", "replacement": "controller", "action": "replace"} in endpoint[
        "relabelings"]
    # The series carry their job's namespace and job labels: they must win over the target's.
    assert endpoint["honorLabels"] is True
    (pm,) = kinds["PodMonitor"]
    (pod_endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert pod_endpoint["honorLabels"] is True
    assert {"targetLabel": "role", "replacement": "worker", "action": "replace"} in pod_endpoint[
        "relabelings"]
    assert pm["spec"]["selector"]["matchExpressions"] == [
        {"key": "dynatrain.io/job", "operator": "Exists"}]
    # Each can be switched off even where the API exists.
    kinds = by_kind(render(helm, "--api-versions", SERVICE_MONITOR_API,
                           "--set", "serviceMonitor.enabled=false"))
    assert "ServiceMonitor" not in kinds


def test_dashboard_configmap(helm):
    (cm,) = by_kind(render(helm))["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["dynatrain.json"])
    assert dashboard == json.loads(chart.DASHBOARD.read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Switch pause p50 / p95 / p99", "Switch duration by phase", "Bytes moved by switches",
            "Switches by reason and result", "Workers and GPUs", "Step time p50 / p95",
            "Tokens per second"} <= titles
    variables = {v["name"]: v["type"] for v in dashboard["templating"]["list"]}
    assert variables["datasource"] == "datasource"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_include_crds_renders_the_source_crd(helm):
    crds = by_kind(render(helm, "--include-crds"))["CustomResourceDefinition"]
    sources = [d for src in chart.CRD_SOURCES for d in yaml.safe_load_all(src.read_text()) if d]
    key = lambda d: d["metadata"]["name"]  # noqa: E731
    assert sorted(crds, key=key) == sorted(sources, key=key)


# -- against the dev cluster's apiserver --------------------------------------------------

def test_rendered_chart_applies_to_the_apiserver(helm, kubectl, devcluster, namespace,
                                                 tmp_path):
    release = f"r{namespace}"  # cluster-scoped RBAC names must not clash between tests
    docs = [d for d in yaml.safe_load_all(helm("template", release, str(CHART), "--namespace",
                                                namespace, "--include-crds").stdout) if d]
    # As `helm install` does: the CRDs first, established before the objects of their kinds.
    crds, rest = tmp_path / "crds.yaml", tmp_path / "chart.yaml"
    crds.write_text(yaml.safe_dump_all([d for d in docs
                                        if d["kind"] == "CustomResourceDefinition"]))
    rest.write_text(yaml.safe_dump_all([d for d in docs
                                        if d["kind"] != "CustomResourceDefinition"]))
    # Server-side apply validates every field strictly: a typo in a template is an error.
    out = kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=helm-test",
                  "-f", str(crds)).stdout
    devcluster.wait_established(*(d["metadata"]["name"] for d in docs
                                  if d["kind"] == "CustomResourceDefinition"))
    out += kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=helm-test",
                   "-f", str(rest)).stdout
    fullname = f"{release}-dynatrain"
    for obj in (f"serviceaccount/{fullname}", f"deployment.apps/{fullname}",
                f"service/{fullname}-metrics", f"configmap/{fullname}-dashboard",
                f"clusterrole.rbac.authorization.k8s.io/{fullname}",
                f"clusterrolebinding.rbac.authorization.k8s.io/{fullname}",
                "customresourcedefinition.apiextensions.k8s.io/dynatrainjobs.dynatrain.io"):
        assert obj in out, f"{obj} not applied:\n{out}"
    deploy = json.loads(kubectl("get", "deployment", fullname, "-n", namespace, "-o",
                                "json").stdout)
    assert deploy["spec"]["template"]["spec"]["containers"][0]["args"] == OPERATOR_ARGS

    # The ServiceAccount's effective rights, as the apiserver's RBAC authorizer decides them
    # (a SubjectAccessReview: exactly the question the apiserver asks on each request).
    authz = client.AuthorizationV1Api(devcluster.api_client())
    user = f"system:serviceaccount:{namespace}:{fullname}"

    def can(verb: str, resource: str, subresource: str = "") -> bool:
        resource, _, group = resource.partition(".")
        review = authz.create_subject_access_review({
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": user, "groups": ["system:serviceaccounts",
                                              f"system:serviceaccounts:{namespace}"],
                     "resourceAttributes": {"verb": verb, "group": group, "resource": resource,
                                            "subresource": subresource,
                                            "namespace": namespace}}})
        return review.status.allowed

    allowed = [("watch", "dynatrainjobs.dynatrain.io"),
               ("patch", "dynatrainjobs.dynatrain.io", "status"),
               ("update", "dynatrainjobs.dynatrain.io", "finalizers"),
               ("delete", "dynatrainjobs.dynatrain.io"),     # spec.ttlSecondsAfterFinished
               ("create", "pods"), ("delete", "pods"), ("watch", "pods"),
               ("create", "services"), ("get", "secrets"), ("create", "secrets"),
               ("get", "configmaps"), ("create", "configmaps"), ("patch", "configmaps"),
               ("delete", "configmaps"), ("patch", "services"), ("delete", "secrets"),
               ("list", "nodes"), ("list", "pods"),
               ("create", "networkpolicies.networking.k8s.io"),
               ("patch", "networkpolicies.networking.k8s.io"),
               ("create", "events"), ("list", "namespaces"),
               ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
               ("get", "leases.coordination.k8s.io"), ("create", "leases.coordination.k8s.io"),
               ("update", "leases.coordination.k8s.io")]
    denied = [("create", "dynatrainjobs.dynatrain.io"),
              ("update", "dynatrainjobs.dynatrain.io"),
              ("update", "dynatrainjobs.dynatrain.io", "status"),
              # the operator never calls the scale subresource (kubectl scale is the user's)
              ("get", "dynatrainjobs.dynatrain.io", "scale"),
              ("patch", "dynatrainjobs.dynatrain.io", "scale"),
              ("list", "networkpolicies.networking.k8s.io"),
              ("list", "secrets"), ("watch", "secrets"), ("update", "secrets"),
              ("create", "deployments.apps"), ("patch", "nodes"), ("delete", "nodes"),
              ("update", "pods"), ("create", "pods", "exec"), ("create", "pods", "eviction"),
              ("update", "services"), ("delete", "namespaces"), ("list", "configmaps"),
              ("create", "customresourcedefinitions.apiextensions.k8s.io"),
              ("create", "clusterroles.rbac.authorization.k8s.io"),
              ("delete", "leases.coordination.k8s.io")]
    assert [a for a in allowed if not can(*a)] == []
    assert [d for d in denied if can(*d)] == []

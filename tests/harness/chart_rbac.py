"""The chart's RBAC on a dev cluster: the identity the operator tests run `dynatrain operator` as.

In a cluster the operator is the chart's ServiceAccount, with exactly the verbs of the chart's
ClusterRole. The tests run the operator as a local process, and with the dev cluster's admin
kubeconfig they would never notice a verb missing from the chart. So, once per cluster, the
chart's RBAC objects (ServiceAccount, ClusterRole, ClusterRoleBinding, any Role or RoleBinding)
are rendered by the real helm (built from tools/helm, as in test_chart.py), applied to the dev
cluster with server-side apply, and a token for the ServiceAccount is asked of the TokenRequest
API (the apiserver signs it with its service-account key); the operator's kubeconfig carries
that bearer token and the cluster's CA, and nothing else (:class:`operator_process.Operator`
uses it unless told otherwise). A request the chart does not grant is then refused with 403,
as it would be in a cluster.

:func:`chart_identity` with ``drop=(group, resource, verb)`` makes a second release whose
ClusterRole lacks that one verb: the test that a missing rule shows (test_operator_rbac.py).
"""

from __future__ import annotations

import copy
import datetime
import os
import re
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "dynatrain"
RELEASE = "dtj"
RELEASE_NAMESPACE = "dynatrain-system"
"""Where the chart's release lives (its ServiceAccount); the jobs run in other namespaces, as
the chart's operator serves every namespace (a ClusterRole and its binding)."""
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
FIELD_MANAGER = "dynatrain-rbac-tests"


@dataclass(frozen=True)
class Identity:
    """One release's ServiceAccount on one cluster, with a kubeconfig that acts as it."""

    namespace: str
    service_account: str
    kubeconfig: Path
    cluster_role: dict
    """The ClusterRole as applied (with the dropped verb gone, if any)."""
    dropped: tuple[str, str, str] | None = None

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


_lock = threading.Lock()


def _helm(cluster, *args: str) -> str:
    from dynatrain.devcluster.helm import ensure_helm

    home = cluster.workdir / "helm-home"        # helm's own config and caches, not ~
    env = {**os.environ, "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_CACHE_HOME": str(home / "cache"), "HELM_DATA_HOME": str(home / "data")}
    proc = subprocess.run([str(ensure_helm()), *args], capture_output=True, text=True,
                          timeout=120, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def render_rbac(cluster, release: str = RELEASE, namespace: str = RELEASE_NAMESPACE,
                *values: str) -> list[dict]:
    """The chart's RBAC objects as `helm template` renders them (``values``: more helm
    arguments, e.g. ``--set``)."""
    out = _helm(cluster, "template", release, str(CHART), "--namespace", namespace, *values)
    docs = [d for d in yaml.safe_load_all(out) if d and d.get("kind") in RBAC_KINDS]
    kinds = {d["kind"] for d in docs}
    missing = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"} - kinds
    assert not missing, f"the chart rendered no {sorted(missing)}"
    return docs


def without(role: dict, group: str, resource: str, verb: str) -> dict:
    """``role`` with ``verb`` on ``group``/``resource`` taken away and every other grant kept:
    a rule that also names other groups or resources is split."""
    rules, found = [], False
    for rule in role["rules"]:
        if group in rule.get("apiGroups", []) and resource in rule.get("resources", []) \
                and verb in rule.get("verbs", []):
            found = True
            others = {"groups": [g for g in rule["apiGroups"] if g != group],
                      "resources": [r for r in rule["resources"] if r != resource]}
            if others["groups"]:
                rules.append({**rule, "apiGroups": others["groups"]})
            if others["resources"]:
                rules.append({**rule, "apiGroups": [group], "resources": others["resources"]})
            verbs = [v for v in rule["verbs"] if v != verb]
            if verbs:
                rules.append({**rule, "apiGroups": [group], "resources": [resource],
                              "verbs": verbs})
        else:
            rules.append(rule)
    assert found, f"the chart's ClusterRole grants no {verb} on {group or 'core'}/{resource}"
    return {**role, "rules": rules}


def chart_identity(cluster, *, drop: tuple[str, str, str] | None = None) -> Identity:
    """The chart's RBAC applied to ``cluster`` and a kubeconfig for its ServiceAccount; made
    once per cluster (and per ``drop``), then reused by every test of the session.

    ``drop=(apiGroup, resource, verb)``: a release of its own (names that cannot clash with
    the full one) whose ClusterRole lacks that verb.
    """
    with _lock:
        # Kept on the cluster object: it dies with the cluster, and a later cluster (on the
        # same port, even) starts with none.
        made = cluster.__dict__.setdefault("_chart_rbac_identities", {})
        if drop not in made:
            made[drop] = _make(cluster, drop)
        return made[drop]


def _make(cluster, drop: tuple[str, str, str] | None) -> Identity:
    from dynatrain.devcluster.build import ensure_built
    from dynatrain.devcluster.processes import wait_until

    release = RELEASE if drop is None else "dtj-no-" + re.sub(
        r"[^a-z0-9]+", "-", f"{drop[2]}-{drop[1]}-{drop[0] or 'core'}")
    docs = render_rbac(cluster, release)
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    if drop is not None:
        role_index = docs.index(role)
        role = without(copy.deepcopy(role), *drop)
        docs[role_index] = role
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    manifest = cluster.workdir / f"rbac-{release}.yaml"
    manifest.write_text(yaml.safe_dump_all([
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": RELEASE_NAMESPACE}},
        *docs]))
    proc = subprocess.run([str(ensure_built().path("kubectl")), "--kubeconfig",
                           str(cluster.kubeconfig), "apply", "--server-side",
                           "--force-conflicts", f"--field-manager={FIELD_MANAGER}",
                           "-f", str(manifest)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"applying the chart's RBAC failed:\n{proc.stdout}{proc.stderr}"
    identity = Identity(namespace=sa["metadata"]["namespace"],
                        service_account=sa["metadata"]["name"],
                        kubeconfig=cluster.service_account_kubeconfig(
                            sa["metadata"]["namespace"], sa["metadata"]["name"],
                            cluster.workdir / f"{release}.kubeconfig"),
                        cluster_role=role, dropped=drop)
    # The authorizer learns of new roles and bindings from its own watch: wait until the
    # token's rights are in force (a first call refused would only cost the operator a retry,
    # but a test asking at once would see a stale "no").
    wait_until(f"the RBAC of {identity.user} in force", lambda: can(
        identity.kubeconfig, "watch", "dynatrain.io", "dynatrainjobs"),
        timeout=datetime.timedelta(seconds=30))
    return identity


def can(kubeconfig: Path, verb: str, group: str, resource: str, subresource: str = "",
        namespace: str = "") -> bool:
    """Whether the kubeconfig's own identity may do this: a SelfSubjectAccessReview, i.e. the
    apiserver's authorizer asked with the very token the operator uses."""
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        review = client.AuthorizationV1Api(api).create_self_subject_access_review({
            "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {
                "verb": verb, "group": group, "resource": resource,
                "subresource": subresource, "namespace": namespace}}})
        return bool(review.status.allowed)
    finally:
        api.close()

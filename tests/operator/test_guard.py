"""The operator's security manifests and checks, without a cluster: the authSecret label and the
image prefixes (operator/guard.py), each job's NetworkPolicy (operator/netpol.py) and the
hardened worker pod (operator/cluster.py). tests/k8s/test_operator_security.py runs them against
the dev cluster's apiserver (the refusals, the stored policy, a restricted namespace)."""

import json
import re
from pathlib import Path

import pytest
from kubernetes import client

from dynatrain.operator import cluster as k
from dynatrain.operator import guard, netpol

ROOT = Path(__file__).resolve().parents[2]
BODY = {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
        "metadata": {"name": "job", "namespace": "ns", "uid": "u-1"},
        "spec": {"image": "img:1", "resources": {"gpus": 1}}}


def model(kind: str, data: dict):
    """A client model object from its JSON form, as the client makes it from a response."""
    return client.ApiClient().deserialize(json.dumps(data), kind, "application/json")


def secret(labels):
    return model("V1Secret", {"metadata": {"name": "tok", "namespace": "ns",
                                           "labels": labels}, "data": {"token": "eA=="}})


# -- the authSecret label ------------------------------------------------------------------

def test_a_labelled_secret_is_accepted():
    assert guard.check_auth_secret(secret({guard.AGENT_TOKEN_LABEL: "true"}), "ns") == ""


@pytest.mark.parametrize("labels,says", [
    (None, "lacks the label dynatrain.io/agent-token=true"),
    ({"app": "db"}, "lacks the label dynatrain.io/agent-token=true"),
    ({guard.AGENT_TOKEN_LABEL: "yes"}, "its label dynatrain.io/agent-token is 'yes'"),
])
def test_an_unlabelled_secret_is_refused_naming_it_and_the_label(labels, says):
    text = guard.check_auth_secret(secret(labels), "ns")
    assert says in text
    assert "Secret ns/tok" in text
    assert "kubectl label secret tok -n ns dynatrain.io/agent-token=true" in text


def test_the_operators_own_token_secret_carries_the_label():
    s = k.token_secret(BODY, "t")
    assert s["metadata"]["labels"][guard.AGENT_TOKEN_LABEL] == "true"
    assert guard.check_auth_secret(model("V1Secret", s), "ns") == ""


# -- allowed images ------------------------------------------------------------------------

@pytest.mark.parametrize("image,prefixes,ok", [
    ("anything:1", (), True),                                   # no list: any image
    ("registry.example.com/team/trainer:1", ("registry.example.com/team/",), True),
    ("registry.example.com/team/trainer:1", ("registry.example.com/team",), True),
    ("registry.example.com/team:1", ("registry.example.com/team",), True),
    ("registry.example.com/team@sha256:ab", ("registry.example.com/team",), True),
    ("registry.example.com/team", ("registry.example.com/team",), True),
    # a prefix matches only at a boundary of the reference
    ("registry.example.com/team-evil/x:1", ("registry.example.com/team",), False),
    ("registry.example.com/teamx:1", ("registry.example.com/team",), False),
    ("evil.example.com/registry.example.com/team/x", ("registry.example.com/team/",), False),
    ("dynatrain:0.1.0", ("registry.example.com/team/", "dynatrain:"), True),
    ("dynatrain-evil:0.1.0", ("dynatrain",), False),
])
def test_image_prefixes(image, prefixes, ok):
    assert guard.image_allowed(image, prefixes) is ok
    text = guard.check_image(image, prefixes)
    assert (text == "") is ok
    if not ok:
        assert repr(image) in text and all(repr(p) in text for p in prefixes)
        assert "--allowed-images" in text


def test_flag_parsers_refuse_bad_values_by_name():
    assert guard.parse_image_prefixes("") == ()
    assert guard.parse_image_prefixes("a.io/x/, b.io/y") == ("a.io/x/", "b.io/y")
    for bad in ("a.io/x/,,b.io", "a.io/x y"):
        with pytest.raises(ValueError, match="--allowed-images"):
            guard.parse_image_prefixes(bad)
    assert guard.parse_labels("", "--f") == {}
    labels = guard.parse_labels("kubernetes.io/metadata.name=monitoring,team=ml", "--f")
    assert labels == {"kubernetes.io/metadata.name": "monitoring", "team": "ml"}
    assert guard.parse_labels(guard.format_labels(labels), "--f") == labels
    for bad in ("monitoring", "a=b,c", "bad key=x", "k=" + "v" * 64, "k=white space"):
        with pytest.raises(ValueError, match=re.escape(f"--f: {bad.split(',')[-1]!r}")):
            guard.parse_labels(bad, "--f")


# -- the job's NetworkPolicy -----------------------------------------------------------------

def policy(**over):
    args = dict(agent_port=50051, operator_namespace="dynatrain-system",
                operator_pod_labels={"app.kubernetes.io/name": "dynatrain",
                                     "app.kubernetes.io/instance": "dtj"},
                metrics_namespaces={"kubernetes.io/metadata.name": "monitoring"})
    return netpol.worker_policy(BODY, **{**args, **over})


def test_the_policy_selects_the_jobs_workers_and_admits_only_its_peers():
    p = policy()
    assert p["apiVersion"] == "networking.k8s.io/v1" and p["kind"] == "NetworkPolicy"
    assert p["metadata"]["name"] == "job-workers"
    assert p["metadata"]["labels"] == {k.JOB_LABEL: "job"}
    assert p["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    spec = p["spec"]
    # the same selector as the worker pods' label
    pod_labels = k.worker_pod(BODY, 0, secret="tok", agent_port=50051)["metadata"]["labels"]
    assert spec["podSelector"] == {"matchLabels": {k.JOB_LABEL: "job"}}
    assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["policyTypes"] == ["Ingress"]            # egress is not restricted
    peers, operator, metrics = spec["ingress"]
    # (a) the job's own pods (same namespace: no namespaceSelector), every port
    assert peers == {"from": [{"podSelector": {"matchLabels": {k.JOB_LABEL: "job"}}}]}
    # (b) the operator's pods, in its namespace, on the agent and health ports only
    assert operator["from"] == [{
        "namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "dynatrain-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "dynatrain",
                                        "app.kubernetes.io/instance": "dtj"}}}]
    assert operator["ports"] == [{"protocol": "TCP", "port": 50051},
                                 {"protocol": "TCP", "port": netpol.HEALTH_PORT}]
    # (c) the metrics port, from the chosen namespaces
    assert metrics == {"from": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}],
        "ports": [{"protocol": "TCP", "port": k.METRICS_PORT}]}
    # the job's agent port follows the spec
    assert policy(agent_port=6000)["spec"]["ingress"][1]["ports"][0]["port"] == 6000


def test_an_empty_metrics_selector_is_every_namespace():
    (rule,) = [r for r in policy(metrics_namespaces={})["spec"]["ingress"]
               if r.get("ports", [{}])[0].get("port") == k.METRICS_PORT]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {}}}]


def test_a_stored_policy_is_compared_by_its_spec():
    want = policy()
    # As the apiserver returns it: an empty selector's matchLabels dropped, nothing else.
    stored = model("V1NetworkPolicy", policy(metrics_namespaces={}))
    assert not netpol.spec_differs(model("V1NetworkPolicy", want), want)
    assert netpol.spec_differs(stored, want)
    assert not netpol.spec_differs(stored, policy(metrics_namespaces={}))
    assert netpol.spec_differs(model("V1NetworkPolicy", policy(agent_port=1)), want)


# -- the hardened worker pod -----------------------------------------------------------------

def test_worker_pods_meet_the_restricted_profile_with_scratch_space():
    p = k.worker_pod({**BODY, "spec": {**BODY["spec"], "checkpoint": {"claimName": "c"}}}, 3,
                     secret="tok", agent_port=50051)
    pod = p["spec"]["securityContext"]
    assert pod == {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                   "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"},
                   "fsGroupChangePolicy": "OnRootMismatch"}   # a large claim is not re-owned
    (c,) = p["spec"]["containers"]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]},
                                    "readOnlyRootFilesystem": True, "runAsNonRoot": True}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in p["spec"]["volumes"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    # writable: the scratch emptyDirs and the claim; read-only: the job file and the token
    for path in (env["TMPDIR"], env["HOME"], "/checkpoints"):
        assert not mounts[path].get("readOnly"), path
    assert volumes[mounts["/tmp"]["name"]] == {"name": "tmp", "emptyDir": {}}
    assert "emptyDir" in volumes[mounts[env["HOME"]]["name"]]
    assert env["XDG_CACHE_HOME"].startswith(env["HOME"] + "/")
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert mounts["/etc/dynatrain"]["readOnly"] and mounts[
        "/var/run/secrets/dynatrain"]["readOnly"]
    # no hostPath, no host namespaces, no privileged anything
    assert not any("hostPath" in v for v in volumes.values())
    assert not any(p["spec"].get(f) for f in ("hostNetwork", "hostPID", "hostIPC"))
    # /dev/shm in memory (a runtime's own is 64 MiB); no service-account token
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"] == {"medium": "Memory"}
    assert p["spec"]["automountServiceAccountToken"] is False


def test_the_image_runs_as_the_workers_user():
    text = (ROOT / "Dockerfile").read_text()
    assert f"useradd --uid {k.WORKER_UID}" in text
    assert re.search(rf"^USER {k.WORKER_UID}$", text, re.M)
    # the scratch HOME is the image user's home, so its own files stay where they are expected
    assert f"WORKDIR {k.SCRATCH_HOME}" in text

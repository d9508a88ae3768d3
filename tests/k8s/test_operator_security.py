"""The operator on a shared cluster, against the dev cluster: what it refuses to do for a job, the
NetworkPolicy it writes, and worker pods that the ``restricted`` Pod Security Standard admits.

One namespace for the module, labelled ``pod-security.kubernetes.io/enforce: restricted`` (the
dev cluster's kube-apiserver runs the built-in PodSecurity admission plugin; the first test
shows it rejecting a pod that is not hardened, so the others can fail), and one operator
(as the chart's ServiceAccount, :class:`operator_process.Operator`) started with
``--allowed-images dynatrain`` (the test jobs' image is ``dynatrain:0.1.0``):

- a job naming an unlabelled Secret as ``spec.agent.authSecret`` fails, with a condition and an
  Event that name the Secret, the label and the command that adds it, and no worker pod;
- a job whose image matches no prefix waits with ``ImageAllowed=False`` and an Event naming the
  image and the prefixes, and no worker pod (``spec.image`` is immutable, so a fixed image
  means a new job; that path is the next test's);
- a job with an allowed image trains in the restricted namespace (its hardened pods are
  admitted), and its NetworkPolicy is stored with the selectors and ports of operator/netpol.py.

The dev cluster's pod network is loopback addresses and has no CNI, so nothing enforces the
NetworkPolicy here: the test checks what is written (which a CNI such as Calico or Cilium
enforces), not that traffic is dropped.
"""

from __future__ import annotations

import datetime
import json
import time
import uuid

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from harness.chart_rbac import RELEASE_NAMESPACE
from harness.operator_process import (ROOT, Operator, apply, condition, events, get, job, job_pods,
                              wait)

pytestmark = pytest.mark.k8s

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}
OPERATOR_LABELS = "app.kubernetes.io/name=dynatrain,app.kubernetes.io/instance=dtj"


@pytest.fixture(scope="module")
def restricted(devcluster, kubectl, tmp_path_factory):
    """(namespace, operator, custom API): a restricted namespace, the operator serving it, and
    a pod runner for its worker pods."""
    from harness.pod_runner import job_pods
    from dynatrain.devcluster.processes import wait_until

    core = devcluster.core()
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace(body={"metadata": {"name": name, "labels": RESTRICTED}})
    wait_until(f"the default ServiceAccount of {name}", lambda: any(
        sa.metadata.name == "default" for sa in core.list_namespaced_service_account(name).items),
        timeout=datetime.timedelta(seconds=30))
    kubectl("apply", "--server-side", "--force-conflicts", "-f",
            str(ROOT / "crds" / "dynatrainjob.yaml"))
    devcluster.wait_established("dynatrainjobs.dynatrain.io")
    workdir = tmp_path_factory.mktemp("security")
    op = Operator(devcluster, name, workdir)
    op.args = ["--allowed-images", "dynatrain,registry.example.com/ml/",
               "--operator-namespace", RELEASE_NAMESPACE,
               "--operator-pod-labels", OPERATOR_LABELS,
               "--metrics-namespace-selector", "kubernetes.io/metadata.name=monitoring"]
    pods = job_pods(devcluster.core(), workdir / "pods", name)
    with pods:
        op.start()
        try:
            yield name, op, client.CustomObjectsApi(devcluster.api_client())
        finally:
            op.stop()
            print(op.logs()[-8000:])
            for pod in core.list_namespaced_pod(name).items:
                core.delete_namespaced_pod(pod.metadata.name, name, grace_period_seconds=0)
            core.delete_namespace(name)


def test_the_namespace_rejects_a_pod_that_is_not_hardened(devcluster, restricted):
    namespace, _, _ = restricted
    core = devcluster.core()
    # A plain pod, as before this change: runAsNonRoot alone, the default seccomp profile,
    # every capability kept.
    plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"},
             "spec": {"securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
                      "containers": [{"name": "c", "image": "dynatrain:0.1.0"}]}}
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod(namespace, plain, dry_run="All")
    assert e.value.status == 403, e.value
    text = json.loads(e.value.body)["message"]
    assert 'violates PodSecurity "restricted:latest"' in text, text
    for missing in ("allowPrivilegeEscalation", "capabilities", "seccompProfile"):
        assert missing in text, (missing, text)


def test_an_unlabelled_auth_secret_fails_the_job_by_name(devcluster, kubectl, restricted,
                                                        tmp_path):
    namespace, _, custom = restricted
    core = devcluster.core()
    core.create_namespaced_secret(namespace, {"metadata": {"name": "db-password"},
                                              "stringData": {"token": "hunter2"}})
    doc = job("borrow", gpus=1, max_workers=1)
    doc["spec"]["agent"]["authSecret"] = "db-password"
    apply(kubectl, namespace, tmp_path, doc)
    wait("the job to fail", lambda: get(custom, namespace, "borrow").get(
        "status", {}).get("phase") == "Failed", timeout=90)
    cond = condition(custom, namespace, "borrow", "AuthSecretAllowed")
    assert cond["status"] == "False" and cond["reason"] == "SecretNotLabelled", cond
    for words in (f"Secret {namespace}/db-password", "dynatrain.io/agent-token=true",
                  f"kubectl label secret db-password -n {namespace} "
                  "dynatrain.io/agent-token=true"):
        assert words in cond["message"], (words, cond)
    failed = condition(custom, namespace, "borrow", "Failed")
    assert failed["status"] == "True" and "dynatrain.io/agent-token" in failed["message"]
    (event,) = [e for e in events(core, namespace, "borrow") if e.reason == "SecretNotLabelled"]
    assert event.type == "Warning" and event.message == cond["message"]
    assert job_pods(core, namespace, "borrow") == []


def test_a_disallowed_image_is_refused_before_any_pod(devcluster, kubectl, restricted,
                                                      tmp_path):
    namespace, _, custom = restricted
    core = devcluster.core()
    doc = job("miner", gpus=1, max_workers=1)
    # The prefix "dynatrain" admits dynatrain:0.1.0, not an image that merely starts with it.
    doc["spec"]["image"] = "dynatrain-miner.example.com/x:1"
    apply(kubectl, namespace, tmp_path, doc)
    cond = wait("ImageAllowed False", lambda: (
        c if (c := condition(custom, namespace, "miner", "ImageAllowed"))
        and c["status"] == "False" else None), timeout=90)
    assert cond["reason"] == "ImageNotAllowed", cond
    for words in ("'dynatrain-miner.example.com/x:1'", "'dynatrain'",
                  "'registry.example.com/ml/'"):
        assert words in cond["message"], (words, cond)
    (event,) = [e for e in events(core, namespace, "miner") if e.reason == "ImageNotAllowed"]
    assert event.type == "Warning" and event.message == cond["message"]
    time.sleep(3)                  # passes go on (ticks of 0.3 s): still no pod, still Pending
    assert job_pods(core, namespace, "miner") == []
    assert get(custom, namespace, "miner")["status"]["phase"] == "Pending"
    kubectl("delete", "dynatrainjob", "miner", "-n", namespace, "--wait=false")


@pytest.mark.slow
def test_the_job_trains_in_the_restricted_namespace_behind_its_policy(devcluster, kubectl,
                                                                      restricted, tmp_path):
    namespace, _, custom = restricted
    core = devcluster.core()
    apply(kubectl, namespace, tmp_path, job("hardened", gpus=1, max_workers=1))

    def trained():
        st = get(custom, namespace, "hardened").get("status", {})
        return st if st.get("phase") == "Running" and st.get("step", 0) > 0 else None

    st = wait("the job to train in the restricted namespace", trained, timeout=180)
    assert st["workers"] == 1
    assert condition(custom, namespace, "hardened", "ImageAllowed")["status"] == "True"
    (pod,) = job_pods(core, namespace, "hardened")    # admitted by PodSecurity "restricted"
    assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
    assert pod.spec.containers[0].security_context.read_only_root_filesystem is True

    policy = client.NetworkingV1Api(devcluster.api_client()).read_namespaced_network_policy(
        "hardened-workers", namespace)
    owner = policy.metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.controller) == ("DynaTrainJob", "hardened", True)
    spec = policy.spec
    assert spec.pod_selector.match_labels == {"dynatrain.io/job": "hardened"}
    assert spec.pod_selector.match_labels.items() <= pod.metadata.labels.items()
    assert spec.policy_types == ["Ingress"]
    peers, operator, metrics = spec.ingress
    assert [p.pod_selector.match_labels for p in peers._from] == [
        {"dynatrain.io/job": "hardened"}] and peers.ports is None        # every port
    (op_peer,) = operator._from
    assert op_peer.namespace_selector.match_labels == {
        "kubernetes.io/metadata.name": RELEASE_NAMESPACE}
    assert op_peer.pod_selector.match_labels == dict(
        kv.split("=") for kv in OPERATOR_LABELS.split(","))
    assert sorted(p.port for p in operator.ports) == [9401, 50051]
    (scraper,) = metrics._from
    assert scraper.namespace_selector.match_labels == {
        "kubernetes.io/metadata.name": "monitoring"} and scraper.pod_selector is None
    assert [p.port for p in metrics.ports] == [9400]
    kubectl("delete", "dynatrainjob", "hardened", "-n", namespace, "--wait=false")

"""What the dev cluster installs of Kueue, from Kueue's own module source (devcluster/kueue.py):
the webhooks it keeps and how the apiserver calls them, the manager's configuration, and the
private mount namespace it runs in. The manager running against a real apiserver is in
tests/k8s/test_operator_kueue.py."""

from __future__ import annotations

import base64
import os

import pytest

from dynatrain.devcluster import kueue
from dynatrain.devcluster.errors import DevClusterError
from dynatrain.devcluster.gobuild import GoUnavailable


@pytest.fixture(scope="module")
def src():
    try:
        return kueue.source_dir()
    except (GoUnavailable, DevClusterError) as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Kueue's module source is not available here: {e}")


def test_the_source_is_downloaded_when_the_module_cache_lacks_it(tmp_path, monkeypatch):
    # Kueue's binary is cached by the dev cluster (~/.cache/dynatrain/kueue) apart from Go's
    # module cache, which a user can clean: the source is then fetched again, not refused.
    cache = tmp_path / "gomodcache"
    monkeypatch.setenv("GOMODCACHE", str(cache))
    try:
        src = kueue.source_dir()
    except GoUnavailable as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no Go here: {e}")
    finally:
        for root, dirs, _ in os.walk(cache):           # Go's module cache is read-only
            os.chmod(root, 0o755)
    assert src.is_relative_to(cache) and (src / "config" / "components" / "crd").is_dir()


def test_the_webhooks_kept_call_the_manager_on_loopback_and_pods_only_with_a_queue(src):
    docs = kueue.webhook_configurations(src, url="https://127.0.0.1:9443", ca_pem=b"PEM")
    assert {d["kind"] for d in docs} == {"MutatingWebhookConfiguration",
                                        "ValidatingWebhookConfiguration"}
    hooks = [h for d in docs for h in d["webhooks"]]
    names = {h["name"] for h in hooks}
    assert {"mpod.kb.io", "vpod.kb.io", "mclusterqueue.kb.io", "vworkload.kb.io"} <= names
    # Other frameworks' webhooks (batch Job, Ray, JobSet...) are not installed.
    assert not names & {"mjob.kb.io", "mrayjob.kb.io", "mjobset.kb.io"}, names
    for h in hooks:
        cfg = h["clientConfig"]
        assert cfg["url"].startswith("https://127.0.0.1:9443/") and "service" not in cfg
        assert base64.b64decode(cfg["caBundle"]) == b"PEM"
    pod = next(h for h in hooks if h["name"] == "mpod.kb.io")
    assert pod["objectSelector"]["matchExpressions"] == [
        {"key": kueue.QUEUE_LABEL, "operator": "Exists"}]
    assert pod["namespaceSelector"]["matchExpressions"][0]["values"] == [
        "kube-system", kueue.NAMESPACE]
    assert all(d["metadata"]["name"].startswith("kueue-") for d in docs)


def test_the_crds_are_kueues_own(src):
    kinds = {d["spec"]["names"]["kind"] for d in kueue.crds(src)}
    assert {"ClusterQueue", "LocalQueue", "ResourceFlavor", "Workload", "Cohort"} <= kinds


def test_the_configuration_and_the_private_mount_namespace(tmp_path):
    cfg = kueue.configuration(webhook_port=1, cert_dir=tmp_path, metrics_port=2, health_port=3)
    assert cfg["integrations"] == {"frameworks": ["pod"]}
    assert cfg["manageJobsWithoutQueueName"] is False
    assert cfg["internalCertManagement"] == {"enable": False}
    assert cfg["webhook"] == {"port": 1, "host": "127.0.0.1", "certDir": str(tmp_path)}
    assert cfg["featureGates"] == {"VisibilityOnDemand": False}
    argv = kueue.manager_argv(tmp_path / "kueue", config=tmp_path / "c.yaml",
                              kubeconfig=tmp_path / "k", etc_upper=tmp_path / "u",
                              etc_work=tmp_path / "w")
    assert argv[:4] == ["unshare", "--mount", "--propagation", "private"]
    assert "mount -t overlay" in argv[7] and str(tmp_path / "u") in argv
    assert argv[-3:] == [f"--config={tmp_path / 'c.yaml'}", f"--kubeconfig={tmp_path / 'k'}",
                         "--zap-log-level=info"]


def test_without_root_it_says_why(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(DevClusterError, match="needs root"):
        kueue.check_can_run()

"""The operator's kopf login in a pod (operator/handlers.py): the API server where the Kubernetes
client's in-cluster config finds it ($KUBERNETES_SERVICE_HOST/PORT), not kopf's default
``https://kubernetes.default.svc``, which needs the cluster's DNS (the chart's Deployment on the
dev cluster's real node had none: kopf reached nothing while the pod showed Ready)."""

from __future__ import annotations

import kopf
import pytest

from dynatrain.operator.handlers import in_cluster_login


def _account(tmp_path, *, token="tok-123\n", ca=True, namespace="dynatrain-system"):
    if token is not None:
        (tmp_path / "token").write_text(token)
    if ca:
        (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    if namespace:
        (tmp_path / "namespace").write_text(namespace)
    return tmp_path


def test_the_server_is_the_environments_and_the_token_and_ca_the_pods(tmp_path):
    info = in_cluster_login(kopf.OperatorSettings(), account=_account(tmp_path),
                            env={"KUBERNETES_SERVICE_HOST": "10.96.0.1",
                                 "KUBERNETES_SERVICE_PORT": "6443"})
    assert info.server == "https://10.96.0.1:6443"
    assert info.token == "tok-123"
    assert info.ca_path == str(tmp_path / "ca.crt")
    assert info.default_namespace == "dynatrain-system"


def test_an_ipv6_service_host_is_bracketed_and_the_port_defaults_to_443(tmp_path):
    info = in_cluster_login(kopf.OperatorSettings(), account=_account(tmp_path, ca=False),
                            env={"KUBERNETES_SERVICE_HOST": "fd00::1"})
    assert info.server == "https://[fd00::1]:443"
    assert info.ca_path is None


def test_no_token_is_a_login_error_that_says_why(tmp_path):
    with pytest.raises(kopf.LoginError, match="automountServiceAccountToken"):
        in_cluster_login(kopf.OperatorSettings(), account=_account(tmp_path, token=None),
                         env={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})

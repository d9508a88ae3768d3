"""`kubectl logs`, `port-forward` and `exec` on the dev cluster's simulated nodes (issue #39).

The real apiserver proxies them to the node's kubelet endpoint, which for a kwok node is kwok's
own server (dynatrain/devcluster/endpoints.py); kwok serves a pod from the Logs and PortForward
rules the pod runner publishes for it. The checks are those of a real kubelet's node
(pod_endpoints.py, shared with test_real_node.py), run with the real kubectl: logs of the
running container and of the previous one after a restart, ``--tail``, ``--timestamps``,
``-f`` following new lines, a port-forward to the metrics port answering with a worker's
Prometheus text, and ``kubectl exec`` refused with the reason. The rules go with the pod.
"""

from __future__ import annotations

import datetime
import sys

import pytest
from kubernetes import client

from dynatrain.devcluster import endpoints
from dynatrain.devcluster.build import ensure_built
from dynatrain.devcluster.processes import wait_until
from harness.pod_endpoints import check_pod_endpoints, endpoint_pod

pytestmark = pytest.mark.k8s


def test_kubectl_logs_follow_previous_and_port_forward_reach_a_simulated_pod(
        devcluster, core, namespace, tmp_path):
    from dynatrain.devcluster.pods import PodRunner

    node = core.read_node("cpu-node-0")
    # The apiserver calls the node's kubelet at InternalIP:kubeletEndpoint.Port: kwok's server.
    assert node.status.daemon_endpoints.kubelet_endpoint.port == devcluster.kubelet_port
    assert {a.type: a.address for a in node.status.addresses}["InternalIP"] == "127.0.0.1"
    kubectl = [str(ensure_built().path("kubectl")), "--kubeconfig", str(devcluster.kubeconfig)]
    long = datetime.timedelta(seconds=60)
    with PodRunner(core, tmp_path / "pods", namespace=namespace, backoff_first_s=0.5) as runner:
        core.create_namespaced_pod(namespace, endpoint_pod(
            "talker", sys.executable, node_selector={"kubernetes.io/hostname": "cpu-node-0"}))
        check_pod_endpoints(kubectl, core, namespace, "talker",
                            exec_refusal=endpoints.EXEC_REFUSAL, timeout=long)
        # The plain log keeps both runs, as before.
        plain = runner.log(namespace, "talker")
        assert "first run: line 0" in plain and "--- restart 1 ---" in plain
        assert "second run: line 3" in plain
        assert not runner.errors, runner.errors

        # The rules are the pod's: the garbage collector deletes them with it.
        custom = client.CustomObjectsApi(devcluster.api_client())
        for plural in (endpoints.LOGS_PLURAL, endpoints.PORT_FORWARD_PLURAL):
            rule = custom.get_namespaced_custom_object(endpoints.GROUP, endpoints.VERSION,
                                                       namespace, plural, "talker")
            assert rule["metadata"]["ownerReferences"][0]["name"] == "talker"
        core.delete_namespaced_pod("talker", namespace, grace_period_seconds=0)

        def rules_gone() -> bool:
            return not any(custom.list_namespaced_custom_object(
                endpoints.GROUP, endpoints.VERSION, namespace, plural)["items"]
                for plural in (endpoints.LOGS_PLURAL, endpoints.PORT_FORWARD_PLURAL))

        wait_until("the pod's Logs and PortForward to be garbage-collected", rules_gone,
                   timeout=long)


def test_the_cri_log_keeps_streams_partial_lines_and_the_previous_run(tmp_path):
    """ContainerOutput, with a real process: what kwok's reader (the kubelet's) needs."""
    import re
    import subprocess

    out = endpoints.ContainerOutput(tmp_path / "container.log", tmp_path / "kubelet")
    out.reset()
    script = ("import sys; print('one'); sys.stdout.flush(); sys.stderr.write('two\\n');"
              "sys.stderr.flush(); sys.stdout.write('x' * 20000 + '\\nno newline')")
    for run in range(2):
        if run:
            out.rotate()
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        out.start(proc.stdout, proc.stderr)
        proc.wait(30)
        out.join(10)
    entry = re.compile(rb"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z (stdout|stderr) ([FP]) (.*)$")
    for name in ("current.log", "previous.log"):
        lines = (tmp_path / "kubelet" / name).read_bytes().split(b"\n")
        assert lines[-1] == b""
        parsed = [entry.match(line).groups() for line in lines[:-1]]
        assert (b"stdout", b"F", b"one") in parsed and (b"stderr", b"F", b"two") in parsed
        # A 20000-byte line is one entry here (only a rest over 16 KiB is split); the text
        # after the last newline is a partial entry (P) when the pipe closes.
        assert (b"stdout", b"F", b"x" * 20000) in parsed
        assert parsed[-1] == (b"stdout", b"P", b"no newline"), parsed
    # The plain log has both runs, byte for byte.
    plain = (tmp_path / "container.log").read_text()
    assert plain.count("one\n") == 2 and plain.count("no newline") == 2

"""Mutual TLS between the operator and the agents, and whom the operator trusts, on the dev
cluster (real apiserver, the workers as local processes on their pod IPs).

One job, started once with a short ``--cert-lifetime``, shared by the checks: its workers
answer the operator's Status over mutual TLS; a pod (a process the dev cluster runs on its own
pod IP) that holds the token but no client certificate, or one from another CA, is refused at
the TLS handshake, while the same pod with the operator's certificate is answered, and its
Prepares with a checkpoint outside the job's checkpoint root, a store on a foreign address or a
4 MB device list are refused at once, each naming what is wrong; a pod with
the job's labels and its owner reference that the operator did not create is never called
(it serves the job's own certificate and records every call); the certificates are renewed in
the Secrets, reach the running worker (the pod runner re-syncs Secret volumes as a kubelet
does) and the job trains on past the first certificates' expiry. A second job names a
cert-manager Issuer on a cluster without cert-manager: it waits, with a condition saying so.
(cert-manager's issuance itself is not exercised: the dev cluster has no cert-manager; the
Certificate objects are checked in tests/operator/test_pki.py.)
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import socket
import ssl
import sys
import time

import pytest
import yaml
from cryptography import x509
from kubernetes import client

from dynatrain.operator import cluster, pki
from harness.operator_process import agent_client, condition, events, get, job, wait

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

LIFETIME_S = 45
PROBE = r"""
import json, socket, sys, time, grpc
from dynatrain.agent.v1 import agent_pb2, agent_pb2_grpc
address, name, token, tls, device = sys.argv[1:6]
read = lambda f: open(f"{tls}/{f}", "rb").read()
ca = read("serving-ca.crt")
meta = (("authorization", "Bearer " + token),)
for label, creds in (
        ("no-cert", grpc.ssl_channel_credentials(ca)),
        ("other-ca", grpc.ssl_channel_credentials(ca, read("other.key"), read("other.crt"))),
        ("operator-cert", grpc.ssl_channel_credentials(ca, read("client.key"),
                                                       read("client.crt")))):
    with grpc.secure_channel(address, creds, [("grpc.ssl_target_name_override", name)]) as ch:
        try:
            agent_pb2_grpc.AgentStub(ch).Status(agent_pb2.StatusRequest(), timeout=10,
                                                metadata=meta)
            out = {"attempt": label, "code": "OK"}
        except grpc.RpcError as e:
            out = {"attempt": label, "code": e.code().name, "details": e.details()}
    print(json.dumps(out), flush=True)
# With the operator's credentials, three Prepares that must be refused at once, by name,
# before they touch the running generation. The store's host for the first is this pod's own
# address as the agent sees it (the source address the kernel picks towards the agent).
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
    u.connect((address.rpartition(":")[0], 9))
    mine = u.getsockname()[0]
prepare = dict(generation=1000, layout="dp=1", devices=[int(device)])
with grpc.secure_channel(address, grpc.ssl_channel_credentials(
        ca, read("client.key"), read("client.crt")),
        [("grpc.ssl_target_name_override", name)]) as ch:
    stub = agent_pb2_grpc.AgentStub(ch)
    for label, req in (
            ("checkpoint-outside-root", agent_pb2.PrepareRequest(
                **prepare, rendezvous=f"{mine}:29500", checkpoint="/etc/dynatrain/step-00000001")),
            ("foreign-rendezvous", agent_pb2.PrepareRequest(
                **prepare, rendezvous="10.255.0.1:29500")),
            ("4MB-device-list", agent_pb2.PrepareRequest(
                generation=1000, layout="dp=1", rendezvous=f"{mine}:29500",
                devices=range(1_400_000)))):
        started = time.monotonic()
        try:
            stub.Prepare(req, timeout=30, metadata=meta)
            out = {"attempt": label, "code": "OK"}
        except grpc.RpcError as e:
            out = {"attempt": label, "code": e.code().name, "details": e.details()}
        out.update(bytes=req.ByteSize(), seconds=round(time.monotonic() - started, 3))
        print(json.dumps(out), flush=True)
"""
IMPOSTOR = r"""
import json, sys, time, grpc
from concurrent import futures
host, tls = sys.argv[1:3]
read = lambda f: open(f"{tls}/{f}", "rb").read()

class Record(grpc.GenericRpcHandler):
    def service(self, details):          # every call, recorded; answered UNIMPLEMENTED
        keys = [k for k, _ in details.invocation_metadata or ()]
        print(json.dumps({"method": details.method, "token": "authorization" in keys}),
              flush=True)
        return None

server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[Record()])
# The job's own serving certificate (its owner can read the Secret): were the operator to
# trust this pod, its TLS handshake would succeed and its calls be recorded here.
server.add_secure_port(f"{host}:50051", grpc.ssl_server_credentials(
    [(read("tls.key"), read("tls.crt"))]))
server.add_insecure_port(f"{host}:9401")
server.start()
print("serving", flush=True)
time.sleep(600)
"""


def _process_pod(name: str, script: str, args: list[str], *, labels: dict, volumes: dict,
                 env: list | None = None, owner: dict | None = None) -> dict:
    """A pod whose container is this Python running ``script`` (the pod runner runs any
    command); ``volumes``: mount path -> Secret name."""
    meta = {"name": name, "labels": labels}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {
        "restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": "cpu-node-0"},
        "containers": [{"name": "main", "image": "unused",
                        "command": [sys.executable, "-c", script], "args": args,
                        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {
                            "fieldPath": "status.podIP"}}}] + (env or []),
                        "volumeMounts": [{"name": f"v{i}", "mountPath": path, "readOnly": True}
                                         for i, path in enumerate(volumes)]}],
        "volumes": [{"name": f"v{i}", "secret": {"secretName": secret}}
                    for i, secret in enumerate(volumes.values())]}}


def _lines(pods, namespace: str, pod: str) -> list[dict]:
    return [json.loads(line) for line in pods.log(namespace, pod).splitlines()
            if line.startswith("{")]


def _serial(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


def _served_cert(ip: str, server_name: str, data: dict, tmp_path) -> x509.Certificate:
    """The certificate the agent at ``ip`` presents to a new connection (with the operator's
    client certificate, as the operator connects)."""
    (tmp_path / "client.crt").write_bytes(data["client.crt"])
    (tmp_path / "client.key").write_bytes(data["client.key"])
    ctx = ssl.create_default_context(cadata=data["serving-ca.crt"].decode())
    ctx.load_cert_chain(tmp_path / "client.crt", tmp_path / "client.key")
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((ip, 50051), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_name) as s:
            return x509.load_der_x509_certificate(s.getpeercert(binary_form=True))


def test_mutual_tls_trusted_pods_and_rotation(devcluster, kubectl, namespace, operator,
                                              tmp_path):
    op, pods = operator
    op.stop()                                   # again, with short-lived certificates
    op.args = [*op.args, "--cert-lifetime", f"{LIFETIME_S}s"]
    op.start()
    core = devcluster.core()
    custom = client.CustomObjectsApi(devcluster.api_client())
    manifest = tmp_path / "jobs.yaml"
    issued = job("issued", gpus=1, max_workers=1)
    issued["spec"]["agent"]["issuerRef"] = {"name": "team-ca", "kind": "ClusterIssuer"}
    # A checkpoint claim gives the worker a checkpoint root (no checkpoint is written: the
    # interval is past the test's end), so a path outside it can be refused as such.
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "tls-ckpt"},
        "spec": {"accessModes": ["ReadWriteMany"],
                 "resources": {"requests": {"storage": "1Gi"}}}})
    tls_job = job("tls", gpus=1, max_workers=1)
    tls_job["spec"]["checkpoint"] = {"claimName": "tls-ckpt", "path": "/checkpoints",
                                     "intervalSteps": 100000}
    manifest.write_text(yaml.safe_dump_all([tls_job, issued]))
    kubectl("apply", "-n", namespace, "-f", str(manifest))

    # -- a job naming a cert-manager Issuer, on a cluster without cert-manager: it waits
    cond = wait("the issuerRef job's CertificatesReady condition", lambda: condition(
        custom, namespace, "issued", "CertificatesReady"), timeout=60)
    assert cond["status"] == "False" and cond["reason"] == "CertManagerMissing", cond
    assert "no cert-manager Certificate API (cert-manager.io/v1)" in cond["message"]
    assert "ClusterIssuer 'team-ca'" in cond["message"]

    st = wait("the job to train", lambda: (lambda s: s if s.get("phase") == "Running"
                                           and s.get("step", 0) > 0 else None)(
        get(custom, namespace, "tls").get("status", {})), timeout=150)
    worker = core.list_namespaced_pod(namespace, label_selector="dynatrain.io/job=tls").items[0]
    assert st["workerUIDs"] == [worker.metadata.uid]
    assert not core.list_namespaced_pod(namespace,
                                        label_selector="dynatrain.io/job=issued").items
    # the worker pod as made: the TLS Secret mounted, the flags, the probe on the health port
    c0 = worker.spec.containers[0]
    assert "--tls-dir" in c0.args and c0.args[c0.args.index("--tls-dir") + 1] == cluster.TLS_DIR
    assert c0.readiness_probe.grpc.port == 9401
    tls_volume = next(v for v in worker.spec.volumes if v.secret and
                      v.secret.secret_name == "tls-agent-tls")
    assert any(m.name == tls_volume.name and m.mount_path == cluster.TLS_DIR and m.read_only
               for m in c0.volume_mounts)
    first = pki.secret_bytes(core.read_namespaced_secret("tls-agent-pki", namespace).data)
    served0 = pki.secret_bytes(core.read_namespaced_secret("tls-agent-tls", namespace).data)
    assert set(served0) == {"client-ca.crt", "tls.crt", "tls.key"}

    # -- the worker answers the operator's Status over mutual TLS (and the token)
    with agent_client(core, namespace, "tls", worker) as agent:
        s1 = agent.status()
        wait("the worker to step on", lambda: agent.status().step > s1.step, timeout=60)

    # -- the token without the client certificate, or with another CA's, is refused at the
    # handshake; the operator's certificate from the same pod is answered
    server_name = pki.server_name(worker.metadata.name, "tls", namespace)
    other, _ = pki.advance(None, job="tls", namespace=namespace,
                           now=datetime.datetime.now(datetime.timezone.utc), lifetime_s=600)
    current = pki.secret_bytes(core.read_namespaced_secret("tls-agent-pki", namespace).data)
    probe_files = {"serving-ca.crt": current["serving-ca.crt"],
                   "client.crt": current["client.crt"], "client.key": current["client.key"],
                   "other.crt": other.client.cert, "other.key": other.client.key}
    core.create_namespaced_secret(namespace, {"metadata": {"name": "probe-tls"}, "data": {
        k: base64.b64encode(v).decode() for k, v in probe_files.items()}})
    handshakes_before = pods.log(namespace, worker.metadata.name).count("Handshake failed")
    core.create_namespaced_pod(namespace, _process_pod(
        "probe", PROBE, [f"{worker.status.pod_ip}:50051", server_name, "$(TOKEN)", "/probe",
                         worker.metadata.labels["dynatrain.io/device"]],
        labels={"dynatrain.io/job": "probe"}, volumes={"/probe": "probe-tls"},
        env=[{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "tls-agent-token",
                                                               "key": "token"}}}]))
    wait("the probe pod to finish", lambda: len(_lines(pods, namespace, "probe")) == 6,
         timeout=90)
    probe_ip = core.read_namespaced_pod("probe", namespace).status.pod_ip
    # A pod address of its own, from the cluster's pod range, not the operator's.
    cidr = ipaddress.ip_network(os.environ.get("DYNATRAIN_TEST_POD_CIDR", "127.20.0.0/16"))
    assert probe_ip != worker.status.pod_ip and ipaddress.ip_address(probe_ip) in cidr, probe_ip
    answers = {a["attempt"]: a for a in _lines(pods, namespace, "probe")}
    print("probe:", answers)
    assert answers["operator-cert"]["code"] == "OK", answers
    for attempt in ("no-cert", "other-ca"):
        assert answers[attempt]["code"] == "UNAVAILABLE", answers
    # With the operator's own credentials: refused at once, each naming what is wrong.
    refused = {"checkpoint-outside-root": ("INVALID_ARGUMENT", "outside the job's checkpoint "
                                           "root"),
               "foreign-rendezvous": ("PERMISSION_DENIED", "10.255.0.1:29500"),
               "4MB-device-list": ("RESOURCE_EXHAUSTED", "larger than max")}
    for attempt, (code, named) in refused.items():
        a = answers[attempt]
        assert a["code"] == code and named in a["details"] and a["seconds"] < 5, a
    assert answers["4MB-device-list"]["bytes"] > 4_000_000
    assert "/etc/dynatrain/step-00000001" in answers["checkpoint-outside-root"]["details"]
    # Over TLS 1.3 the client learns only that the server closed the connection; the agent's
    # log says why: the handshake failed, for want of a certificate / of a known issuer.
    # (The worker's output reaches its log through the runner's pipe reader: wait for it.)
    agent_log = wait("the agent's log of the failed handshakes", lambda: (
        lambda text: text if text.count("Handshake failed") >= handshakes_before + 2
        else None)(pods.log(namespace, worker.metadata.name)), timeout=10)
    assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in agent_log
    assert "CERTIFICATE_VERIFY_FAILED" in agent_log

    # -- a pod with the job's labels and owner that the operator did not create: no call
    job_uid = get(custom, namespace, "tls")["metadata"]["uid"]
    core.create_namespaced_pod(namespace, _process_pod(
        "tls-worker-99", IMPOSTOR, ["$(POD_IP)", "/tls"],
        labels={"dynatrain.io/job": "tls", "dynatrain.io/device": "99"},
        volumes={"/tls": "tls-agent-tls"},
        owner={"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob", "name": "tls",
               "uid": job_uid, "controller": True}))
    wait("the impostor to serve", lambda: "serving" in pods.log(namespace, "tls-worker-99"),
         timeout=60)
    untrusted = wait("the operator's UntrustedPod Event", lambda: [
        e for e in events(core, namespace, "tls") if e.reason == "UntrustedPod"], timeout=30)
    assert "tls-worker-99" in untrusted[0].message and len(untrusted) == 1
    time.sleep(3)                               # ten operator passes
    impostor = core.read_namespaced_pod("tls-worker-99", namespace)
    assert _lines(pods, namespace, "tls-worker-99") == []       # nothing reached it
    assert impostor.metadata.uid not in get(custom, namespace, "tls")["status"]["workerUIDs"]
    # ... though a call would have been recorded (the recorder works):
    with agent_client(core, namespace, "tls", impostor) as c:
        with pytest.raises(Exception):
            c.status()
    # The pod's output reaches its log through the runner's pipe reader, as a container
    # runtime's does: a moment after the call.
    wait("the impostor's record of the call", lambda: _lines(pods, namespace, "tls-worker-99"),
         timeout=10)
    assert [r["method"] for r in _lines(pods, namespace, "tls-worker-99")] == [
        "/dynatrain.agent.v1.Agent/Status"]
    assert "did not create it" in op.logs()

    # -- rotation: both leaves renewed in the Secrets, the renewed one served by the running
    # agent, and the job trains on past the expiry of the first certificates
    wait("the certificates to be renewed", lambda: (lambda d: _serial(d["client.crt"]) !=
                                                   _serial(first["client.crt"])
                                                   and _serial(d["serving.crt"]) !=
                                                   _serial(first["serving.crt"]))(
        pki.secret_bytes(core.read_namespaced_secret("tls-agent-pki", namespace).data)),
        timeout=LIFETIME_S + 30)
    mounted = pods.workdir / namespace / worker.metadata.name / "volumes" / tls_volume.name
    wait("the renewed certificate in the worker's volume", lambda: _serial(
        (mounted / "tls.crt").read_bytes()) != _serial(served0["tls.crt"]), timeout=30)
    now = pki.secret_bytes(core.read_namespaced_secret("tls-agent-pki", namespace).data)
    served = wait("the agent to serve a renewed certificate", lambda: (
        lambda c: c if c.serial_number != _serial(served0["tls.crt"]) else None)(
        _served_cert(worker.status.pod_ip, server_name, now, tmp_path)), timeout=30)
    served.verify_directly_issued_by(x509.load_pem_x509_certificate(now["serving-ca.crt"]))
    expiry = x509.load_pem_x509_certificate(first["client.crt"]).not_valid_after_utc
    left = (expiry - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    time.sleep(max(0.0, left) + 2)              # the first certificates are dead now
    step = get(custom, namespace, "tls")["status"]["step"]
    after = wait("the job to train on with the renewed certificates", lambda: (
        lambda s: s if s["step"] > step else None)(get(custom, namespace, "tls")["status"]),
        timeout=30)
    assert after["phase"] == "Running" and after["workers"] == 1
    assert after.get("replacedWorkers", 0) == 0
    reasons = [e.reason for e in events(core, namespace, "tls")]
    assert "CertificatesRenewed" in reasons and "WorkerLost" not in reasons, reasons
    assert "TLS credentials changed" in op.logs()
    kubectl("delete", "dynatrainjob", "tls", "issued", "-n", namespace, "--wait=false")

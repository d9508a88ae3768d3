"""The operator's per-job PKI (operator/pki.py): what it issues, when it renews, how it rolls
a CA over, what it stores, and that its certificates make a real gRPC mutual-TLS handshake
succeed where they should and fail where they must not (a worker's serving certificate used as
a client certificate)."""

from __future__ import annotations

import datetime
from concurrent import futures

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dynatrain.operator import pki

T0 = datetime.datetime(2030, 1, 1, tzinfo=datetime.timezone.utc)
BODY = {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
        "metadata": {"name": "gpt", "namespace": "team", "uid": "u-1"}}


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def cert(pair: pki.KeyPair) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pair.cert)


def usages(c: x509.Certificate) -> list:
    return list(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def dns(c: x509.Certificate) -> list[str]:
    return c.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)


def test_a_new_job_gets_two_cas_and_leaves_of_the_contract():
    p, changes = pki.advance(None, job="gpt", namespace="team", now=T0, lifetime_s=3600)
    assert changes and len(p.client_cas) == len(p.serving_cas) == 1
    client, serving = cert(p.client), cert(p.serving)
    client_ca, serving_ca = cert(p.client_cas[0]), cert(p.serving_cas[0])
    assert client_ca.subject != serving_ca.subject
    client.verify_directly_issued_by(client_ca)
    serving.verify_directly_issued_by(serving_ca)
    with pytest.raises(Exception):           # each leaf chains to its own CA only
        serving.verify_directly_issued_by(client_ca)
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == \
        "dynatrain-operator"
    assert dns(client) == ["dynatrain-operator"]
    assert usages(client) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert dns(serving) == ["*.gpt-workers.team.svc", "*.gpt-workers.team.svc.cluster.local"]
    assert usages(serving) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert client_ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # a leaf lives its lifetime (notBefore backdated a little for skewed clocks), a CA a year
    assert client.not_valid_after_utc == at(3600)
    assert client_ca.not_valid_after_utc == at(pki.CA_LIFETIME_S)
    assert pki.server_name("gpt-worker-3", "gpt", "team") == "gpt-worker-3.gpt-workers.team.svc"


def test_needs_renewal_when_less_than_a_third_of_the_lifetime_is_left():
    p, _ = pki.advance(None, job="gpt", namespace="team", now=T0, lifetime_s=3000)
    c = cert(p.client)
    total = (c.not_valid_after_utc - c.not_valid_before_utc).total_seconds()
    two_thirds = c.not_valid_before_utc + datetime.timedelta(seconds=total * 2 / 3)
    assert not pki.needs_renewal(p.client.cert, two_thirds - datetime.timedelta(seconds=1))
    assert pki.needs_renewal(p.client.cert, two_thirds + datetime.timedelta(seconds=1))
    assert pki.needs_renewal(p.client.cert, at(10_000))          # expired
    assert pki.next_change(p) == pki.renewal_time(p.client.cert)


def test_leaves_renew_from_the_same_cas_and_nothing_changes_before():
    p, _ = pki.advance(None, job="gpt", namespace="team", now=T0, lifetime_s=300)
    same, changes = pki.advance(p, job="gpt", namespace="team", now=at(150), lifetime_s=300)
    assert changes == [] and same == p
    later = pki.next_change(p) + datetime.timedelta(seconds=1)
    q, changes = pki.advance(p, job="gpt", namespace="team", now=later, lifetime_s=300)
    assert set(changes) == {"issued the operator's client certificate",
                            "issued the workers' serving certificate"}
    assert q.client_cas == p.client_cas and q.serving_cas == p.serving_cas
    assert q.client.cert != p.client.cert and q.serving.key != p.serving.key
    cert(q.client).verify_directly_issued_by(cert(p.client_cas[0]))
    assert not pki.needs_renewal(q.client.cert, later)


def test_a_ca_is_rolled_over_trusted_first_signing_later_then_dropped():
    life = 3600.0
    p, _ = pki.advance(None, job="gpt", namespace="team", now=T0, lifetime_s=life)
    old = p.client_cas[0]
    roll = pki.renewal_time(old.cert) + datetime.timedelta(seconds=1)
    q, changes = pki.advance(p, job="gpt", namespace="team", now=roll, lifetime_s=life)
    assert "new dynatrain gpt client CA" in changes
    assert len(q.client_cas) == 2 and q.client_cas[1] == old
    # both trusted at once, but the leaves still come from the old CA until every worker
    # has the new one
    assert q.client_ca_bundle == q.client_cas[0].cert + old.cert
    cert(q.client).verify_directly_issued_by(cert(old))
    assert pki.next_change(q) <= roll + datetime.timedelta(seconds=pki.PROPAGATION_S)
    r, changes = pki.advance(q, job="gpt", namespace="team",
                             now=roll + datetime.timedelta(seconds=pki.PROPAGATION_S + 60),
                             lifetime_s=life)
    assert "issued the operator's client certificate" in changes
    cert(r.client).verify_directly_issued_by(cert(q.client_cas[0]))
    cert(r.serving).verify_directly_issued_by(cert(r.serving_cas[0]))
    # once the new CA signs, the next change is a renewal, not the (past) propagation point
    assert pki.next_change(r) > roll + datetime.timedelta(seconds=pki.PROPAGATION_S + 60)
    gone = cert(old).not_valid_after_utc + datetime.timedelta(seconds=1)
    s, changes = pki.advance(r, job="gpt", namespace="team", now=gone, lifetime_s=life)
    assert len(s.client_cas) == 1 and s.client_cas[0] == r.client_cas[0]
    assert any(c.startswith("dropped 1 expired") for c in changes)


def test_the_secrets_round_trip_and_bad_ones_are_named():
    p, _ = pki.advance(None, job="gpt", namespace="team", now=T0, lifetime_s=600)
    stored = pki.pki_secret(BODY, p)
    assert stored["metadata"]["name"] == "gpt-agent-pki"
    assert stored["metadata"]["labels"] == {"dynatrain.io/job": "gpt"}
    assert stored["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    data = pki.secret_bytes(stored["data"])
    assert pki.from_secret(data, "team/gpt-agent-pki") == p
    worker = pki.tls_secret(BODY, p)
    assert worker["metadata"]["name"] == "gpt-agent-tls"
    assert set(worker["data"]) == {"client-ca.crt", "tls.crt", "tls.key"}   # no CA key
    assert pki.secret_bytes(worker["data"])["client-ca.crt"] == p.client_ca_bundle
    with pytest.raises(pki.PkiError, match="lacks serving-ca.key"):
        pki.from_secret({k: v for k, v in data.items() if k != "serving-ca.key"}, "s")
    with pytest.raises(pki.PkiError, match="client-ca.crt holds 1 certificates but "
                                           "client-ca.key 2 keys"):
        pki.from_secret({**data, "client-ca.key": data["client-ca.key"] * 2}, "s")


def test_durations():
    assert pki.parse_duration("30d") == 30 * 86400
    assert pki.parse_duration("90") == 90 and pki.parse_duration("1.5h") == 5400
    for bad in ("soon", "5", "-3m", "2w"):
        with pytest.raises(ValueError, match=repr(bad)):
            pki.parse_duration(bad)


def test_cert_manager_certificates():
    import yaml

    from dynatrain.spec.job import JobError, job_from_manifest

    from pathlib import Path

    doc = yaml.safe_load((Path(__file__).parents[2] / "examples" / "dynatrainjob.yaml")
                         .read_text())
    doc["spec"].setdefault("agent", {})["issuerRef"] = {"name": "team-ca"}
    ref = job_from_manifest(doc).issuer_ref       # the parser fills in the CRD's defaults
    assert ref == {"name": "team-ca", "kind": "Issuer", "group": "cert-manager.io"}
    doc["spec"]["agent"]["issuerRef"] = {"name": "x", "kind": "Vault", "url": "y"}
    with pytest.raises(JobError, match=r"spec.agent.issuerRef.kind='Vault' is not one of "
                                       r"Issuer, ClusterIssuer.*unknown field\(s\) url|"
                                       r"unknown field\(s\) url.*spec.agent.issuerRef.kind"):
        job_from_manifest(doc)
    serving, client = pki.certificates(BODY, ref, lifetime_s=60)
    for c in (serving, client):
        assert c["apiVersion"] == "cert-manager.io/v1" and c["kind"] == "Certificate"
        assert c["metadata"]["ownerReferences"][0]["uid"] == "u-1"
        assert c["spec"]["issuerRef"] == ref
        assert c["spec"]["duration"] == "3600s"        # cert-manager's minimum
        assert c["spec"]["renewBefore"] == "1200s"
        assert c["spec"]["secretName"] == c["metadata"]["name"]
        assert c["spec"]["secretTemplate"]["labels"] == {"dynatrain.io/job": "gpt"}
    assert serving["spec"]["secretName"] == "gpt-agent-tls"
    assert serving["spec"]["dnsNames"] == pki.serving_dns_names("gpt", "team")
    assert "server auth" in serving["spec"]["usages"]
    assert "client auth" not in serving["spec"]["usages"]
    assert client["spec"]["secretName"] == "gpt-agent-client"
    assert client["spec"]["commonName"] == "dynatrain-operator"
    assert client["spec"]["usages"] == ["client auth", "digital signature"]
    assert pki.certificates(BODY, ref, lifetime_s=7200)[0]["spec"]["duration"] == "7200s"


def _health_server(p: pki.JobPki) -> tuple[grpc.Server, int]:
    """A gRPC server as a worker's agent serves: the serving certificate, and a client
    certificate signed by the client CA required."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    creds = grpc.ssl_server_credentials([(p.serving.key, p.serving.cert)],
                                        root_certificates=p.client_ca_bundle,
                                        require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    return server, port


def _check(port: int, ca: bytes, pair: pki.KeyPair, name: str) -> grpc.StatusCode:
    creds = grpc.ssl_channel_credentials(ca, pair.key, pair.cert)
    with grpc.secure_channel(f"127.0.0.1:{port}", creds,
                             [("grpc.ssl_target_name_override", name)]) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def test_the_certificates_make_mutual_tls_work_and_a_serving_cert_cannot_call():
    now = datetime.datetime.now(datetime.timezone.utc)
    p, _ = pki.advance(None, job="gpt", namespace="team", now=now, lifetime_s=600)
    server, port = _health_server(p)
    try:
        name = pki.server_name("gpt-worker-0", "gpt", "team")
        assert _check(port, p.serving_ca_bundle, p.client, name) == grpc.StatusCode.OK
        # a worker's own serving certificate is no client certificate here: another CA
        assert _check(port, p.serving_ca_bundle, p.serving, name) == \
            grpc.StatusCode.UNAVAILABLE
        # another job's operator certificate is refused too
        other, _ = pki.advance(None, job="gpt", namespace="team", now=now, lifetime_s=600)
        assert _check(port, p.serving_ca_bundle, other.client, name) == \
            grpc.StatusCode.UNAVAILABLE
        # a name outside the job's Service does not match the serving certificate
        assert _check(port, p.serving_ca_bundle, p.client,
                      "gpt-worker-0.other-workers.team.svc") == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


def test_the_worker_pod_mounts_the_tls_secret_and_probes_the_health_port():
    from dynatrain.operator import cluster

    body = {**BODY, "spec": {"image": "dynatrain:1", "agent": {"port": 50051}}}
    for items, want in ((None, "client-ca.crt"), (pki.CERT_MANAGER_TLS_ITEMS, "ca.crt")):
        pod = cluster.worker_pod(body, 0, secret="gpt-agent-token", agent_port=50051,
                                 tls_items=items)
        c = pod["spec"]["containers"][0]
        assert c["args"][c["args"].index("--tls-dir") + 1] == cluster.TLS_DIR == cluster.TLS_DIR
        assert c["args"][c["args"].index("--health-port") + 1] == "9401"
        assert c["readinessProbe"]["grpc"]["port"] == cluster.HEALTH_PORT == 9401
        assert {"name": "health", "containerPort": 9401} in c["ports"]
        assert {"name": "tls", "mountPath": cluster.TLS_DIR, "readOnly": True} in c["volumeMounts"]
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "tls")
        assert volume["secret"]["secretName"] == "gpt-agent-tls"
        # a cert-manager Secret's ca.crt (the Issuer's CA) is what the worker trusts
        assert {"key": want, "path": "client-ca.crt"} in volume["secret"]["items"]


def test_the_operator_refuses_a_bad_cert_lifetime_naming_it():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dynatrain", "operator", "--cert-lifetime",
                          "soon"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--cert-lifetime: 'soon' is not a duration" in out.stderr, out.stderr

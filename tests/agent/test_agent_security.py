"""The agent's defences: request bounds, the rendezvous rule, call slots and the health port,
mutual TLS from a reloadable directory with the caller's name checked, and the worker's
checks that come before a Prepare abandons anything.

The fast tests run the agent's real gRPC server in this process on loopback, over a small
:class:`GateControl` (the ``Control`` protocol with a Commit that waits for a gate); the live
test (marked slow) starts a real worker process with ``--tls-dir`` and ``--health-port`` and
trains it while it is attacked. Certificates are made here with ``cryptography``, shaped like
the operator's per-job PKI: a client CA that signs only the operator's certificate, a serving
CA that signs the workers' certificate.
"""

from __future__ import annotations

import datetime
import os
import secrets
import signal
import socket
import ssl
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dynatrain.agent.auth import (AuthConfigError, ClientTls, ServerTlsDir, TlsFiles,
                                  bearer_metadata, client_name_problem)
from dynatrain.agent.client import AgentCallError, AgentClient
from dynatrain.agent.server import (ANSWER_CODES, DEFAULT_COMMIT_TIMEOUT_S,
                                    MAX_DEVICES_PER_NODE, MAX_MESSAGE_BYTES,
                                    MAX_STAGING_BYTES, MAX_TEXT, MAX_TIMEOUT_S, MAX_WORLD,
                                    InvalidRequest, PreconditionFailed, check_abort,
                                    check_checkpoint, check_commit, check_prepare, check_rendezvous,
                                    check_rendezvous_owner, peer_host, serve)
from dynatrain.agent.v1 import agent_pb2
from dynatrain.bench.fuzz import spawn_worker
from dynatrain.controller.rendezvous import RendezvousServer
from dynatrain.ports import free_port as _free_port

from test_worker_live import _wait_steps

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "agent-security-token"
Code = grpc.StatusCode
SERVER_NAME = "job-0.job-workers.ns.svc"


# ----------------------------------------------------------------------------------------------
# Certificates


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class CA:
    """A throw-away CA that signs leaf certificates (EC P-256, one day)."""

    def __init__(self, name: str):
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = self._build(_name(name), self.key.public_key(), ca=True).sign(
            self.key, hashes.SHA256())
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def _build(self, subject, public_key, *, ca: bool, issuer=None):
        now = datetime.datetime.now(datetime.UTC)
        b = (x509.CertificateBuilder().subject_name(subject)
             .issuer_name(issuer or subject).public_key(public_key)
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            b = b.add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        return b

    def leaf(self, cn: str, *, server: bool, dns: tuple[str, ...] = ()):
        """(cert PEM, key PEM, serial) of a client (clientAuth) or serving (serverAuth) leaf."""
        key = ec.generate_private_key(ec.SECP256R1())
        b = self._build(_name(cn), key.public_key(), ca=False, issuer=self.cert.subject)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if dns:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]),
                                critical=False)
        cert = b.sign(self.key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key), cert.serial_number


@pytest.fixture(scope="module")
def pki():
    client_ca, serving_ca, other_ca = CA("client-ca"), CA("serving-ca"), CA("other-ca")
    return {
        "client_ca": client_ca, "serving_ca": serving_ca,
        "operator": client_ca.leaf("dynatrain-operator", server=False,
                                   dns=("dynatrain-operator",)),
        "intruder": client_ca.leaf("someone-else", server=False, dns=("someone-else",)),
        "foreign": other_ca.leaf("dynatrain-operator", server=False,
                                 dns=("dynatrain-operator",)),
    }


def write_tls_dir(directory: Path, pki, *, cert=None) -> int:
    """Write ``tls.crt``/``tls.key``/``client-ca.crt`` as the operator's Secret holds them;
    a new serving certificate (signed by the same serving CA) unless ``cert`` is given.
    Returns the serving certificate's serial."""
    directory.mkdir(exist_ok=True)
    crt, key, serial = cert or pki["serving_ca"].leaf(
        "job-0", server=True, dns=(SERVER_NAME, "*.job-workers.ns.svc"))
    # Each file is replaced atomically (a Secret update swaps them all at once).
    for name, data in (("tls.crt", crt), ("tls.key", key),
                       ("client-ca.crt", pki["client_ca"].pem)):
        tmp = directory / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, directory / name)
    return serial


def client_tls(pki, who: str = "operator") -> ClientTls:
    crt, key, _ = pki[who]
    return ClientTls(ca=pki["serving_ca"].pem, cert=crt, key=key, server_name=SERVER_NAME)


def served_serial(address: str, pki, tmp: Path) -> int:
    """The serial of the certificate a NEW TLS connection to ``address`` is served with."""
    host, port = address.rsplit(":", 1)
    crt, key, _ = pki["operator"]
    (tmp / "operator.crt").write_bytes(crt)
    (tmp / "operator.key").write_bytes(key)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=pki["serving_ca"].pem.decode())
    ctx.load_cert_chain(tmp / "operator.crt", tmp / "operator.key")
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=SERVER_NAME) as conn:
            der = conn.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


# ----------------------------------------------------------------------------------------------
# A control whose Commit waits for a gate


class GateControl:
    """The ``Control`` protocol, enough for the server's tests: Prepare records, Commit waits
    until :attr:`gate` is set (or its timeout), Status answers at once."""

    def __init__(self):
        self.gate = threading.Event()
        self.prepared: list[tuple] = []
        self.waiting = 0
        self._lock = threading.Lock()

    def prepare(self, args):
        self.prepared.append((args.generation, args.rendezvous))

    def commit(self, generation, at_step, timeout_s):
        with self._lock:
            self.waiting += 1
        try:
            if not self.gate.wait(timeout_s):
                raise PreconditionFailed("the gate stayed shut")
            return agent_pb2.CommitResponse(generation=generation)
        finally:
            with self._lock:
                self.waiting -= 1

    def abort(self, generation, reason):
        return False

    def write_checkpoint(self, generation, stop, timeout_s):
        raise AssertionError("not called")

    def status(self, since_step):
        return agent_pb2.StatusResponse(state=agent_pb2.StatusResponse.TRAINING)


@pytest.fixture
def control():
    c = GateControl()
    yield c
    c.gate.set()


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    return path


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(AgentCallError) as info:
        call()
    return info.value.code, info.value.details


def _health(address: str, credentials=None, options=()) -> int:
    channel = (grpc.secure_channel(address, credentials, options) if credentials is not None
               else grpc.insecure_channel(address))
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5).status


# ----------------------------------------------------------------------------------------------
# Request checks (no server)


GOOD = dict(generation=1, layout="dp=2", devices=[0, 1], rendezvous="127.0.0.1:29500")


@pytest.mark.parametrize("change, needle", [
    (dict(timeout_seconds=MAX_TIMEOUT_S + 1), "MAX_TIMEOUT_S"),
    (dict(staging_bytes=MAX_STAGING_BYTES + 1), "staging_bytes"),
    (dict(devices_per_node=MAX_DEVICES_PER_NODE + 1), "devices_per_node"),
    (dict(devices=list(range(MAX_WORLD + 1))), "devices has 65537 entries"),
    (dict(old_devices=list(range(MAX_WORLD + 1))), "old_devices has 65537 entries"),
    (dict(failed_devices=list(range(MAX_WORLD + 1))), "failed_devices has 65537"),
    (dict(proxies={i: i for i in range(MAX_WORLD + 1)}), "proxies has 65537"),
    (dict(reason="r" * (MAX_TEXT + 1)), "reason has 4097 characters"),
    (dict(layout="dp=1," * 1000), "layout has 5000 characters"),
    (dict(old_layout="x" * (MAX_TEXT + 1)), "old_layout has 4097"),
    (dict(checkpoint="/c" * MAX_TEXT), "checkpoint has 8192"),
    (dict(rendezvous="a" * MAX_TEXT + ":1"), "rendezvous has 4098"),
])
def test_prepare_bounds_are_named(change, needle):
    with pytest.raises(InvalidRequest) as info:
        check_prepare(agent_pb2.PrepareRequest(**{**GOOD, **change}))
    assert needle in info.value.message
    assert len(info.value.message) < 400      # the limit and the size, not the value


def test_commit_and_abort_bounds():
    with pytest.raises(InvalidRequest, match="MAX_TIMEOUT_S"):
        check_commit(agent_pb2.CommitRequest(generation=1, timeout_seconds=MAX_TIMEOUT_S * 2))
    assert check_commit(agent_pb2.CommitRequest(generation=1,
                                                timeout_seconds=MAX_TIMEOUT_S))[2] == 3600
    with pytest.raises(InvalidRequest, match="MAX_TIMEOUT_S"):
        check_checkpoint(agent_pb2.CheckpointRequest(generation=1, timeout_seconds=-1))
    with pytest.raises(InvalidRequest, match="generation=0 is invalid"):
        check_checkpoint(agent_pb2.CheckpointRequest(generation=0))
    assert check_checkpoint(agent_pb2.CheckpointRequest(generation=3, stop=True)) == (
        3, True, DEFAULT_COMMIT_TIMEOUT_S)
    with pytest.raises(InvalidRequest, match="reason has 4097 characters"):
        check_abort(agent_pb2.AbortRequest(generation=1, reason="r" * (MAX_TEXT + 1)))


def test_checks_are_linear_and_their_messages_short():
    # A world of MAX_WORLD devices with every device twice: the old duplicate check
    # (devices.count in a loop) took minutes here; a linear one takes milliseconds.
    half = MAX_WORLD // 2
    devices = list(range(half)) * 2
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequest) as info:
        check_prepare(agent_pb2.PrepareRequest(
            generation=1, layout=f"dp={MAX_WORLD}", devices=devices,
            rendezvous="127.0.0.1:1", recover=True, old_layout=f"dp={MAX_WORLD}",
            old_devices=devices, failed_devices=list(range(half, MAX_WORLD)),
            proxies={i: i + 1 for i in range(half, MAX_WORLD)}))
    # Linear: milliseconds, even on a loaded machine; the quadratic check took minutes.
    assert time.perf_counter() - t0 < 20.0
    assert "repeats" in info.value.message and len(info.value.message) < 3000
    # At the bound, a valid request passes.
    args = check_prepare(agent_pb2.PrepareRequest(
        generation=1, layout=f"dp={MAX_WORLD}", devices=list(range(MAX_WORLD)),
        rendezvous="127.0.0.1:1"))
    assert len(args.devices) == MAX_WORLD


@pytest.mark.parametrize("text, ok", [
    ("worker-0:29500", True), ("w.job-workers.ns.svc:1", True), ("[::1]:2", True),
    ("a_b:1", False), ("[worker]:1", False), ("-x:1", False), ("host:０１", False),
    ("a" * 64 + ":1", False),
])
def test_rendezvous_hosts_are_ip_addresses_or_dns_names(text, ok):
    assert (check_rendezvous(text) is None) == ok, check_rendezvous(text)


def test_rendezvous_owner():
    assert peer_host("ipv4:10.1.2.3:5555") == "10.1.2.3"
    assert peer_host("ipv6:[fd00::7]:5555") == "fd00::7"
    ok = check_rendezvous_owner
    assert ok("127.0.0.1:29500", "ipv4:127.0.0.1:40000") is None
    assert ok("[::1]:29500", "ipv6:[::1]:40000") is None
    assert ok("10.0.0.5:1", "ipv6:[::ffff:10.0.0.5]:2") is None          # v4-mapped peer
    assert ok("localhost:29500", "ipv4:127.0.0.1:40000") is None         # resolved
    why = ok("10.9.9.9:29500", "ipv4:10.0.0.5:40000")
    assert "'10.9.9.9:29500'" in why and "'10.0.0.5'" in why and "--allow-rendezvous" in why
    why = ok("no-such-host.invalid:29500", "ipv4:10.0.0.5:1")
    assert "does not resolve" in why
    # --allow-rendezvous: as written, or as an address.
    assert ok("store.mesh:29500", "ipv4:10.0.0.5:1", ["store.mesh"]) is None
    assert ok("10.9.9.9:29500", "ipv4:10.0.0.5:1", ["10.9.9.9"]) is None
    assert ok("10.9.9.8:29500", "ipv4:10.0.0.5:1", ["10.9.9.9"]) is not None


def test_client_name_problem_names_both():
    assert client_name_problem({"x509_common_name": [b"dynatrain-operator"]},
                               "dynatrain-operator") is None
    assert client_name_problem({"x509_common_name": [b"x"],
                                "x509_subject_alternative_name": [b"dynatrain-operator"]},
                               "dynatrain-operator") is None
    why = client_name_problem({"x509_common_name": [b"mallory"]}, "dynatrain-operator")
    assert "'mallory'" in why and "'dynatrain-operator'" in why
    why = client_name_problem({"transport_security_type": [b"insecure"]}, "op")
    assert "no client certificate" in why and "'op'" in why


def test_answer_codes_are_the_documented_set():
    import dynatrain.agent.server as server
    for code in ANSWER_CODES:
        assert code.name in server.__doc__
    assert Code.INTERNAL not in ANSWER_CODES and Code.UNKNOWN not in ANSWER_CODES
    proto = (ROOT / "agent/proto/dynatrain/agent/v1/agent.proto").read_text()
    header = proto[:proto.index("syntax")]
    assert {c.name for c in ANSWER_CODES} <= set(header.replace("//", " ").split())


# ----------------------------------------------------------------------------------------------
# The server: message size, rendezvous, slots and the health port


def test_oversized_and_over_bound_device_lists(control, token_file):
    with serve(control, token_file=token_file) as server, \
            AgentClient(server.address, token=TOKEN, timeout_s=5) as client:
        # 4 MB of devices: gRPC refuses the message before it is parsed (at once: the
        # client's 5 s deadline would end a wait as DEADLINE_EXCEEDED instead).
        code, details = _code(lambda: client.prepare(1, "dp=1", [2**31] * 800_000,
                                                     "127.0.0.1:1"))
        assert code == Code.RESOURCE_EXHAUSTED
        assert str(MAX_MESSAGE_BYTES) in details
        # Over MAX_WORLD, under 1 MiB: the agent names the field and the limit.
        code, details = _code(lambda: client.prepare(1, "dp=1", range(MAX_WORLD + 1),
                                                     "127.0.0.1:1"))
        assert code == Code.INVALID_ARGUMENT
        assert "devices has 65537 entries" in details and "65536 (MAX_WORLD)" in details
        assert control.prepared == []


def test_rendezvous_must_be_the_callers_own(control, token_file):
    with serve(control, token_file=token_file, allow_rendezvous=["store.mesh"]) as server, \
            AgentClient(server.address, token=TOKEN, timeout_s=5) as client:
        code, details = _code(lambda: client.prepare(1, "dp=1", [0], "10.9.9.9:29500"))
        assert code == Code.PERMISSION_DENIED
        assert "'10.9.9.9:29500'" in details and "'127.0.0.1'" in details
        assert control.prepared == []
        client.prepare(1, "dp=1", [0], "127.0.0.1:29500")
        client.prepare(2, "dp=1", [0], "store.mesh:29500")
        assert control.prepared == [(1, "127.0.0.1:29500"), (2, "store.mesh:29500")]


def test_full_slots_refuse_at_once_and_health_still_answers(control, token_file):
    health_port = _free_port()
    server = serve(control, token_file=token_file, max_workers=3, health_port=health_port)
    client = AgentClient(server.address, token=TOKEN, timeout_s=5)
    results = []
    commits = [threading.Thread(target=lambda: results.append(client.commit(1, timeout_s=60)))
               for _ in range(3)]
    try:
        for t in commits:
            t.start()
        deadline = time.monotonic() + 10
        while control.waiting < 3:
            assert time.monotonic() < deadline, "the Commits did not all start"
            time.sleep(0.01)
        # Every slot holds a Commit: another Agent call is refused at once, naming the count
        # (a call that waited for a slot would wait for a Commit's 60 s and end at the
        # client's 5 s deadline as DEADLINE_EXCEEDED).
        code, details = _code(client.status)
        assert code == Code.RESOURCE_EXHAUSTED and "3 agent calls are in flight" in details
        # ...while health answers on both ports, the separate one in plaintext.
        serving = health_pb2.HealthCheckResponse.SERVING
        for _ in range(20):
            assert _health(server.address) == serving
            assert _health(server.health_address) == serving
        # The health port serves health alone.
        with grpc.insecure_channel(server.health_address) as ch:
            with pytest.raises(grpc.RpcError) as info:
                ch.unary_unary("/dynatrain.agent.v1.Agent/Status")(
                    b"", metadata=bearer_metadata(TOKEN), timeout=5)
            assert info.value.code() == Code.UNIMPLEMENTED
        control.gate.set()
        for t in commits:
            t.join(10)
        assert len(results) == 3
        assert client.status().state == agent_pb2.StatusResponse.TRAINING  # slots are back
    finally:
        control.gate.set()
        client.close()
        server.stop(0)


def test_health_watch_is_not_served(control):
    with serve(control, insecure=True) as server, \
            grpc.insecure_channel(server.address) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            next(stream)
        assert info.value.code() == Code.UNIMPLEMENTED


# ----------------------------------------------------------------------------------------------
# Mutual TLS from a directory


def test_tls_dir_client_checks_and_rotation(pki, control, token_file, tmp_path):
    tls_dir = tmp_path / "tls"
    first = write_tls_dir(tls_dir, pki)
    server = serve(control, token_file=token_file, tls_dir=tls_dir,
                   client_name="dynatrain-operator")
    try:
        # The operator, in memory, with a token that rotates (the callable is asked per call).
        tokens = iter([TOKEN, "rotated-away", TOKEN])
        with AgentClient(server.address, token=lambda: next(tokens),
                         tls=client_tls(pki), timeout_s=5) as op:
            assert op.status().state == agent_pb2.StatusResponse.TRAINING
            assert _code(op.status)[0] == Code.UNAUTHENTICATED
            assert op.status().state == agent_pb2.StatusResponse.TRAINING
        # No client certificate, though with the token: the handshake fails.
        with AgentClient(server.address, token=TOKEN, timeout_s=3,
                         tls=TlsFiles(ca=_file(tmp_path, "sca", pki["serving_ca"].pem),
                                      server_name=SERVER_NAME)) as anon:
            assert _code(anon.status)[0] == Code.UNAVAILABLE
        # A certificate of another CA, named right: the handshake fails.
        with AgentClient(server.address, token=TOKEN, timeout_s=3,
                         tls=client_tls(pki, "foreign")) as foreign:
            assert _code(foreign.status)[0] == Code.UNAVAILABLE
        # The client CA's certificate of someone else: PERMISSION_DENIED naming both names.
        with AgentClient(server.address, token=TOKEN, timeout_s=5,
                         tls=client_tls(pki, "intruder")) as intruder:
            code, details = _code(intruder.status)
            assert code == Code.PERMISSION_DENIED
            assert "'someone-else'" in details and "'dynatrain-operator'" in details
            assert _health(server.address, _creds(pki, "intruder"), _override()) == 1
        # Rotation: new files, signed by the same CA, reach new connections.
        assert served_serial(server.address, pki, tmp_path) == first
        second = write_tls_dir(tls_dir, pki)
        assert served_serial(server.address, pki, tmp_path) == second != first
        # A half-written rotation (a key that does not match) keeps the last good pair.
        third_crt, _, third = pki["serving_ca"].leaf("job-0", server=True, dns=(SERVER_NAME,))
        (tls_dir / "tls.crt").write_bytes(third_crt)
        assert served_serial(server.address, pki, tmp_path) == second
        with AgentClient(server.address, token=TOKEN, tls=client_tls(pki), timeout_s=5) as op:
            assert op.status().state == agent_pb2.StatusResponse.TRAINING
        assert server.tls_dir.reloads == 1
    finally:
        server.stop(0)


def test_tls_dir_errors_name_the_file(tmp_path, pki, control):
    with pytest.raises(AuthConfigError, match="does not exist"):
        ServerTlsDir(tmp_path / "nope")
    (tmp_path / "d").mkdir()
    with pytest.raises(AuthConfigError, match="tls.crt"):
        ServerTlsDir(tmp_path / "d")
    write_tls_dir(tmp_path / "d", pki)
    crt, _, _ = pki["serving_ca"].leaf("x", server=True)
    (tmp_path / "d" / "tls.crt").write_bytes(crt)
    with pytest.raises(AuthConfigError, match="tls.key .* is not the key of tls.crt"):
        ServerTlsDir(tmp_path / "d")
    with pytest.raises(ValueError, match="needs mutual TLS"):
        serve(control, insecure=True, client_name="dynatrain-operator")
    with pytest.raises(AuthConfigError, match="ClientTls.cert must be PEM"):
        ClientTls(ca=pki["serving_ca"].pem, cert=b"nope", key=b"-----BEGIN")


def _file(tmp: Path, name: str, data: bytes) -> Path:
    (tmp / name).write_bytes(data)
    return tmp / name


def _creds(pki, who: str) -> grpc.ChannelCredentials:
    crt, key, _ = pki[who]
    return grpc.ssl_channel_credentials(pki["serving_ca"].pem, key, crt)


def _override():
    return [("grpc.ssl_target_name_override", SERVER_NAME)]


# ----------------------------------------------------------------------------------------------
# A real worker process, attacked while it trains


@pytest.mark.slow
def test_live_workers_over_mutual_tls(pki, tmp_path):
    from dynatrain.controller.orchestrator import switch
    from dynatrain.vps.layout import parse_layout

    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["training"]["steps"] = 100000
    doc["spec"]["globalBatchSize"] = 4
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(16))
    tls_dir = tmp_path / "tls"
    first = write_tls_dir(tls_dir, pki)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "source").mkdir()
    store = RendezvousServer("127.0.0.1")       # the controller's store, as the runner hosts it
    rdv = store.address
    procs, ops = [], {}
    try:
        for device in (0, 1):
            health_port = _free_port()
            proc, info = spawn_worker(
                tmp_path, job, token, device, extra=(
                    "--tls-dir", str(tls_dir), "--health-port", str(health_port),
                    "--checkpoint-dir", str(tmp_path / "ckpt"),
                    "--checkpoint-source", str(tmp_path / "source")))
            procs.append(proc)
            assert info["health_port"] == health_port
            ops[device] = AgentClient(f"127.0.0.1:{info['agent_port']}",
                                      token=lambda: token.read_text(), tls=client_tls(pki))
            # The health port answers in plaintext; the main port needs TLS.
            assert _health(f"127.0.0.1:{health_port}") == \
                health_pb2.HealthCheckResponse.SERVING
        op, address = ops[0], ops[0].address
        with AgentClient(address, timeout_s=3) as plain:
            assert not plain.health()
            assert _code(plain.status)[0] == Code.UNAVAILABLE
        for c in ops.values():
            c.wait_healthy(30)
        two = parse_layout("dp=2").with_devices([0, 1])
        switch(ops, 1, None, two, rdv, reason="start")
        _wait_steps(op, 2)

        def still_training():
            for device, c in ops.items():
                before = c.status()
                _wait_steps(c, 2)
                st = c.status(since_step=before.step)
                assert (st.state, st.generation, st.prepared_generation, st.error) == (
                    agent_pb2.StatusResponse.TRAINING, 1, 0, ""), (device, st)
                assert [r.step for r in st.steps] == list(range(before.step + 1,
                                                               st.steps[-1].step + 1))
            assert all(p.poll() is None for p in procs)

        # The right token without a client certificate, or with one of another CA: refused
        # in the handshake. The client CA's certificate of someone else: PERMISSION_DENIED.
        for tls in (TlsFiles(ca=_file(tmp_path, "sca", pki["serving_ca"].pem),
                             server_name=SERVER_NAME), client_tls(pki, "foreign")):
            with AgentClient(address, token=token.read_text(), tls=tls, timeout_s=3) as c:
                assert _code(c.status)[0] == Code.UNAVAILABLE
        with AgentClient(address, token=token.read_text(), tls=client_tls(pki, "intruder"),
                         timeout_s=5) as c:
            code, details = _code(lambda: c.prepare(2, "dp=1", [0], rdv))
            assert code == Code.PERMISSION_DENIED and "'someone-else'" in details
        # A foreign rendezvous, a 4 MB device list: refused at once, with named errors.
        code, details = _code(lambda: op.prepare(2, "dp=1", [0], "10.9.9.9:29500"))
        assert code == Code.PERMISSION_DENIED and "'10.9.9.9:29500'" in details
        assert _code(lambda: op.prepare(2, "dp=1", [2**31] * 800_000, rdv))[0] \
            == Code.RESOURCE_EXHAUSTED                # within op's 5 s deadline
        # A checkpoint outside the worker's roots: refused before anything is abandoned.
        outside = tmp_path / "elsewhere" / "step-5"
        code, details = _code(lambda: op.prepare(2, "dp=1", [0], rdv, checkpoint=str(outside)))
        assert code == Code.INVALID_ARGUMENT
        assert str(outside) in details and str(tmp_path / "ckpt") in details
        still_training()
        # A recovery of a stale generation (from a snapshot the device holds), and a
        # checkpoint restart (under a --checkpoint-source) of a stale generation: refused
        # before they abandon the running generation, whose collectives go on.
        held = op.status().snapshot_steps[-1]
        code, details = _code(lambda: op.prepare(1, "dp=1", [0], rdv, old_layout="dp=2",
                                                 old_devices=[0, 1], recover=True,
                                                 failed_devices=[1], restore_step=held))
        assert code == Code.FAILED_PRECONDITION and "stale" in details
        code, details = _code(lambda: op.prepare(1, "dp=1", [0], rdv,
                                                 checkpoint=str(tmp_path / "source" / "s")))
        assert code == Code.FAILED_PRECONDITION and "stale" in details
        still_training()
        # Rotation: the Secret's files change; new connections get the new certificate, the
        # open ones carry on, and training never stops.
        assert served_serial(address, pki, tmp_path) == first
        second = write_tls_dir(tls_dir, pki)
        assert served_serial(address, pki, tmp_path) == second != first
        with AgentClient(address, token=token.read_text(), tls=client_tls(pki)) as fresh:
            assert fresh.status().generation == 1
        still_training()
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(15)
        store.close()


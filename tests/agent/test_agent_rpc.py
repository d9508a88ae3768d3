"""The agent's gRPC layer: authentication, request checks, error codes, stubs.

The training side is replaced by ``StepControl``, a small real implementation of the
``Control`` protocol: a generation counter and a step counter that a thread advances, with a
prepared generation switched in at a step boundary. Everything listens on 127.0.0.1, port 0.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dynatrain.agent import gen
from dynatrain.agent.auth import (
    AuthConfigError,
    TlsFiles,
    TokenFile,
    bearer_metadata,
    channel_credentials,
    token_call_credentials,
)
from dynatrain.agent.client import AgentCallError, AgentClient
from dynatrain.agent.server import (
    AgentError,
    CommitTimeout,
    Control,
    InvalidRequest,
    PreconditionFailed,
    PrepareArgs,
    SwitchAborted,
    check_rendezvous,
    serve,
)
from dynatrain.agent.v1 import agent_pb2, agent_pb2_grpc
from dynatrain.vps.layout import parse_layout

TOKEN = "s3cret-token-value"
Code = grpc.StatusCode


# ----------------------------------------------------------------------------------------------
# A test control: our own Control protocol, implemented with a little state


class StepControl:
    """Trains "steps" in a thread; a committed generation takes effect at a step boundary."""

    def __init__(self, step_s: float = 0.002):
        self.cond = threading.Condition()
        self.generation = 0
        self.layout = "dp=1"
        self.devices: tuple[int, ...] = (0,)
        self.step = 0
        self.prepared = None        # (generation, layout text, devices)
        self.pending = None         # (generation, target step) of a waiting Commit
        self.switched = None        # CommitResponse of the last switch
        self.calls: list[str] = []  # control methods called, in order
        self.fail: BaseException | None = None  # raised by the next call, then cleared
        self.bad_response = False   # status() returns the wrong type
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._train, args=(step_s,), daemon=True)
        self._thread.start()

    def _train(self, step_s):
        while not self._stop.wait(step_s):
            with self.cond:
                self.step += 1
                if self.pending and self.pending[1] == self.step:
                    generation = self.prepared[0]
                    self.generation, self.layout, self.devices = self.prepared
                    self.prepared, self.pending = None, None
                    self.switched = agent_pb2.CommitResponse(
                        generation=generation, step=self.step, pause_seconds=0.001,
                        phase_seconds={"transfer": 0.001}, new_rank=0)
                self.cond.notify_all()

    def close(self):
        self._stop.set()
        self._thread.join()

    def _enter(self, name):
        self.calls.append(name)
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc

    def prepare(self, args):
        self._enter("prepare")
        self.nodes = args.nodes
        generation = args.generation
        with self.cond:
            if generation != self.generation + 1:
                raise PreconditionFailed(f"generation={generation} is stale; the agent is at "
                                         f"{self.generation}, expected {self.generation + 1}")
            if self.prepared is not None:
                raise PreconditionFailed(f"generation {self.prepared[0]} is already prepared")
            self.prepared = (generation, args.layout.to_text(), tuple(args.devices))

    def commit(self, generation, at_step, timeout_s):
        self._enter("commit")
        with self.cond:
            if self.prepared is None or self.prepared[0] != generation:
                raise PreconditionFailed(f"generation {generation} is not prepared")
            target = at_step or self.step + 1
            if target <= self.step:
                raise PreconditionFailed(f"at_step={at_step} has passed (step {self.step})")
            self.pending = (generation, target)
            if not self.cond.wait_for(lambda: self.generation == generation, timeout_s):
                self.pending = None
                raise CommitTimeout(f"no switch within {timeout_s} s")
            return self.switched

    def write_checkpoint(self, generation, stop, timeout_s):
        self._enter("write_checkpoint")
        raise PreconditionFailed("this control writes no checkpoints")

    def abort(self, generation, reason):
        self._enter("abort")
        with self.cond:
            if self.prepared is None or self.prepared[0] != generation or self.pending:
                return False
            self.prepared = None
            return True

    def status(self, since_step):
        self._enter("status")
        if self.bad_response:
            return {"state": "TRAINING"}
        with self.cond:
            return agent_pb2.StatusResponse(
                state=agent_pb2.StatusResponse.TRAINING, generation=self.generation,
                layout=self.layout, devices=self.devices, step=self.step,
                prepared_generation=self.prepared[0] if self.prepared else 0,
                prepared_ready=self.prepared is not None)


def test_step_control_is_a_control():
    control = StepControl()
    try:
        assert isinstance(control, Control)
    finally:
        control.close()


# ----------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture
def control():
    c = StepControl()
    yield c
    c.close()


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")  # Secrets often end in a newline; it is stripped
    return path


@pytest.fixture
def agent(control, token_file):
    server = serve(control, token_file=token_file)
    yield server
    server.stop(0)


@pytest.fixture
def client(agent):
    c = AgentClient(agent.address, token=TOKEN, timeout_s=5)
    yield c
    c.close()


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(AgentCallError) as info:
        call()
    return info.value.code, info.value.details


GOOD_PREPARE = dict(generation=1, layout_text="dp=2,tp=2", devices=[0, 1, 2, 3],
                    rendezvous="127.0.0.1:29500")


# ----------------------------------------------------------------------------------------------
# Authentication


def test_no_token_is_unauthenticated(agent, control):
    with AgentClient(agent.address) as anonymous:
        code, details = _code(anonymous.status)
    assert code == Code.UNAUTHENTICATED
    assert "authorization" in details
    assert control.calls == []


def test_wrong_token_is_unauthenticated_and_not_echoed(agent, control):
    with AgentClient(agent.address, token="not-the-token") as wrong:
        code, details = _code(wrong.status)
        assert code == Code.UNAUTHENTICATED
        assert "wrong bearer token" in details
        assert "not-the-token" not in details and TOKEN not in details
    # Not a Bearer scheme at all.
    channel = grpc.insecure_channel(agent.address)
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary("/dynatrain.agent.v1.Agent/Status")(
            b"", metadata=(("authorization", f"Basic {TOKEN}"),), timeout=5)
    channel.close()
    assert info.value.code() == Code.UNAUTHENTICATED
    assert "Bearer" in info.value.details() and TOKEN not in info.value.details()
    assert control.calls == []


def test_unknown_method_reveals_nothing_without_a_token(agent):
    channel = grpc.insecure_channel(agent.address)
    try:
        call = channel.unary_unary("/dynatrain.agent.v1.Agent/Reboot")
        with pytest.raises(grpc.RpcError) as info:
            call(b"", timeout=5)
        assert info.value.code() == Code.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            call(b"", metadata=bearer_metadata(TOKEN), timeout=5)
        assert info.value.code() == Code.UNIMPLEMENTED
    finally:
        channel.close()


def test_right_token_runs_a_switch(client, control):
    assert client.prepare(**GOOD_PREPARE).generation == 1
    status = client.status()
    assert (status.prepared_generation, status.prepared_ready) == (1, True)
    report = client.commit(1, timeout_s=5)
    assert report.generation == 1 and report.step >= 1
    status = client.status()
    assert (status.generation, list(status.devices)) == (1, [0, 1, 2, 3])
    assert parse_layout(status.layout) == parse_layout("dp=2,tp=2")
    assert control.calls == ["prepare", "status", "commit", "status"]


def test_health_needs_no_token(agent):
    with AgentClient(agent.address, timeout_s=5) as anonymous:
        assert anonymous.health()
        anonymous.wait_healthy(5)
        agent.set_health(False)
        assert not anonymous.health()
        agent.set_health(True)
        assert anonymous.health()


def test_health_of_nothing_is_false():
    server = serve(StepControlStub(), insecure=True)
    address = server.address
    server.stop(0)
    with AgentClient(address, timeout_s=1) as c:
        assert not c.health()
        with pytest.raises(AgentCallError) as info:
            c.wait_healthy(0.3)
    assert info.value.code == Code.DEADLINE_EXCEEDED


class StepControlStub:
    """A control that is never called (for servers whose calls are not the point)."""

    def prepare(self, *a, **kw): raise AssertionError
    def commit(self, *a): raise AssertionError
    def abort(self, *a): raise AssertionError
    def write_checkpoint(self, *a): raise AssertionError
    def status(self, *a): raise AssertionError


def test_token_file_rotation(agent, client, token_file):
    assert client.status().generation == 0
    stat = token_file.stat()
    token_file.write_text("rotated-token")
    # A later mtime, explicitly, so the test does not depend on the filesystem's clock grain.
    os.utime(token_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert _code(client.status)[0] == Code.UNAUTHENTICATED
    with AgentClient(agent.address, token="rotated-token") as rotated:
        assert rotated.status().generation == 0
    # A client reading the same file follows the rotation too.
    with AgentClient(agent.address, token_file=token_file) as follower:
        assert follower.status().generation == 0


def test_token_file_emptied_keeps_last_token(tmp_path):
    path = tmp_path / "token"
    path.write_text("first")
    tokens = TokenFile(path)
    path.write_text("")
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000_000))
    assert tokens.get() == "first"
    path.write_text("second\n")
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 2_000_000_000))
    assert tokens.get() == "second"


def test_unusable_token_file_is_a_startup_error(tmp_path, control):
    empty = tmp_path / "empty-token"
    empty.write_text("  \n")
    with pytest.raises(AuthConfigError, match="empty-token.*empty"):
        serve(control, token_file=empty)
    with pytest.raises(AuthConfigError, match="missing-token"):
        serve(control, token_file=tmp_path / "missing-token")


def test_serving_without_authentication_needs_insecure(control):
    with pytest.raises(ValueError, match="token_file.*tls.*insecure=True"):
        serve(control)
    server = serve(control, insecure=True)
    try:
        with AgentClient(server.address) as c:
            assert c.status().generation == 0
    finally:
        server.stop(0)


# ----------------------------------------------------------------------------------------------
# Malformed requests


@pytest.mark.parametrize("method", ["Prepare", "Commit", "Abort", "Status"])
def test_garbage_payload_is_invalid_argument(agent, control, method):
    channel = grpc.insecure_channel(agent.address)
    try:
        call = channel.unary_unary(f"/dynatrain.agent.v1.Agent/{method}")  # raw bytes
        for garbage in (b"\xff\xff garbage", b"\x08"):  # bad wire type; truncated varint
            with pytest.raises(grpc.RpcError) as info:
                call(garbage, metadata=bearer_metadata(TOKEN), timeout=5)
            assert info.value.code() == Code.INVALID_ARGUMENT, info.value.details()
            assert "not a valid dynatrain.agent.v1." in info.value.details()
        # Without the token the payload is not even parsed.
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff garbage", timeout=5)
        assert info.value.code() == Code.UNAUTHENTICATED
    finally:
        channel.close()
    assert control.calls == []


@pytest.mark.parametrize("change, field", [
    (dict(layout_text="dp=2,tq=2"), "layout"),
    (dict(layout_text=""), "layout"),
    (dict(devices=[0, 1, 2]), "devices"),
    (dict(devices=[0, 1, 1, 3]), "devices"),
    (dict(rendezvous="worker-0"), "rendezvous"),
    (dict(rendezvous="worker-0:0"), "rendezvous"),
    (dict(rendezvous="worker-0:70000"), "rendezvous"),
    (dict(rendezvous="fd00::1:29500"), "rendezvous"),
    (dict(timeout_s=-1.0), "timeout_seconds"),
    (dict(timeout_s=float("nan")), "timeout_seconds"),
    (dict(timeout_s=float("inf")), "timeout_seconds"),
    (dict(generation=0), "generation"),
    (dict(device_nodes=["node-a"]), "device_nodes"),
    (dict(device_nodes=["a", "b", "", "c"]), "device_nodes"),
    (dict(device_nodes=["n" * 254, "a", "b", "c"]), "device_nodes"),
])
def test_malformed_prepare_is_invalid_argument(client, control, change, field):
    code, details = _code(lambda: client.prepare(**{**GOOD_PREPARE, **change}))
    assert code == Code.INVALID_ARGUMENT
    assert field in details
    assert control.calls == []


def test_malformed_commit_and_abort(client, control):
    code, details = _code(lambda: client.commit(0))
    assert code == Code.INVALID_ARGUMENT and "generation=0" in details
    code, details = _code(lambda: client.commit(1, timeout_s=-5))
    assert code == Code.INVALID_ARGUMENT and "timeout_seconds=-5" in details
    code, details = _code(lambda: client.abort(0, "why"))
    assert code == Code.INVALID_ARGUMENT and "generation=0" in details
    # A value the wire cannot carry is refused before it is sent.
    assert _code(lambda: client.commit(-1))[0] == Code.INVALID_ARGUMENT
    assert control.calls == []


def test_every_problem_is_reported_at_once(client):
    _, details = _code(lambda: client.prepare(0, "dp=3", [5, 5], "nohost", timeout_s=-1))
    for field in ("generation=0", "devices lists 2", "repeats [5]", "rendezvous='nohost'",
                  "timeout_seconds=-1"):
        assert field in details


@pytest.mark.parametrize("text, ok", [
    ("worker-0:29500", True), ("10.0.0.1:1", True), ("[fd00::1]:65535", True),
    (":29500", False), ("host:", False), ("host:port", False), ("[fd00::1:29500", False),
    ("host :1", False), ("", False),
])
def test_check_rendezvous(text, ok):
    assert (check_rendezvous(text) is None) == ok


def test_defaults_reach_the_control():
    seen = {}

    class Recorder(StepControlStub):
        def prepare(self, args):
            seen["prepare"] = args

        def commit(self, generation, at_step, timeout_s):
            seen["commit"] = (generation, at_step, timeout_s)
            return agent_pb2.CommitResponse(generation=generation)

    server = serve(Recorder(), insecure=True)
    try:
        with AgentClient(server.address) as c:
            c.prepare(**GOOD_PREPARE)
            c.commit(1)
            c.prepare(**GOOD_PREPARE, devices_per_node=4, staging_bytes=1 << 20, timeout_s=7)
    finally:
        server.stop(0)
    a = seen["prepare"]
    assert isinstance(a, PrepareArgs)
    assert (a.generation, a.layout.world, a.devices, a.rendezvous) == (1, 4, (0, 1, 2, 3),
                                                                       "127.0.0.1:29500")
    assert (a.devices_per_node, a.staging_bytes, a.timeout_s) == (4, 1 << 20, 7.0)
    assert seen["commit"] == (1, 0, 120.0)


# ----------------------------------------------------------------------------------------------
# Errors of the control


@pytest.mark.parametrize("error, code", [
    (PreconditionFailed("generation 5 is stale"), Code.FAILED_PRECONDITION),
    (InvalidRequest("device 9 is not on this node"), Code.INVALID_ARGUMENT),
    (SwitchAborted("device 3 failed in transfer"), Code.ABORTED),
    (CommitTimeout("no switch within 1 s"), Code.DEADLINE_EXCEEDED),
    (AgentError(Code.RESOURCE_EXHAUSTED, "staging buffer"), Code.RESOURCE_EXHAUSTED),
])
def test_agent_errors_map_to_codes(client, control, error, code):
    control.fail = error
    got, details = _code(client.status)
    assert got == code and details == str(error)


def test_control_rule_violations(client):
    code, details = _code(lambda: client.prepare(**{**GOOD_PREPARE, "generation": 2}))
    assert code == Code.FAILED_PRECONDITION and "expected 1" in details
    assert _code(lambda: client.commit(1, timeout_s=1))[0] == Code.FAILED_PRECONDITION
    assert client.abort(1, "nothing prepared") is False
    client.prepare(**GOOD_PREPARE)
    assert client.abort(1, "changed my mind") is True


def test_unexpected_exception_is_internal_and_server_keeps_serving(client, control):
    control.fail = RuntimeError("the trainer tripped")
    code, details = _code(client.status)
    assert code == Code.INTERNAL and "RuntimeError: the trainer tripped" in details
    control.bad_response = True
    code, details = _code(client.status)
    assert code == Code.INTERNAL and "expected StatusResponse" in details
    control.bad_response = False
    assert client.status().step >= 0
    assert client.health()


# ----------------------------------------------------------------------------------------------
# Mutual TLS


def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject, key, issuer, issuer_key, *, ca=False, server=False):
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(tmp: Path, name: str, cert, key) -> tuple[Path, Path]:
    cert_path, key_path = tmp / f"{name}.crt", tmp / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with a server and a client certificate, and a client certificate of another CA."""
    tmp = tmp_path_factory.mktemp("pki")
    out = {}
    for ca_name in ("ca", "other-ca"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
        out[ca_name] = _write(tmp, ca_name, ca_cert, ca_key)[0]
        for name, server in ((f"{ca_name}-server", True), (f"{ca_name}-client", False)):
            key = ec.generate_private_key(ec.SECP256R1())
            out[name] = _write(tmp, name, _cert(name, key, ca_name, ca_key, server=server), key)
    return out


def test_mutual_tls(pki, control):
    server_cert, server_key = pki["ca-server"]
    server = serve(control, tls=TlsFiles(ca=pki["ca"], cert=server_cert, key=server_key))
    try:
        client_cert, client_key = pki["ca-client"]
        with AgentClient(server.address,
                         tls=TlsFiles(ca=pki["ca"], cert=client_cert, key=client_key)) as c:
            assert c.status().generation == 0
        # No client certificate: the handshake fails.
        with AgentClient(server.address, tls=TlsFiles(ca=pki["ca"]), timeout_s=3) as c:
            assert _code(c.status)[0] == Code.UNAVAILABLE
        # A client certificate from a CA the server does not trust.
        other_cert, other_key = pki["other-ca-client"]
        with AgentClient(server.address, timeout_s=3,
                         tls=TlsFiles(ca=pki["ca"], cert=other_cert, key=other_key)) as c:
            assert _code(c.status)[0] == Code.UNAVAILABLE
    finally:
        server.stop(0)
    assert control.calls == ["status"]


def test_mutual_tls_and_token_together(pki, control, token_file):
    server_cert, server_key = pki["ca-server"]
    server = serve(control, token_file=token_file,
                   tls=TlsFiles(ca=pki["ca"], cert=server_cert, key=server_key))
    client_cert, client_key = pki["ca-client"]
    tls = TlsFiles(ca=pki["ca"], cert=client_cert, key=client_key)
    try:
        with AgentClient(server.address, tls=tls) as c:
            assert _code(c.status)[0] == Code.UNAUTHENTICATED
        with AgentClient(server.address, tls=tls, token=TOKEN) as c:
            assert c.status().generation == 0
        # The call-credentials helper, for callers that build their own channel.
        credentials = grpc.composite_channel_credentials(
            channel_credentials(tls), token_call_credentials(TokenFile(token_file)))
        with grpc.secure_channel(server.address, credentials) as channel:
            stub = agent_pb2_grpc.AgentStub(channel)
            assert stub.Status(agent_pb2.StatusRequest(), timeout=5).generation == 0
    finally:
        server.stop(0)


def test_tls_files_errors_name_the_path(tmp_path, control):
    bogus = tmp_path / "bogus.pem"
    bogus.write_text("not a certificate")
    with pytest.raises(AuthConfigError, match="bogus.pem.*not PEM"):
        serve(control, tls=TlsFiles(ca=bogus, cert=bogus, key=bogus))
    with pytest.raises(AuthConfigError, match="certificate and a key"):
        serve(control, tls=TlsFiles(ca=bogus))


# ----------------------------------------------------------------------------------------------
# Generated stubs


def test_checked_in_stubs_are_current():
    result = subprocess.run([sys.executable, "-m", "dynatrain.agent.gen", "--check"],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_names_an_altered_stub(tmp_path, capsys):
    for name in gen.STUB_NAMES:
        shutil.copy(gen.DEFAULT_OUT / name, tmp_path / name)
    assert gen.main(["--check", "--out", str(tmp_path)]) == 0
    grpc_stub = tmp_path / "agent_pb2_grpc.py"
    grpc_stub.write_text(grpc_stub.read_text() + "\n# edited by hand\n")
    (tmp_path / "agent_pb2.pyi").unlink()
    capsys.readouterr()
    assert gen.main(["--check", "--out", str(tmp_path)]) == 1
    first_line = capsys.readouterr().err.splitlines()[0]
    assert first_line.startswith(f"stale agent stubs in {tmp_path}: ")
    assert first_line.split(": ", 1)[1].split(", ") == ["agent_pb2.pyi", "agent_pb2_grpc.py"]
    # Writing repairs it.
    assert gen.main(["--out", str(tmp_path)]) == 0
    assert gen.main(["--check", "--out", str(tmp_path)]) == 0


def test_old_layout_is_checked_and_bound_to_its_devices():
    from dynatrain.agent.server import InvalidRequest, check_prepare
    from dynatrain.agent.v1 import agent_pb2

    base = dict(generation=2, layout="dp=2", devices=[0, 1], rendezvous="127.0.0.1:1")
    args = check_prepare(agent_pb2.PrepareRequest(**base, old_layout="tp=2,pp=2",
                                                  old_devices=[3, 1, 0, 2], reason="scale-up"))
    assert args.old_layout.device_of == (3, 1, 0, 2) and args.reason == "scale-up"
    assert check_prepare(agent_pb2.PrepareRequest(**base)).old_layout is None
    # Where each device runs, for the mirrors; none given: unknown.
    assert check_prepare(agent_pb2.PrepareRequest(**base, device_nodes=["n1", "n2"])).nodes \
        == {0: "n1", 1: "n2"}
    assert check_prepare(agent_pb2.PrepareRequest(**base)).nodes == {}
    # ...and where each old device runs (a leaver's transfers are priced by its node too).
    moved = dict(old_layout="tp=2,pp=2", old_devices=[3, 1, 0, 2])
    assert check_prepare(agent_pb2.PrepareRequest(
        **base, **moved, device_nodes=["n1", "n2"],
        old_device_nodes=["n3", "n2", "n1", "n1"])).nodes == {0: "n1", 1: "n2", 2: "n1",
                                                               3: "n3"}
    for bad, needle in [(dict(old_device_nodes=["n1"]), "old_device_nodes lists 1"),
                        (dict(old_device_nodes=["a", "", "b", "c"]), "old_device_nodes"),
                        (dict(device_nodes=["n1", "n2"], old_device_nodes=["a", "n9", "b", "c"]),
                         "device 1 is on node 'n2' in device_nodes but on 'n9'")]:
        with pytest.raises(InvalidRequest, match=needle):
            check_prepare(agent_pb2.PrepareRequest(**base, **moved, **bad))
    for bad, needle in [(dict(old_layout="tp=2", old_devices=[0]), "old_devices"),
                        (dict(old_layout="tp=two", old_devices=[0, 1]), "old_layout"),
                        (dict(old_devices=[0, 1]), "without old_layout"),
                        (dict(old_layout="tp=2", old_devices=[1, 1]), "repeats")]:
        with pytest.raises(InvalidRequest, match=needle):
            check_prepare(agent_pb2.PrepareRequest(**base, **bad))

"""The fuzzer's requests: every kind of generated case, made from ``(seed, index)`` alone.

The generator side of :mod:`.fuzz`: the Agent's methods and the kinds' weights
(:data:`KINDS`), the value pools (huge, negative and non-finite numbers, odd layouts,
rendezvous strings and checkpoint paths), :class:`Case` (one request: method, payload bytes,
token variant, the codes it may get), :func:`token_metadata` (the token variants) and
:class:`Fuzzer`, which makes case ``index`` of each kind and enforces the safety rule: no
Prepare that could pass the agent's checks names a generation it could accept. Separate
because it starts no process and sends nothing: the tests check its rules without a worker.
"""

from __future__ import annotations

import json
import random
import secrets
import struct
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from dynatrain.agent import server as agent_server
from dynatrain.agent.auth import bearer_metadata
from dynatrain.agent.v1 import agent_pb2

from .fuzz_wire import mutate, varint

SERVICE = "/dynatrain.agent.v1.Agent/"
METHODS = {"Prepare": (agent_pb2.PrepareRequest, agent_pb2.PrepareResponse),
           "Commit": (agent_pb2.CommitRequest, agent_pb2.CommitResponse),
           "Abort": (agent_pb2.AbortRequest, agent_pb2.AbortResponse),
           "Checkpoint": (agent_pb2.CheckpointRequest, agent_pb2.CheckpointResponse),
           "Status": (agent_pb2.StatusRequest, agent_pb2.StatusResponse)}
C = grpc.StatusCode

HEALTH = "/grpc.health.v1.Health/"

GRPC_LIMIT = agent_server.MAX_MESSAGE_BYTES
"""The agent's largest request (gRPC refuses a bigger one with RESOURCE_EXHAUSTED)."""

# Weights of the kinds in a run (sum need not be 1).
KINDS = {"random": 22, "template": 14, "mutated": 18, "garbage": 8, "unknown-method": 5,
         "bad-token": 10, "stale": 13, "status": 6, "health": 4, "large": 0.6,
         "oversized": 0.3}

# ----------------------------------------------------------------------------------------------
# Value pools


U64 = (0, 1, 2, 3, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
       2**64 - 1)
U32 = (0, 1, 2, 3, 4, 7, 8, 255, 65535, 2**31 - 1, 2**31, 2**32 - 1)
I32 = (0, 1, -1, -2, 2**31 - 1, -2**31)
DOUBLES = (0.0, -0.0, 1.0, -1.0, 0.5, 60.0, 1e-300, 5e-324, 1e308, -1e308, 1e9, float("nan"),
           float("inf"), float("-inf"))
LAYOUTS = ("dp=1", "dp=2", "tp=2", "pp=2", "dp=1,zero=1", "dp=2,tp=2,zero=1", "dp=4",
           "dp=0", "dp=-1", "dp=99999999999999999999", "tp=3", "dp=1,dp=1", "dp=", "=", ",",
           "DP=1", "dp=1,foo=2", "dp=1.5", "dp=nan", "dp=1;rm -rf /", " dp=1", "dp=1 ",
           "dp=\uff11", "dp=1\x00", "dp=1," * 50, "tp=2," * 2000, "ep=2", "dp=2,ep=2",
           "pp=1000000", "zero=1")
CHECKPOINTS = ("../../etc/passwd", "/etc/passwd", "/etc/shadow", "/tmp", "/tmp/x/../../etc",
               "~/.ssh/id_rsa", "file:///etc/passwd", "http://evil.example/ckpt",
               "s3://bucket/ckpt", "/proc/self/mem", "/dev/zero", "checkpoints/../../..",
               "C:\\Windows\\System32", "\x00", "a" * 4096, "\u202e/dcba", "./", ".", "..")
RENDEZVOUS_BAD = ("127.0.0.1:1", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:-1",
                  "127.0.0.1:", ":29500", "localhost:29500", "[::1]:29500", "[::1", "[]:1",
                  "::1:29500", "evil.example.com:29500", "10.0.0.1:29500", "169.254.169.254:80",
                  "host:port", " 127.0.0.1:29500", "127.0.0.1:29500\n", "a" * 300 + ":1",
                  "127.0.0.1:99999999999999999999", "\u0661\u0662\u0667.0.0.1:80", "")
OUTSIDE = ("../../etc/passwd", "/etc/passwd", "/etc/shadow", "/tmp", "/tmp/x/../../etc",
           "/proc/self/mem", "../" * 12 + "root")
"""Checkpoint paths outside any checkpoint root below /tmp ("~/.ssh/id_rsa" is not one: it is
relative, so it lies under the root)."""
REASONS = ("", "start", "preemption", 'x"}\nevil_metric 1', "\u00e9\u4e2d" * 10, "r" * 5000)


_LOW7 = bytes(b & 0x7F for b in range(256))
"""A translation table that makes any byte a one-byte varint."""


def _text(rng: random.Random, n: int) -> str:
    alphabet = "ab=,:.-/ 0123456789dptzeroep[]\\\x00\x7f\u00e9\u4e2d\U0001f600"
    return "".join(rng.choice(alphabet) for _ in range(n))


# ----------------------------------------------------------------------------------------------
# Cases


@dataclass
class Case:
    index: int
    kind: str
    method: str
    """Full path, e.g. ``/dynatrain.agent.v1.Agent/Prepare``."""
    payload: bytes
    token: str = "right"
    """right | right-lower | right-padded | junk (all accepted, though junk's headers may pass
    gRPC's metadata limit) | missing | wrong | prefix | longer | empty | scheme | duplicate |
    right-wrong | other-key | binary | long | huge (refused; huge passes the metadata
    limit)."""
    expect: frozenset | None = None
    """The codes this case may get (None: any documented one)."""
    note: str = ""
    port: str = "agent"
    """agent | health: the agent's port, or the worker's separate plaintext health port."""
    protocol_codes: frozenset = frozenset()
    """Codes beyond ANSWER_CODES that the protocol of the method asked defines (the health
    service's NOT_FOUND for a service it does not know)."""

    @property
    def name(self) -> str:
        """The Agent method asked (Prepare, ...), Check for the health service, else other."""
        if self.method.startswith(SERVICE) and self.method[len(SERVICE):] in METHODS:
            return self.method[len(SERVICE):]
        return "Check" if self.method == HEALTH + "Check" else "other"


GOOD_TOKENS = ("right", "right-lower", "right-padded", "junk")
BAD_TOKENS = ("missing", "wrong", "prefix", "longer", "empty", "scheme", "duplicate",
              "right-wrong", "other-key", "binary", "long", "huge")


def token_metadata(kind: str, token: str, rng: random.Random) -> tuple:
    """The metadata of token variant ``kind`` (see :attr:`Case.token`)."""
    auth = "authorization"
    make = {
        "right": lambda: bearer_metadata(token),
        "right-lower": lambda: ((auth, f"bearer {token}"),),
        "right-padded": lambda: ((auth, f"  Bearer   {token}  "),),
        "junk": lambda: bearer_metadata(token) + tuple(
            (f"x-junk-{i}", "j" * rng.choice((10, 100, 100, 1000)))
            for i in range(rng.randint(1, 12))),
        "missing": lambda: (),
        "wrong": lambda: bearer_metadata(secrets.token_urlsafe(16)),
        "prefix": lambda: bearer_metadata(token[:-1]),
        "longer": lambda: bearer_metadata(token + "x"),
        "empty": lambda: ((auth, "Bearer "),),
        "scheme": lambda: ((auth, f"Basic {token}"),),
        "duplicate": lambda: bearer_metadata(token) * 2,
        "right-wrong": lambda: bearer_metadata(token) + bearer_metadata("wrong"),
        "other-key": lambda: (("x-authorization", f"Bearer {token}"),),
        "binary": lambda: (("authorization-bin", b"Bearer " + token.encode()),),
        "long": lambda: bearer_metadata("t" * rng.choice((1000, 4000, 7000))),
        "huge": lambda: bearer_metadata("t" * rng.choice((17000, 100000))),
    }
    return make[kind]()


class Fuzzer:
    """Makes case ``index`` from ``(seed, index)`` alone.

    ``rendezvous`` is the target's real store (a template Prepare names it so that the
    request looks valid); ``stale_max`` the highest generation the target has seen (its
    generation, or one it prepared): every Prepare that would pass the wire checks gets a
    generation in ``1..stale_max``, so the agent must refuse it; ``device`` the target's
    device; ``checkpoints`` paths under the target's checkpoint root (they pass the path
    check, so a stale Prepare that names one must be refused for its generation, before the
    running generation is abandoned)."""

    def __init__(self, seed: int, *, rendezvous: str, stale_max: int, device: int = 0,
                 checkpoints: tuple[str, ...] = (), kinds: dict[str, float] | None = None):
        self.seed, self.rendezvous, self.stale_max, self.device = (
            seed, rendezvous, stale_max, device)
        self.checkpoints = tuple(checkpoints)
        weights = kinds or KINDS
        self._kinds = [k for k, w in weights.items() if w > 0]
        self._weights = [weights[k] for k in self._kinds]

    def case(self, index: int) -> Case:
        rng = random.Random(self.seed * 1_000_003 + index)
        kind = rng.choices(self._kinds, self._weights)[0]
        case = getattr(self, "_" + kind.replace("-", "_"))(rng, index)
        case.kind = kind
        if case.name == "Prepare":
            case.payload, rewritten = self.guard_prepare(rng, case.payload)
            if rewritten:
                case.note += " (generation made stale)"
        elif case.name == "Checkpoint":
            case.payload, rewritten = self.guard_checkpoint(rng, case.payload)
            if rewritten:
                case.note += " (generation made one that does not run)"
        return case

    # -- the safety rule -----------------------------------------------------------------------
    def guard_prepare(self, rng: random.Random, payload: bytes) -> tuple[bytes, bool]:
        """``payload``, or a copy with a stale generation if it might be accepted."""
        try:
            req = agent_pb2.PrepareRequest.FromString(payload)
        except Exception:
            return payload, False                  # not a message: INVALID_ARGUMENT
        if 1 <= req.generation <= self.stale_max:
            return payload, False
        if len(payload) <= 65536:                  # larger ones: too slow to check here
            try:
                agent_server.check_prepare(req)
            except agent_server.InvalidRequest:
                return payload, False              # refused by the wire checks
        # It might be accepted (or was not checked): a stale generation, by construction.
        req.generation = rng.randint(1, self.stale_max)
        return req.SerializeToString(), True

    def guard_checkpoint(self, rng: random.Random, payload: bytes) -> tuple[bytes, bool]:
        """``payload``, or a copy naming a generation the target does not run if the agent's
        wire checks would pass it: a Checkpoint of the running generation is real work (with
        ``stop``, the end of training), so every one that gets that far must be refused for
        its generation (FAILED_PRECONDITION)."""
        try:
            req = agent_pb2.CheckpointRequest.FromString(payload)
            agent_server.check_checkpoint(req)
        except Exception:
            return payload, False                  # not a message, or INVALID_ARGUMENT
        req.generation = self.stale_max + 1 + rng.randrange(1 << 20)
        return req.SerializeToString(), True

    # -- values --------------------------------------------------------------------------------
    def _value(self, rng: random.Random, fd, name: str):
        t = fd.type
        if t == fd.TYPE_UINT64:
            return rng.choice(U64) if rng.random() < 0.7 else rng.getrandbits(64)
        if t == fd.TYPE_UINT32:
            return rng.choice(U32) if rng.random() < 0.7 else rng.getrandbits(32)
        if t in (fd.TYPE_INT32, fd.TYPE_SINT32, fd.TYPE_ENUM):
            return rng.choice(I32)
        if t in (fd.TYPE_DOUBLE, fd.TYPE_FLOAT):
            return (rng.choice(DOUBLES) if rng.random() < 0.8
                    else struct.unpack("<d", rng.randbytes(8))[0])
        if t == fd.TYPE_BOOL:
            return rng.random() < 0.5
        if t == fd.TYPE_STRING:
            return self._string(rng, name)
        return None

    def _string(self, rng: random.Random, name: str) -> str:
        r = rng.random()
        if r < 0.15:
            return _text(rng, rng.choice((1, 8, 64, 1000)))
        if "layout" in name:
            return rng.choice(LAYOUTS)
        if name == "rendezvous":
            return rng.choice(RENDEZVOUS_BAD + (self.rendezvous,) * 4)
        if name == "checkpoint":
            return rng.choice(CHECKPOINTS + self.checkpoints * 3)
        if name == "reason":
            return rng.choice(REASONS)
        return _text(rng, rng.randint(0, 32))

    def _devices(self, rng: random.Random) -> list[int]:
        r = rng.random()
        if r < 0.3:
            return [self.device]
        if r < 0.5:
            return []
        if r < 0.7:
            return rng.sample(range(8), rng.randint(1, 8))
        if r < 0.8:
            return [self.device] * rng.randint(2, 4)
        return [rng.choice(U32) for _ in range(rng.randint(1, 40))]

    def random_message(self, rng: random.Random, cls, *, p: float = 0.5):
        msg = cls()
        for fd in cls.DESCRIPTOR.fields:
            if rng.random() >= p:
                continue
            if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                key_fd, value_fd = fd.message_type.fields
                target = getattr(msg, fd.name)
                for _ in range(rng.choice((1, 2, 5, 50))):
                    target[self._value(rng, key_fd, "")] = self._value(rng, value_fd, "")
            elif fd.is_repeated:
                values = (self._devices(rng) if fd.type == fd.TYPE_UINT32
                          else [self._value(rng, fd, fd.name) for _ in range(rng.randint(0, 9))])
                getattr(msg, fd.name).extend(values)
            elif fd.message_type is None:
                setattr(msg, fd.name, self._value(rng, fd, fd.name))
        return msg

    def template(self, generation: int = 1) -> agent_pb2.PrepareRequest:
        """The Prepare that started the target (``dp=1`` on its device)."""
        return agent_pb2.PrepareRequest(generation=generation, layout="dp=1",
                                        devices=[self.device], rendezvous=self.rendezvous,
                                        reason="start")

    def _valid(self, rng: random.Random, name: str):
        gen = rng.randint(1, self.stale_max)
        if name == "Prepare":
            req = self.template(gen)
            if rng.random() < 0.5:
                req.old_layout, req.old_devices[:] = "dp=1", [self.device]
            return req
        if name == "Commit":
            return agent_pb2.CommitRequest(generation=gen, timeout_seconds=rng.choice((0, 1)))
        if name == "Abort":
            return agent_pb2.AbortRequest(generation=gen, reason="fuzz")
        if name == "Checkpoint":          # made safe by guard_checkpoint
            return agent_pb2.CheckpointRequest(generation=gen, stop=rng.random() < 0.5,
                                               timeout_seconds=rng.choice((0, 1)))
        return agent_pb2.StatusRequest(since_step=rng.choice(U64))

    # -- kinds ---------------------------------------------------------------------------------
    def _random(self, rng, index):
        name = rng.choice(tuple(METHODS))
        msg = self.random_message(rng, METHODS[name][0], p=rng.choice((0.3, 0.6, 0.9)))
        return Case(index, "", SERVICE + name, msg.SerializeToString(),
                    token=rng.choice(GOOD_TOKENS))

    def _template(self, rng, index):
        req = self.template(rng.choice((0, 1, 2, 3, 2**64 - 1)))
        if rng.random() < 0.6:
            req.old_layout, req.old_devices[:] = "dp=1", [self.device]
        fields = [fd for fd in req.DESCRIPTOR.fields if fd.name != "generation"]
        src = self.random_message(rng, agent_pb2.PrepareRequest, p=1.0)
        for fd in rng.sample(fields, rng.randint(1, 3)):
            req.ClearField(fd.name)
            if fd.is_repeated:
                getattr(req, fd.name).MergeFrom(getattr(src, fd.name))
            else:
                setattr(req, fd.name, getattr(src, fd.name))
        return Case(index, "", SERVICE + "Prepare", req.SerializeToString(),
                    token=rng.choice(GOOD_TOKENS))

    def _mutated(self, rng, index):
        name = rng.choice(tuple(METHODS))
        base = (self._valid(rng, name) if rng.random() < 0.6
                else self.random_message(rng, METHODS[name][0]))
        data = base.SerializeToString()
        notes = []
        for _ in range(rng.choice((1, 1, 2, 3))):
            how, data = mutate(rng, data)
            notes.append(how)
        return Case(index, "", SERVICE + name, data, token=rng.choice(GOOD_TOKENS),
                    note="+".join(notes))

    def _garbage(self, rng, index):
        name = rng.choice(tuple(METHODS))
        r = rng.random()
        if r < 0.5:
            data = rng.randbytes(rng.choice((1, 2, 7, 64, 512, 4096)))
        elif r < 0.6:
            data = b"\xff" * rng.randint(1, 100)
        elif r < 0.7:
            data = b"\x80" * rng.randint(1, 100)               # a varint that never ends
        elif r < 0.8:
            data = b"\x0b" * rng.choice((5, 200, 5000))          # nested group starts
        elif r < 0.9:
            data = varint(2 << 3 | 2) + varint(2**62) + b"abc"  # length past the end
        else:
            data = rng.choice((b"GET / HTTP/1.1\r\n\r\n", b"\x00" * 64, b"\x16\x03\x01",
                               json.dumps({"generation": 1}).encode()))
        return Case(index, "", SERVICE + name, data, token=rng.choice(GOOD_TOKENS))

    def _unknown_method(self, rng, index):
        path = rng.choice((SERVICE + "Foo", SERVICE + "prepare", SERVICE + "Prepare2",
                           SERVICE, "/dynatrain.agent.v2.Agent/Prepare",
                           "/dynatrain.agent.v1.agent/Prepare", "/Prepare",
                           "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                           "/grpc.health.v1.Health/Nope", SERVICE + "Status/extra",
                           "/" + "".join(rng.choice("abcXYZ./_") for _ in range(20)),
                           SERVICE + "x" * 2000))
        token = rng.choice(GOOD_TOKENS + BAD_TOKENS[:3])
        expect = {C.UNIMPLEMENTED} | ({C.UNAUTHENTICATED} if token in BAD_TOKENS else set())
        return Case(index, "", path, rng.randbytes(rng.randint(0, 64)), token=token,
                    expect=frozenset(expect))

    def _bad_token(self, rng, index):
        name = rng.choice(tuple(METHODS))
        token = rng.choice(BAD_TOKENS)
        return Case(index, "", SERVICE + name, self._valid(rng, name).SerializeToString(),
                    token=token, expect=frozenset({C.UNAUTHENTICATED}))

    def _stale(self, rng, index):
        name = rng.choice(("Prepare", "Prepare", "Commit", "Abort"))
        req = self._valid(rng, name)
        note = ""
        if name == "Prepare":
            r = rng.random()
            expect = {C.FAILED_PRECONDITION, C.INVALID_ARGUMENT, C.PERMISSION_DENIED}
            if r < 0.3:        # a checkpoint start: must not abandon the running generation
                req.ClearField("old_layout")
                req.ClearField("old_devices")
                inside = self.checkpoints and rng.random() < 0.6
                req.checkpoint = rng.choice(self.checkpoints if inside else OUTSIDE)
                note = f"checkpoint {'inside' if inside else 'outside'} the root"
                # a path under the root passes its check: only the generation refuses it
                expect = {C.FAILED_PRECONDITION} if inside else {C.INVALID_ARGUMENT}
            elif r < 0.6:      # a recovery: must not abandon the running generation either
                req.old_layout, req.old_devices[:] = "dp=1", [self.device]
                req.recover = True
                req.restore_step = rng.choice((0, 1, 2, 5))
                note = "recover"
                expect = {C.FAILED_PRECONDITION}
            elif r < 0.7:
                req.rendezvous = rng.choice(RENDEZVOUS_BAD[:3])
                note = "rendezvous"
        elif name == "Commit":
            expect = {C.FAILED_PRECONDITION}
        else:
            expect = {C.OK}                             # answered, with aborted=False
        return Case(index, "", SERVICE + name, req.SerializeToString(),
                    token=rng.choice(GOOD_TOKENS), expect=frozenset(expect), note=note)

    def _status(self, rng, index):
        req = agent_pb2.StatusRequest(since_step=rng.choice(U64))
        return Case(index, "", SERVICE + "Status", req.SerializeToString(),
                    token=rng.choice(GOOD_TOKENS), expect=frozenset({C.OK}))

    def _health(self, rng, index):
        """The health service, open without a token, on the agent's port or the separate
        plaintext one: valid and unknown service names, garbage, its other methods."""
        port = rng.choice(("agent", "health"))
        r = rng.random()
        if r < 0.5:
            service = rng.choice(("", agent_server.SERVICE_NAME, "nope", "x" * 5000,
                                  _text(rng, 10)))
            payload = health_pb2.HealthCheckRequest(service=service).SerializeToString()
            known = service in ("", agent_server.SERVICE_NAME)
            return Case(index, "", HEALTH + "Check", payload, token=rng.choice(
                GOOD_TOKENS + BAD_TOKENS[:3]), port=port, note=f"service {service[:20]!r}",
                expect=frozenset({C.OK} if known else {C.NOT_FOUND, C.INVALID_ARGUMENT}),
                protocol_codes=frozenset() if known else frozenset({C.NOT_FOUND}))
        if r < 0.8:
            _, payload = mutate(rng, health_pb2.HealthCheckRequest(
                service=agent_server.SERVICE_NAME).SerializeToString())
            if rng.random() < 0.5:
                payload = rng.choice((b"\xff\xff", b"\x80" * 20, rng.randbytes(33)))
            return Case(index, "", HEALTH + "Check", payload, port=port, note="garbage",
                        protocol_codes=frozenset({C.NOT_FOUND}))
        method = rng.choice(("Watch", "List", "check", "Nope"))
        return Case(index, "", HEALTH + method, b"", port=port,
                    expect=frozenset({C.UNIMPLEMENTED, C.UNAUTHENTICATED}))

    def _large(self, rng, index, *, over: bool = False):
        """Long repeated fields or strings within the agent's message limit, or (``over``)
        beyond it (up to gRPC's default limit and 1 MiB more)."""
        name = rng.choice(("Prepare", "Prepare", "Commit", "Abort", "Status"))
        size = (rng.randint(GRPC_LIMIT + 1, max(4 << 20, GRPC_LIMIT) + (1 << 20)) if over
                else rng.choice((16 << 10, agent_server.MAX_WORLD + 1, 256 << 10,
                                 GRPC_LIMIT - 4096)))
        req = self._valid(rng, name)
        if name == "Prepare" and rng.random() < 0.6:
            field_name = rng.choice(("devices", "old_devices", "failed_devices"))
            # packed one-byte varints 0..127, appended on the wire (a parser merges them into
            # the field): made as bytes, since a list of millions of ints is slow to build
            number = req.DESCRIPTOR.fields_by_name[field_name].number
            packed = rng.randbytes(size).translate(_LOW7)
            return Case(index, "", SERVICE + name, req.SerializeToString()
                        + varint(number << 3 | 2) + varint(size) + packed, token="right",
                        note=f"{field_name} x{size}",
                        expect=frozenset({C.RESOURCE_EXHAUSTED}) if over else None)
        elif name == "Prepare":
            field_name = rng.choice(("layout", "rendezvous", "checkpoint", "reason"))
            setattr(req, field_name, "a" * size)
            note = f"{field_name} of {size} chars"
        else:
            field_name = "reason" if name == "Abort" else ""
            if field_name:
                req.reason = "r" * size
            note = f"{size} bytes of unknown field"
            if not field_name:      # no long field: an unknown one of that size
                return Case(index, "", SERVICE + name, req.SerializeToString()
                            + varint(99 << 3 | 2) + varint(size) + b"u" * size,
                            token="right", note=note,
                            expect=frozenset({C.RESOURCE_EXHAUSTED}) if over else None)
        return Case(index, "", SERVICE + name, req.SerializeToString(), token="right",
                    note=note, expect=frozenset({C.RESOURCE_EXHAUSTED}) if over else None)

    def _oversized(self, rng, index):
        return self._large(rng, index, over=True)

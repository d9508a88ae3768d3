"""Fuzz a live, training agent: thousands of generated requests, loopback only, and a judge.

Two real worker processes (``python -m dynatrain.agent.worker``, bearer token) train the same
job, ``dp=1`` each, every one with its own rendezvous store: the *target*, whose agent is
fuzzed, and the *reference*, which nobody but the monitor talks to. The fuzzer sends the
target's agent generated requests, first one at a time (so a failure reproduces in order),
then from many threads at once (a flood bounded in count and time):

- ``random``: a message of each Agent method with random field values (huge, negative, NaN
  and infinite numbers, long strings, random layout texts, rendezvous strings and checkpoint
  paths such as ``../../etc/passwd``, long repeated fields and maps);
- ``template``: a valid-looking Prepare (the one that started the job) with a few fields
  replaced by such values, so requests get past the wire checks to the agent's state checks;
- ``mutated``: a valid message changed on the wire (bit flips, truncation, duplicated,
  dropped or reordered fields, unknown fields, bad lengths and wire types);
- ``garbage``: bytes that are no message at all, sent through a raw channel;
- ``large`` / ``oversized``: long repeated fields or strings within gRPC's 4 MiB limit and
  beyond it;
- ``unknown-method``: paths the agent does not serve;
- ``bad-token``: a valid request with no, a wrong, a malformed or a duplicated token;
- ``stale``: Prepare, Commit and Abort of generations at or below the current one, Prepares
  that carry a checkpoint or a recovery among them (refused before they abandon anything);
- ``status``: Status with random ``since_step``.

No fuzzed request may start real work. Every Prepare payload that would get past the agent's
wire checks (:func:`dynatrain.agent.server.check_prepare`, run here on the decoded bytes) is
rewritten to a stale generation, so it must be refused (and every such Checkpoint to a
generation that does not run); only a few deliberate Prepares of the
next generation, sent while nothing else is in flight, are accepted, and each is aborted at
once. A fuzzed Prepare or Commit that the agent answers OK is reported (and aborted).

The judge: 0 crashes (both processes alive, the target's health SERVING on every check of a
monitor thread and at the end), every answer's gRPC code in the documented set
(``ANSWER_CODES``), per kind the codes it must get (a bad token: UNAUTHENTICATED; a stale
Commit: FAILED_PRECONDITION; ...), no call left unanswered until its deadline, and training
unchanged: the target kept stepping in its generation, its step records contiguous, and the
loss of every step equal, bit for bit, to the reference's at the same step. The tallies
(requests per kind, answers per code, steps trained during the fuzz, requests per second) are
printed by ``benchmarks/agent_fuzz.py``; ``tests/agent/test_fuzz.py`` asserts on them. Each
case is made from ``(seed, index)`` alone, so the printed seed and a case's index regenerate
it (``Fuzzer(seed, rendezvous=..., stale_max=...).case(index)``; ``stale_max`` is 1 in the
one-at-a-time phase and 1 + the deliberate Prepares in the flood), and a failure's report
carries the first bytes of its payload.
"""

from __future__ import annotations

import collections
import json
import os
import random
import secrets
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2

from dynatrain.agent import server as agent_server
from dynatrain.agent.auth import bearer_metadata
from dynatrain.agent.client import AgentCallError, AgentClient
from dynatrain.agent.server import ANSWER_CODES
from dynatrain.agent.v1 import agent_pb2
from dynatrain.ports import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]
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
# Protobuf on the wire (enough to mutate a message below the library)


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("bad varint")
        b = data[i]
        n |= (b & 0x7F) << shift
        i += 1
        shift += 7
        if not b & 0x80:
            return n, i


def split_records(data: bytes) -> list[bytes] | None:
    """The field records (key and value bytes) of a serialized message; None if it is not
    one (groups and odd wire types included)."""
    out, i = [], 0
    try:
        while i < len(data):
            start = i
            key, i = _read_varint(data, i)
            wire = key & 7
            if wire == 0:
                _, i = _read_varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 2:
                n, i = _read_varint(data, i)
                i += n
            elif wire == 5:
                i += 4
            else:
                return None
            if i > len(data):
                return None
            out.append(data[start:i])
    except ValueError:
        return None
    return out


def mutate(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    """One wire-level mutation of ``data``: (its name, the bytes)."""
    records = split_records(data) or []
    how = rng.choice(("flip", "truncate", "duplicate", "drop", "shuffle", "unknown", "length",
                      "wiretype", "splice", "varint"))
    if how == "flip" or not records and how not in ("unknown", "truncate"):
        b = bytearray(data or b"\x00")
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return "flip", bytes(b)
    if how == "truncate":
        return how, data[:rng.randrange(len(data))] if data else b""
    if how == "duplicate":
        i = rng.randrange(len(records))
        records.insert(rng.randrange(len(records) + 1), records[i])
    elif how == "drop":
        records.pop(rng.randrange(len(records)))
    elif how == "shuffle":
        rng.shuffle(records)
    elif how == "unknown":
        number = rng.choice((16, 99, 1000, 2**29 - 1, rng.randrange(16, 2**29)))
        wire = rng.choice((0, 1, 2, 5))
        value = {0: varint(rng.getrandbits(64)), 1: rng.randbytes(8), 5: rng.randbytes(4)}.get(
            wire) or varint(n := rng.randint(0, 64)) + rng.randbytes(n)
        records.insert(rng.randrange(len(records) + 1), varint(number << 3 | wire) + value)
    elif how == "length":
        # a length-delimited record whose length claims far more than follows
        i = rng.randrange(len(records))
        key, j = _read_varint(records[i], 0)
        records[i] = varint((key & ~7) | 2) + varint(rng.choice((2**31, 2**32 + 5, 2**63,
                                                                 len(data) + 1))) + b"x"
    elif how == "wiretype":
        i = rng.randrange(len(records))
        key, j = _read_varint(records[i], 0)
        records[i] = varint((key & ~7) | rng.choice((1, 2, 3, 4, 5, 6, 7))) + records[i][j:]
    elif how == "splice":
        records = records[:rng.randrange(len(records) + 1)] + rng.sample(
            records, rng.randint(1, len(records)))
    elif how == "varint":
        # a ten-byte varint that never ends, inside a record
        i = rng.randrange(len(records))
        key, j = _read_varint(records[i], 0)
        records[i] = records[i][:j] + b"\xff" * rng.randint(10, 12)
    return how, b"".join(records)


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


# ----------------------------------------------------------------------------------------------
# The processes


def job_manifest(steps: int = 100000) -> dict:
    """The quickstart job, small and long (it trains until stopped)."""
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["training"]["steps"] = steps
    doc["spec"]["globalBatchSize"] = 4
    return doc


def spawn_worker(workdir: Path, job: Path, token: Path, device: int, timeout_s: float = 120,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, dict]:
    """A worker process in standby; returns it and its ready file (agent_port, ...)."""
    ready = workdir / f"ready-{device}"
    log = open(workdir / f"worker-{device}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "dynatrain.agent.worker", "--job", str(job),
                             "--device", str(device), "--token-file", str(token),
                             "--ready-file", str(ready), "--threads", "1", *extra],
                            stdout=log, stderr=subprocess.STDOUT,
                            # a SIGABRT (sent if it does not stop) dumps every thread's stack
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    log.close()
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"worker {device} exited with {proc.returncode} at start:\n"
                               + (workdir / f"worker-{device}.log").read_text()[-3000:])
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"worker {device} did not start within {timeout_s:g} s")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


class Monitor(threading.Thread):
    """Every ``period`` seconds: the target's health on its agent port and its plaintext
    health port (no token, as a kubelet asks), both
    processes alive, and the step records of both workers (Status after the last one seen),
    which outlive the agent's own window of 1000."""

    def __init__(self, procs: dict[str, subprocess.Popen], clients: dict[str, AgentClient],
                 health: list[AgentClient], period: float = 0.25):
        super().__init__(name="fuzz-monitor", daemon=True)
        self.procs, self.clients, self.health_clients, self.period = (
            procs, clients, health, period)
        self.records: dict[str, dict[int, agent_pb2.StepRecord]] = {k: {} for k in clients}
        self.health_checks = 0
        self.health_failures: list[str] = []
        self.status_refusals: collections.Counter = collections.Counter()
        self.dead: dict[str, int] = {}
        self._halt = threading.Event()
        self.lock = threading.Lock()

    def healthy(self) -> bool:
        """Ask every health endpoint once; False (and the failure noted) if one is not
        SERVING."""
        all_ok = True
        for client in self.health_clients:
            t0 = time.monotonic()
            try:
                ok = client.health(timeout_s=10)
                why = "" if ok else "not SERVING (or no answer within 10 s)"
            except AgentCallError as e:
                ok, why = False, f"{e.code.name}: {e.details}"
            with self.lock:
                self.health_checks += 1
                if not ok:
                    self.health_failures.append(
                        f"{client.address} at {time.strftime('%H:%M:%S')} after "
                        f"{time.monotonic() - t0:.1f} s: {why}")
            all_ok = all_ok and ok
        return all_ok

    def poll(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None and name not in self.dead:
                self.dead[name] = proc.returncode
        self.healthy()
        for name, client in self.clients.items():
            self.pull(name, client)

    def pull(self, name: str, client: AgentClient) -> None:
        with self.lock:
            seen = self.records[name]
            since = max(seen) if seen else 0
        try:
            st = client.status(since, timeout_s=10)
        except AgentCallError as e:   # a busy refusal under the flood: ask again next time
            with self.lock:
                self.status_refusals[e.code.name] += 1
            return
        with self.lock:
            for r in st.steps:
                seen.setdefault(r.step, r)

    def last(self, name: str) -> int:
        """The last step seen of worker ``name`` (0: none yet)."""
        with self.lock:                # the monitor's thread adds records meanwhile
            return max(self.records[name], default=0)

    def run(self) -> None:
        while not self._halt.wait(self.period):
            self.poll()

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


# ----------------------------------------------------------------------------------------------
# Sending and judging


@dataclass
class Tally:
    """Everything counted in a run (thread-safe through ``lock``)."""

    sent: collections.Counter = field(default_factory=collections.Counter)
    """Requests per kind (``kind`` and ``kind/Method``)."""
    codes: collections.Counter = field(default_factory=collections.Counter)
    by_kind: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    undocumented: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    """Fuzzed Prepares/Commits answered OK, or Aborts that aborted something."""
    hangs: list = field(default_factory=list)
    """Calls that got no answer before the client's deadline."""
    not_sent: collections.Counter = field(default_factory=collections.Counter)
    """Cases the client library refused to send (e.g. metadata it cannot encode)."""
    bytes_sent: int = 0
    seconds: collections.Counter = field(default_factory=collections.Counter)
    """Seconds spent waiting for answers, per kind."""
    slowest: dict = field(default_factory=dict)
    """The slowest answer per kind: (seconds, case index)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def example(self, case: Case, code, details: str) -> dict:
        return {"index": case.index, "kind": case.kind, "method": case.method,
                "port": case.port, "token": case.token, "note": case.note.strip(),
                "bytes": len(case.payload), "payload_hex": case.payload[:96].hex(),
                "code": code.name if code else None, "details": (details or "")[:400]}


class Sender:
    """Sends cases through raw channels (bytes in, bytes out) and judges each answer."""

    def __init__(self, addresses: dict[str, str], token: str, tally: Tally, *,
                 channels: int = 4, deadline_s: float = 20.0):
        self.token, self.tally, self.deadline_s = token, tally, deadline_s
        # Sending up to 5 MiB must not be refused by this side's own limits.
        options = [("grpc.max_send_message_length", -1),
                   ("grpc.max_receive_message_length", 64 << 20)]
        self.channels = {port: [grpc.insecure_channel(address, options)
                                for _ in range(channels)]
                         for port, address in addresses.items()}
        self._calls: dict = {}
        self._calls_lock = threading.Lock()
        self.on_accepted = None
        """Called with (case, response) when a fuzzed Prepare was accepted (to abort it)."""

    def _call(self, case: Case):
        channels = self.channels.get(case.port) or self.channels["agent"]
        key = (case.port, case.index % len(channels), case.method)
        with self._calls_lock:
            if key not in self._calls:
                # no serializers: the payload bytes go out as they are, the reply comes back
                # as bytes
                self._calls[key] = channels[key[1]].unary_unary(case.method)
            return self._calls[key]

    def send(self, case: Case) -> grpc.StatusCode | None:
        rng = random.Random(case.index)
        metadata = token_metadata(case.token, self.token, rng)
        t0 = time.monotonic()
        response, details = None, ""
        try:
            response = self._call(case)(case.payload, metadata=metadata,
                                        timeout=self.deadline_s)
            code = C.OK
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        except (ValueError, TypeError) as e:     # this side would not send it
            with self.tally.lock:
                self.tally.not_sent[f"{case.kind}: {type(e).__name__}"] += 1
            return None
        elapsed = time.monotonic() - t0
        self.judge(case, code, details, response, elapsed)
        return code

    def judge(self, case: Case, code, details: str, response: bytes | None,
              elapsed: float) -> None:
        t = self.tally
        name = case.name
        problem = None
        if code == C.DEADLINE_EXCEEDED and elapsed >= self.deadline_s * 0.95:
            hang = True
        else:
            hang = False
        if code == C.OK and name in METHODS:
            try:
                reply = METHODS[name][1].FromString(response or b"")
            except Exception as e:
                reply, problem = None, f"OK with an undecodable {name} reply: {e}"
            if name == "Prepare":
                problem = "a fuzzed Prepare was accepted"
                if self.on_accepted is not None and reply is not None:
                    self.on_accepted(case, reply)
            elif name == "Commit":
                problem = "a fuzzed Commit switched the target"
            elif name == "Abort" and reply is not None and reply.aborted:
                problem = "a fuzzed Abort aborted a prepared generation"
        with t.lock:
            t.sent[case.kind] += 1
            t.sent[f"{case.kind}/{name}"] += 1
            t.bytes_sent += len(case.payload)
            t.seconds[case.kind] += elapsed
            if elapsed > t.slowest.get(case.kind, (0.0, -1))[0]:
                t.slowest[case.kind] = (elapsed, case.index)
            t.codes[code.name] += 1
            t.by_kind[case.kind][code.name] += 1
            if hang:
                t.hangs.append(t.example(case, code, f"no answer in {elapsed:.1f} s"))
            elif code not in ANSWER_CODES | case.protocol_codes:
                t.undocumented.append(t.example(case, code, details))
            elif case.expect is not None and code not in case.expect | {C.RESOURCE_EXHAUSTED}:
                t.unexpected.append(t.example(case, code, details)
                                    | {"expected": sorted(c.name for c in case.expect)})
            if problem:
                t.accepted.append(t.example(case, code, problem))

    def close(self) -> None:
        for channels in self.channels.values():
            for ch in channels:
                ch.close()


# ----------------------------------------------------------------------------------------------
# A run


def compare_losses(target: dict[int, agent_pb2.StepRecord],
                   reference: dict[int, agent_pb2.StepRecord]) -> dict:
    """Step by step, bit for bit: the steps both trained, how many differ, the first that
    does, and the largest relative difference."""
    common = sorted(set(target) & set(reference))
    differ = [s for s in common
              if struct.pack("<d", target[s].loss) != struct.pack("<d", reference[s].loss)]
    rel = max((abs(target[s].loss - reference[s].loss) / max(abs(reference[s].loss), 1e-30)
               for s in common), default=0.0)
    first = differ[0] if differ else None
    return {"compared": len(common), "first_step": common[0] if common else None,
            "last_step": common[-1] if common else None, "differ": len(differ),
            "equal": bool(common) and not differ, "max_rel_diff": rel,
            "first_mismatch": None if first is None else {
                "step": first, "target": target[first].loss,
                "reference": reference[first].loss}}


def _contiguous(records: dict[int, agent_pb2.StepRecord]) -> bool:
    steps = sorted(records)
    return bool(steps) and steps == list(range(steps[0], steps[-1] + 1))


def run_fuzz(requests: int = 3000, *, seed: int | None = None, threads: int = 16,
             serial_fraction: float = 0.4, flood_seconds: float = 30.0,
             deliberate: int = 3, deadline_s: float = 20.0, workdir: str | None = None,
             kinds: dict[str, float] | None = None, say=print) -> dict:
    """Start the target and the reference, fuzz the target with ``requests`` cases (a
    ``serial_fraction`` of them one at a time, the rest from ``threads`` threads within
    ``flood_seconds``), and return the tallies and verdicts (see the module docstring)."""
    import torch.distributed as dist
    from dynatrain.controller.orchestrator import switch
    from dynatrain.vps.layout import parse_layout

    if requests < 1 or threads < 1 or not 0 <= serial_fraction <= 1:
        raise ValueError(f"requests={requests}, threads={threads}, serial_fraction="
                         f"{serial_fraction}: expected requests >= 1, threads >= 1 and a "
                         "fraction in [0, 1]")
    seed = secrets.randbits(32) if seed is None else seed
    say(f"fuzz: seed {seed} ({requests} requests, {threads} threads in the flood)")
    tmp = tempfile.TemporaryDirectory(prefix="dynatrain-fuzz-") if workdir is None else None
    root = Path(workdir or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    job = root / "job.yaml"
    job.write_text(yaml.safe_dump(job_manifest()))
    token_path = root / "token"
    token = secrets.token_urlsafe(24)
    token_path.write_text(token)
    stores = {name: dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
              for name in ("target", "reference")}
    devices = {"target": 0, "reference": 1}
    procs: dict[str, subprocess.Popen] = {}
    clients: dict[str, AgentClient] = {}
    result: dict = {"seed": seed}
    monitor = sender = None
    try:
        started = time.monotonic()
        spawned = {}
        # both start at once (torch's import and warm-up take seconds each)
        with ThreadPoolExecutor(2) as pool:
            for name, d in devices.items():
                # a checkpoint root (the job writes no checkpoints: a Prepare's path can pass
                # its check), and the target also serves health alone on a plaintext port,
                # as on a cluster
                extra = ("--checkpoint-dir", str(root / f"checkpoints-{name}"))
                if name == "target":
                    extra += ("--health-port", str(_free_port()))
                spawned[name] = pool.submit(spawn_worker, root, job, token_path, d,
                                            extra=extra)
            errors = []
            for name, fut in spawned.items():
                try:
                    procs[name], info = fut.result()
                except Exception as e:      # the other one still gets stopped below
                    errors.append(e)
                    continue
                clients[name] = AgentClient(f"127.0.0.1:{info['agent_port']}", token=token)
                result[f"{name}_ready"] = info
            if errors:
                raise errors[0]
        rdv = {name: f"127.0.0.1:{s.port}" for name, s in stores.items()}
        for name, d in devices.items():
            clients[name].wait_healthy(30)
            layout = parse_layout("dp=1").with_devices([d])
            switch({d: clients[name]}, 1, None, layout, rdv[name], reason="start")
        say(f"fuzz: target (device 0) and reference (device 1) training dp=1 "
            f"({time.monotonic() - started:.1f} s to start)")
        target = clients["target"]
        health_address = f"127.0.0.1:{result['target_ready']['health_port']}"
        # no token: health is open, as for the kubelet
        health = [AgentClient(target.address), AgentClient(health_address)]
        monitor = Monitor(procs, clients, health)
        deadline = time.monotonic() + 60
        while min(len(v) for v in monitor.records.values()) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not train 2 steps within 60 s")
            monitor.poll()
            time.sleep(0.1)
        monitor.start()

        tally = Tally()
        sender = Sender({"agent": target.address, "health": health_address}, token, tally,
                        deadline_s=deadline_s)
        highest = [1]                                 # the target's highest generation
        ckpt = root / "checkpoints-target"
        fuzzer = Fuzzer(seed, rendezvous=rdv["target"], stale_max=1, kinds=kinds, checkpoints=(
            "quickstart/step-00000004", str(ckpt / "quickstart" / "step-00000001"),
            str(ckpt), "../checkpoints-target/x", "quickstart/../quickstart/step-00000002"))
        abort_lock = threading.Lock()

        def abort_accepted(case, reply):
            # a fuzzed Prepare the agent took (a bug, counted): drop it before a Commit
            with abort_lock:
                try:
                    target.abort(reply.generation, "fuzz: accepted by mistake")
                except AgentCallError as e:
                    say(f"fuzz: could not abort generation {reply.generation}: {e}")
                highest[0] = max(highest[0], reply.generation)
                fuzzer.stale_max = highest[0]
        sender.on_accepted = abort_accepted

        fuzz_started = time.time()
        t0 = time.monotonic()
        n_serial = int(requests * serial_fraction)
        for i in range(n_serial):
            sender.send(fuzzer.case(i))
        serial_s = time.monotonic() - t0
        say(f"fuzz: {n_serial} requests one at a time in {serial_s:.1f} s")

        # A few real Prepares of the next generation, each aborted at once (nothing else is
        # in flight): the agent must still accept a valid request amid the fuzz.
        deliberate_out = []
        for _ in range(deliberate):
            g = highest[0] + 1
            try:
                target.prepare(g, "dp=1", [0], rdv["target"], old_layout="dp=1",
                               old_devices=[0], reason="fuzz-deliberate")
                aborted = target.abort(g, "fuzz: deliberate")
                deliberate_out.append({"generation": g, "prepared": True,
                                       "aborted": aborted})
            except AgentCallError as e:
                deliberate_out.append({"generation": g, "prepared": False,
                                       "error": f"{e.code.name}: {e.details}"})
            highest[0] = g
            fuzzer.stale_max = g

        # The flood: the rest from many threads, bounded in count and time.
        t1 = time.monotonic()
        stop_at = t1 + flood_seconds
        flood = range(n_serial, requests)
        counter = iter(flood)
        counter_lock = threading.Lock()

        def flood_worker():
            while time.monotonic() < stop_at:
                with counter_lock:
                    i = next(counter, None)
                if i is None:
                    return
                sender.send(fuzzer.case(i))

        with ThreadPoolExecutor(threads, thread_name_prefix="fuzz-flood") as pool:
            for f in [pool.submit(flood_worker) for _ in range(threads)]:
                f.result()
        flood_s = time.monotonic() - t1
        fuzz_s = time.monotonic() - t0
        fuzz_ended = time.time()
        flood_sent = sum(tally.sent[k] for k in tally.sent if "/" not in k) - n_serial
        say(f"fuzz: {flood_sent} requests from {threads} threads in {flood_s:.1f} s")

        # After: alive, healthy, in its generation, and stepping on.
        monitor.poll()
        before = monitor.last("target")
        deadline = time.monotonic() + 60
        while monitor.last("target") < before + 3 and time.monotonic() < deadline:
            time.sleep(0.1)
            monitor.poll()
        final_health = monitor.healthy()
        try:
            final = target.status(monitor.last("target"))
        except AgentCallError as e:          # judged below, with everything else
            final = agent_pb2.StatusResponse(error=f"no Status: {e}")
        monitor.stop()
        # the reference catches up with the target's last step (it may be behind or ahead)
        last = monitor.last("target")
        deadline = time.monotonic() + 120
        while monitor.last("reference") < last and time.monotonic() < deadline:
            time.sleep(0.2)
            monitor.pull("reference", clients["reference"])
        rec_t = monitor.records["target"]
        during = [s for s, r in rec_t.items() if fuzz_started <= r.end_time <= fuzz_ended]

        result.update({
            "requests": sum(tally.sent[k] for k in tally.sent if "/" not in k),
            "serial": n_serial, "threads": threads,
            "sent": dict(sorted(tally.sent.items())),
            "codes": dict(tally.codes.most_common()),
            "by_kind": {k: dict(v) for k, v in sorted(tally.by_kind.items())},
            "undocumented": tally.undocumented, "unexpected": tally.unexpected,
            "accepted": tally.accepted, "hangs": tally.hangs,
            "not_sent": dict(tally.not_sent), "megabytes_sent": tally.bytes_sent / 2**20,
            "mean_ms": {k: 1000 * v / tally.sent[k] for k, v in sorted(tally.seconds.items())},
            "slowest": {k: {"ms": 1000 * v[0], "index": v[1]}
                        for k, v in sorted(tally.slowest.items())},
            "deliberate": deliberate_out,
            "seconds": fuzz_s, "serial_seconds": serial_s, "flood_seconds": flood_s,
            "requests_per_s": (sum(tally.sent[k] for k in tally.sent if "/" not in k)
                               / fuzz_s if fuzz_s else 0.0),
            "crashes": len(monitor.dead), "dead": dict(monitor.dead),
            "health_checks": monitor.health_checks,
            "health_failures": monitor.health_failures, "final_health": final_health,
            "status_refusals": dict(monitor.status_refusals),
            "final_state": agent_pb2.StatusResponse.State.Name(final.state),
            "final_generation": final.generation, "final_error": final.error,
            "generations_in_records": sorted({r.generation for r in rec_t.values()}),
            "records_contiguous": _contiguous(rec_t),
            "steps_during_fuzz": len(during),
            "steps_total": max(rec_t),
            "losses": compare_losses(rec_t, monitor.records["reference"]),
        })
        return result
    finally:
        if monitor is not None and monitor.is_alive():
            monitor.stop()
        if sender is not None:
            sender.close()
        for c in list(clients.values()) + (monitor.health_clients if monitor else []):
            c.close()
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)        # stop now (SIGTERM is a notice)
        codes, stop_s = {}, {}
        for name, p in procs.items():
            # it stops at its next step boundary: a step takes seconds on a loaded machine
            t_stop = time.monotonic()
            try:
                codes[name] = p.wait(60)
                stop_s[name] = round(time.monotonic() - t_stop, 1)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGABRT)     # its threads' stacks, into its log
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                log = root / f"worker-{devices[name]}.log"
                codes[name] = ("did not stop within 60 s of SIGINT; its log ends: "
                               + log.read_text(errors="replace")[-4000:])
        result["exit_codes"], result["stop_seconds"] = codes, stop_s
        if tmp is not None:
            tmp.cleanup()


def failures(result: dict, *, min_each: int = 3) -> list[str]:
    """What a run shows wrong (empty: it passed): crashes, undocumented codes, requests that
    got a code their kind must not, fuzzed requests accepted, hangs, health, training."""
    out = []
    if result["crashes"]:
        out.append(f"processes died: {result['dead']}")
    for key, what in (("undocumented", "answers with an undocumented code"),
                      ("unexpected", "answers with a code their kind must not get"),
                      ("accepted", "fuzzed requests that changed the agent's state"),
                      ("hangs", "calls with no answer before the deadline")):
        if result[key]:
            out.append(f"{len(result[key])} {what}, e.g. {result[key][:3]}")
    if result["health_failures"] or not result["final_health"]:
        out.append(f"health not SERVING: {result['health_failures'][:5]}, at the end "
                   f"{result['final_health']}")
    for d in result["deliberate"]:
        if not d.get("prepared") or not d.get("aborted"):
            out.append(f"a valid Prepare of the next generation, then Abort: {d}")
    if result["final_state"] != "TRAINING" or result["final_generation"] != 1 \
            or result["final_error"]:
        out.append(f"the target ended {result['final_state']} in generation "
                   f"{result['final_generation']} (error {result['final_error']!r}); expected "
                   "TRAINING in generation 1")
    if result["generations_in_records"] != [1] or not result["records_contiguous"]:
        out.append(f"step records of generations {result['generations_in_records']}, "
                   f"contiguous: {result['records_contiguous']}")
    if result["steps_during_fuzz"] < 1:
        out.append("the target trained no step during the fuzz")
    loss = result["losses"]
    if not loss["equal"]:
        out.append(f"losses differ from the reference's: {loss}")
    for code in ("INVALID_ARGUMENT", "UNAUTHENTICATED", "FAILED_PRECONDITION"):
        if result["codes"].get(code, 0) < min_each:
            out.append(f"only {result['codes'].get(code, 0)} answers {code}: the fuzzer does "
                       "not reach that check")
    if any(c != 0 for c in result.get("exit_codes", {}).values()):
        out.append(f"exit codes after SIGINT: {result['exit_codes']}")
    return out


def report(result: dict) -> str:
    """The printed counts."""
    lines = [f"seed {result['seed']}: {result['requests']} requests in "
             f"{result['seconds']:.1f} s ({result['requests_per_s']:.0f}/s; "
             f"{result['serial']} one at a time, the rest from {result['threads']} threads in "
             f"{result['flood_seconds']:.1f} s), {result['megabytes_sent']:.1f} MiB"]
    lines.append("requests per kind:")
    for kind, codes in result["by_kind"].items():
        per = ", ".join(f"{m.split('/')[1]} {n}" for m, n in result["sent"].items()
                        if m.startswith(kind + "/"))
        lines.append(f"  {kind:15s} {result['sent'][kind]:6d}  ({per})  -> "
                     + ", ".join(f"{c} {n}" for c, n in sorted(codes.items()))
                     + f"; {result['mean_ms'][kind]:.1f} ms mean, slowest "
                     f"{result['slowest'][kind]['ms']:.0f} ms "
                     f"(#{result['slowest'][kind]['index']})")
    lines.append("answers per code: " + ", ".join(f"{c} {n}" for c, n in
                                                  result["codes"].items()))
    lines.append(f"undocumented codes: {len(result['undocumented'])}; unexpected for their "
                 f"kind: {len(result['unexpected'])}; fuzzed requests accepted: "
                 f"{len(result['accepted'])}; hangs: {len(result['hangs'])}; not sent: "
                 f"{sum(result['not_sent'].values())}")
    lines.append(f"crashes: {result['crashes']}; health SERVING on "
                 f"{result['health_checks'] - len(result['health_failures'])}/"
                 f"{result['health_checks']} checks, at the end {result['final_health']}; "
                 f"exit codes {result.get('exit_codes')} (stopped in "
                 f"{result.get('stop_seconds')} s)")
    good = sum(1 for d in result["deliberate"] if d.get("prepared") and d.get("aborted"))
    lines.append(f"deliberate Prepare+Abort of the next generation: {good}/"
                 f"{len(result['deliberate'])} accepted and aborted")
    loss = result["losses"]
    lines.append(f"training: {result['steps_during_fuzz']} steps during the fuzz, "
                 f"{result['steps_total']} in all, ended {result['final_state']} in "
                 f"generation {result['final_generation']}; losses of steps "
                 f"{loss['first_step']}..{loss['last_step']} ({loss['compared']}) vs the "
                 f"reference: {'equal bit for bit' if loss['equal'] else 'DIFFERENT'} "
                 f"(max rel diff {loss['max_rel_diff']:.2e})")
    return "\n".join(lines)


__all__ = ["ANSWER_CODES", "Case", "Fuzzer", "KINDS", "compare_losses", "failures", "mutate",
           "report", "run_fuzz", "spawn_worker", "split_records"]


if __name__ == "__main__":        # a quick look: python -m dynatrain.bench.fuzz
    r = run_fuzz(300, seed=1, threads=8, flood_seconds=10)
    print(report(r))
    for f in failures(r):
        print("FAIL:", f)
    sys.exit(1 if failures(r) else 0)

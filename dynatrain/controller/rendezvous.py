"""The job's rendezvous store, served by the controller: torch.distributed's Store over gRPC.

Every generation's process groups are built through one key-value store that all its workers
reach (gloo and NCCL exchange their addresses and unique ids through it). The controller owns
it, because it must outlive any worker: the operator for a job on a cluster, the local runner
for ``dynatrain run``. Until #32 it was torch's ``TCPStore``, which made the operator import
torch and ship the 5.7 GiB training image; this server speaks the ``Rendezvous`` service of
``agent.proto`` and needs only grpc, and the workers use it through
:class:`dynatrain.agent.store.RendezvousStore`, a torch ``Store``.

Semantics follow ``TCPStore``'s, which c10d relies on: ``get`` and ``wait`` block until their
keys are set (up to a timeout, then ``DEADLINE_EXCEEDED``), ``add`` keeps a counter as decimal
text, ``compare_set`` sets a missing key only when the expected value is empty. It is one
dict under one condition variable: rendezvous traffic is a few keys per rank per generation.
Like ``TCPStore`` it authenticates nobody; the agents check that a Prepare names their
caller's own store (:func:`dynatrain.agent.server.check_rendezvous_owner`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from dynatrain.agent.serving import bracket_host
from dynatrain.agent.v1 import agent_pb2, agent_pb2_grpc

DEFAULT_WAIT_S = 300.0
"""How long ``get``/``wait`` wait when the request names no timeout (``TCPStore``'s default)."""

MAX_WAIT_S = 3600.0
"""The longest wait a request may ask for (the agent's bound on every timeout)."""

MAX_KEY = 4096
"""Longest key, in characters; c10d's keys are a prefix and a short name."""

MAX_VALUE = 1 << 20
"""Largest value, in bytes (a gloo address list of a large world fits many times over)."""

MAX_WAITERS = 1024
"""Threads for calls: each waiting ``get``/``wait`` holds one, so a world of N ranks, each
waiting for a few keys at once, needs a few times N."""


class _Invalid(ValueError):
    """A malformed request: answered INVALID_ARGUMENT with this message."""


class _Keys:
    """The store's contents and the condition its waiters sleep on."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def wait_for(self, keys: list[str], timeout_s: float) -> bool:
        """Whether every one of ``keys`` was set within ``timeout_s``. Holds the lock on return."""
        deadline = time.monotonic() + timeout_s
        while not all(k in self.data for k in keys):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.wait(left)
        return True


def _key(text: str, what: str = "key") -> str:
    if not text:
        raise _Invalid(f"{what} is empty")
    if len(text) > MAX_KEY:
        raise _Invalid(f"{what} has {len(text)} characters, over the limit {MAX_KEY}")
    return text


def _value(data: bytes, what: str = "value") -> bytes:
    if len(data) > MAX_VALUE:
        raise _Invalid(f"{what} has {len(data)} bytes, over the limit {MAX_VALUE}")
    return bytes(data)


def _timeout(value: float) -> float:
    if value != value or value < 0 or value > MAX_WAIT_S:   # value != value: NaN
        raise _Invalid(f"timeout_s={value} is not within 0..{MAX_WAIT_S:g} "
                       f"(0 waits the default {DEFAULT_WAIT_S:g} s)")
    return value or DEFAULT_WAIT_S


class RendezvousServicer(agent_pb2_grpc.RendezvousServicer):
    """The Store operations over one :class:`_Keys`."""

    def __init__(self):
        self.keys = _Keys()

    def _answer(self, context, work) -> agent_pb2.StoreReply:
        try:
            return work()
        except _Invalid as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def Set(self, request, context):
        def work():
            key, value = _key(request.key), _value(request.value)
            with self.keys.changed:
                self.keys.data[key] = value
                self.keys.changed.notify_all()
            return agent_pb2.StoreReply()
        return self._answer(context, work)

    def Get(self, request, context):
        def work():
            key, timeout_s = _key(request.key), _timeout(request.timeout_s)
            with self.keys.changed:
                if self.keys.wait_for([key], timeout_s):
                    return agent_pb2.StoreReply(value=self.keys.data[key])
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"key {key!r} was not set within {timeout_s:g} s")
        return self._answer(context, work)

    def Add(self, request, context):
        def work():
            key = _key(request.key)
            with self.keys.changed:
                held = self.keys.data.get(key, b"0")
                try:
                    number = int(held) + request.amount
                except ValueError:
                    raise _Invalid(f"key {key!r} holds {held[:40]!r}, not a counter") from None
                self.keys.data[key] = str(number).encode()
                self.keys.changed.notify_all()
            return agent_pb2.StoreReply(number=number)
        return self._answer(context, work)

    def CompareSet(self, request, context):
        def work():
            key = _key(request.key)
            desired, expected = _value(request.value), _value(request.expected, "expected")
            with self.keys.changed:
                held = self.keys.data.get(key)
                if held is None and expected:     # TCPStore: a missing key answers expected
                    return agent_pb2.StoreReply(value=expected)
                if held is None or held == expected:
                    self.keys.data[key] = desired
                    self.keys.changed.notify_all()
                    return agent_pb2.StoreReply(value=desired)
                return agent_pb2.StoreReply(value=held)
        return self._answer(context, work)

    def Check(self, request, context):
        def work():
            keys = [_key(k, "a key") for k in request.keys]
            with self.keys.changed:
                return agent_pb2.StoreReply(ok=all(k in self.keys.data for k in keys))
        return self._answer(context, work)

    def Wait(self, request, context):
        def work():
            keys = [_key(k, "a key") for k in request.keys]
            timeout_s = _timeout(request.timeout_s)
            with self.keys.changed:
                if self.keys.wait_for(keys, timeout_s):
                    return agent_pb2.StoreReply(ok=True)
                missing = [k for k in keys if k not in self.keys.data]
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"keys {missing[:8]} were not set within {timeout_s:g} s")
        return self._answer(context, work)

    def DeleteKey(self, request, context):
        def work():
            key = _key(request.key)
            with self.keys.changed:
                return agent_pb2.StoreReply(ok=self.keys.data.pop(key, None) is not None)
        return self._answer(context, work)

    def NumKeys(self, request, context):
        with self.keys.changed:
            return agent_pb2.StoreReply(number=len(self.keys.data))


class RendezvousServer:
    """One job's store on ``host``, at an ephemeral port (:attr:`port`) unless one is given.

    ``address`` is what a Prepare names (``host:port``, IPv6 in brackets). ``close`` stops it;
    the workers' groups of the generation in progress then fail, as they would with a
    ``TCPStore`` whose host went away.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self.servicer = RendezvousServicer()
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=MAX_WAITERS, thread_name_prefix="rendezvous"),
            options=[("grpc.max_receive_message_length", MAX_VALUE + MAX_KEY + 1024)])
        agent_pb2_grpc.add_RendezvousServicer_to_server(self.servicer, self._server)
        bracketed = bracket_host(host)
        self.port = self._server.add_insecure_port(f"{bracketed}:{port}")
        if self.port == 0:
            raise OSError(f"the rendezvous store cannot listen on {bracketed}:{port} "
                          "(the address is not this machine's, or the port is taken)")
        self.address = f"{bracketed}:{self.port}"
        self._server.start()

    def close(self, grace_s: float = 0.0) -> None:
        self._server.stop(grace_s)

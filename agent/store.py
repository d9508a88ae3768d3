"""The worker's side of the job's rendezvous store: a torch ``Store`` over gRPC.

The controller serves the store (:class:`dynatrain.controller.rendezvous.RendezvousServer`,
the ``Rendezvous`` service of ``agent.proto``) so that the operator needs no torch; c10d
builds every group through a ``Store``, and torch lets one be written in Python (its
``PythonStore`` trampoline calls these methods from the C++ side, gloo's and NCCL's
rendezvous included). :class:`RendezvousStore` is that store: each method is one call, and
``get``/``wait`` wait on the server, as ``TCPStore``'s do.

Making one checks that the server answers within the timeout, as ``TCPStore``'s constructor
does, and raises ``ConnectionError`` naming the address otherwise.

**Lifetime.** The worker keeps one store per rendezvous address for its whole life
(:meth:`WorkerControl._connect`), and :meth:`RendezvousStore.clone` returns the store itself.
A Python ``Store`` is a pybind trampoline: the groups built through it hold only its C++
part, and once the Python object is collected, a call from them (an aborted generation's
groups, still waiting) fails inside torch ("Not implemented"). One gRPC channel carries
concurrent calls, so a generation stuck in its rendezvous does not hold the next one up, which
is why the ``TCPStore`` this replaced was made anew per generation.
"""

from __future__ import annotations

from datetime import timedelta

import grpc
import torch.distributed as dist

from dynatrain.agent.v1 import agent_pb2, agent_pb2_grpc

from .serving import bracket_host

_MARGIN_S = 5.0
"""How much longer the client waits for a waiting call's answer than the server waits for its
keys, so that a timeout is the server's DEADLINE_EXCEEDED with its message, not the client's."""


class StoreError(RuntimeError):
    """A store call failed: the message names the call, the key and the store's address."""


class RendezvousStore(dist.Store):
    """torch.distributed's Store interface on the controller's ``Rendezvous`` service at
    ``host:port``; ``timeout`` bounds every wait, as a ``TCPStore``'s does."""

    def __init__(self, host: str, port: int, *, timeout: timedelta = timedelta(seconds=300)):
        super().__init__()
        bracketed = bracket_host(host)
        self.address = f"{bracketed}:{port}"
        # the base class keeps the timeout: c10d may change it (set_timeout), as on a TCPStore
        self.set_timeout(timeout)
        self._channel = grpc.insecure_channel(self.address)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.timeout_s)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise ConnectionError(f"the rendezvous store at {self.address} did not answer "
                                  f"within {self.timeout_s:g} s") from None
        self._stub = agent_pb2_grpc.RendezvousStub(self._channel)

    @property
    def timeout_s(self) -> float:
        return self.timeout.total_seconds()

    def clone(self) -> "RendezvousStore":
        """This store: one channel carries concurrent calls (``TCPStore.clone`` opens a new
        connection because one of its sockets carries one call at a time). A new object
        would not do: torch's C++ side would outlive it (see the module docstring)."""
        return self

    def _call(self, method: str, what: str, wait_s: float | None = None, **fields):
        deadline = (wait_s if wait_s is not None else self.timeout_s) + _MARGIN_S
        try:
            return getattr(self._stub, method)(agent_pb2.StoreRequest(**fields),
                                               timeout=deadline)
        except grpc.RpcError as e:
            raise StoreError(f"rendezvous store {self.address}: {method} {what}: "
                             f"{e.code().name} {e.details()}") from None

    def set(self, key: str, value) -> None:
        self._call("Set", repr(key), key=key, value=_bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("Get", repr(key), self.timeout_s, key=key,
                          timeout_s=self.timeout_s).value

    def add(self, key: str, amount: int) -> int:
        return self._call("Add", repr(key), key=key, amount=amount).number

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("CompareSet", repr(key), key=key, expected=_bytes(expected),
                          value=_bytes(desired)).value

    def check(self, keys: list[str]) -> bool:
        return self._call("Check", f"{len(keys)} keys", keys=list(keys)).ok

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait_s = self.timeout_s if timeout is None else timeout.total_seconds()
        self._call("Wait", f"{list(keys)[:4]}", wait_s, keys=list(keys), timeout_s=wait_s)

    def delete_key(self, key: str) -> bool:
        return self._call("DeleteKey", repr(key), key=key).ok

    def num_keys(self) -> int:
        return self._call("NumKeys", "").number

    # The names c10d's C++ side calls these by (through a PrefixStore, for one).
    deleteKey = delete_key
    getNumKeys = num_keys

    def close(self) -> None:
        self._channel.close()


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)

"""The controller's client of one agent.

:class:`AgentClient` wraps the generated stub with what every caller would otherwise repeat:
authentication (bearer token, re-read from its file when rotated, and/or mutual TLS), a
deadline on every call (a Commit's deadline covers the switch's own timeout plus a margin, so
the agent's DEADLINE_EXCEEDED, which carries its reason, arrives before the client gives up),
health checks through the standard ``grpc.health.v1`` service, and one exception type,
:class:`AgentCallError`, that names the agent, the method and the gRPC code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import auth
from .v1 import agent_pb2, agent_pb2_grpc

# What a zero timeout means on the agent's side (see the proto); mirrored here only to size
# the client's deadline.
_DEFAULT_COMMIT_TIMEOUT_S = 120.0

# Reconnect quickly to an agent that is starting or restarting (gRPC's default backoff grows to
# two minutes, far longer than a pod takes to come up). Not grpc.min_reconnect_backoff_ms: gRPC
# uses it as the minimum *connect timeout* (a connection attempt, TCP connect and TLS handshake,
# gets max(backoff, it); grpc/grpc#12830, #33423), and 0.1 s cut short the handshakes of agents
# busy in Python, whose certificate fetcher waits for the GIL: the call failed at once with
# UNAVAILABLE "Handshake read failed (Endpoint closing)" and the controller took a healthy
# worker for an exited one (issue #32; tests/agent/test_tls_under_load.py). Left at gRPC's
# 20 s, a slow handshake is bounded by the call's own deadline instead.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class AgentCallError(Exception):
    """A call to an agent failed; ``code`` is the gRPC status code, ``details`` its text."""

    def __init__(self, code: grpc.StatusCode, details: str, address: str, method: str):
        self.code = code
        self.details = details
        self.address = address
        self.method = method
        super().__init__(f"agent {address}: {method} failed with {code.name}: {details}")


class AgentClient:
    """A connection to the agent at ``address`` (``host:port``).

    Authenticate with ``token`` (a string, or a callable asked for the token at every call, so
    that a rotated token is picked up without a new client) or ``token_file`` (re-read when it
    changes), with ``tls`` (:class:`~dynatrain.agent.auth.TlsFiles` or, in memory,
    :class:`~dynatrain.agent.auth.ClientTls`: the CA of the agent's certificate and this
    client's certificate and key), or both. ``timeout_s`` is the deadline of every call except
    Commit, whose deadline is its switch timeout plus ``timeout_s``.
    """

    def __init__(self, address: str, *, token: str | Callable[[], str] | None = None,
                 token_file: str | os.PathLike | None = None,
                 tls: auth.TlsFiles | auth.ClientTls | None = None, timeout_s: float = 10.0):
        if token is not None and token_file is not None:
            raise ValueError("pass token or token_file, not both")
        if isinstance(token, str) and not token.strip():
            raise ValueError("token is empty")
        if token is not None and not isinstance(token, str) and not callable(token):
            raise TypeError(f"token must be a string or a callable returning one, not "
                            f"{type(token).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid; expected seconds > 0")
        self.address = address
        self.timeout_s = float(timeout_s)
        self._token = token.strip() if isinstance(token, str) else token
        self._token_file = auth.TokenFile(token_file) if token_file is not None else None
        options = _CHANNEL_OPTIONS + auth.channel_options(tls)
        if tls is not None:
            self._channel = grpc.secure_channel(address, auth.channel_credentials(tls), options)
        else:
            self._channel = grpc.insecure_channel(address, options)
        self._stub = agent_pb2_grpc.AgentStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    # -- plumbing ------------------------------------------------------------------------------

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        # Plain metadata rather than call credentials: gRPC sends call credentials only over
        # TLS, and the token alone (without TLS) is a supported setup; over TLS the metadata
        # is encrypted like the rest of the call.
        if self._token_file is not None:
            token = self._token_file.get()
        elif callable(self._token):
            token = self._token()
            if not isinstance(token, str) or not token.strip():
                raise ValueError(f"the token callable returned {type(token).__name__} "
                                 f"{'(empty)' if isinstance(token, str) else ''}; expected "
                                 "the bearer token")
            token = token.strip()
        else:
            token = self._token
        return auth.bearer_metadata(token) if token is not None else ()

    def _call(self, method: str, make_request, timeout_s: float):
        try:
            request = make_request()
        except (ValueError, TypeError) as e:  # e.g. a negative number for a uint64 field
            raise AgentCallError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"the request cannot be encoded: {e}", self.address,
                                 method) from None
        try:
            metadata = self._metadata()
        except Exception as e:   # the caller's token source failed: nothing was sent
            raise AgentCallError(grpc.StatusCode.UNAUTHENTICATED,
                                 f"no bearer token to send: {type(e).__name__}: {e}",
                                 self.address, method) from None
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            raise AgentCallError(e.code(), e.details() or "", self.address, method) from None

    # -- the Agent service ---------------------------------------------------------------------

    def prepare(self, generation: int, layout_text: str, devices: Sequence[int],
                rendezvous: str, devices_per_node: int = 0, staging_bytes: int = 0,
                timeout_s: float = 0, *, reason: str = "", old_layout: str = "",
                old_devices: Sequence[int] = (), recover: bool = False,
                restore_step: int = 0, failed_devices: Sequence[int] = (),
                proxies: dict[int, int] | None = None,
                checkpoint: str = "",
                device_nodes: Sequence[str] = (),
                old_device_nodes: Sequence[str] = ()) -> agent_pb2.PrepareResponse:
        """Start preparing ``generation``; returns once the agent accepted it. ``recover``
        (with the failed devices, the snapshot step and the mirrors' proxies) recovers from a
        failure; ``checkpoint`` starts the generation from a DCP checkpoint."""
        return self._call("Prepare", lambda: agent_pb2.PrepareRequest(
            generation=generation, layout=layout_text, devices=list(devices),
            rendezvous=rendezvous, devices_per_node=devices_per_node,
            staging_bytes=staging_bytes, timeout_seconds=timeout_s, reason=reason,
            old_layout=old_layout, old_devices=list(old_devices), recover=recover,
            restore_step=restore_step, failed_devices=list(failed_devices),
            proxies=dict(proxies or {}), checkpoint=checkpoint,
            device_nodes=list(device_nodes), old_device_nodes=list(old_device_nodes)),
            self.timeout_s)

    def commit(self, generation: int, at_step: int = 0,
               timeout_s: float = 0) -> agent_pb2.CommitResponse:
        """Switch to ``generation``; blocks until the switch happened (or failed)."""
        switch_timeout = timeout_s if timeout_s and timeout_s > 0 else _DEFAULT_COMMIT_TIMEOUT_S
        return self._call("Commit", lambda: agent_pb2.CommitRequest(
            generation=generation, at_step=at_step, timeout_seconds=timeout_s),
            switch_timeout + self.timeout_s)

    def checkpoint(self, generation: int, *, stop: bool = False,
                   timeout_s: float = 0) -> agent_pb2.CheckpointResponse:
        """Write a checkpoint of the running ``generation`` at the next boundary every rank
        agrees on (``stop``: and train no further); blocks until it is whole."""
        wait = timeout_s if timeout_s and timeout_s > 0 else _DEFAULT_COMMIT_TIMEOUT_S
        return self._call("Checkpoint", lambda: agent_pb2.CheckpointRequest(
            generation=generation, stop=stop, timeout_seconds=timeout_s),
            wait + self.timeout_s)

    def abort(self, generation: int, reason: str, *,
              timeout_s: float | None = None) -> bool:
        """Drop the prepared ``generation``; False when the agent had nothing prepared."""
        return self._call("Abort", lambda: agent_pb2.AbortRequest(
            generation=generation, reason=reason), timeout_s or self.timeout_s).aborted

    def status(self, since_step: int = 0, *,
               timeout_s: float | None = None) -> agent_pb2.StatusResponse:
        """The agent's state and its step records after ``since_step``; ``timeout_s``
        overrides the client's deadline (the controller's watchdog asks with a short one)."""
        return self._call("Status", lambda: agent_pb2.StatusRequest(since_step=since_step),
                          timeout_s or self.timeout_s)

    # -- health --------------------------------------------------------------------------------

    def _check(self, timeout_s: float, wait_for_ready: bool) -> bool:
        try:
            response = self._health.Check(health_pb2.HealthCheckRequest(service=""),
                                          timeout=timeout_s, wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return False
            raise AgentCallError(e.code(), e.details() or "", self.address,
                                 "Health/Check") from None
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def health(self, timeout_s: float | None = None) -> bool:
        """True if the agent answers SERVING; False if it is unreachable, slow or not serving
        (within ``timeout_s``, default the client's deadline)."""
        return self._check(timeout_s or self.timeout_s, wait_for_ready=False)

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait until the agent answers SERVING; AgentCallError(DEADLINE_EXCEEDED) after
        ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AgentCallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"not SERVING within {timeout_s:g} s", self.address,
                                     "Health/Check")
            # wait_for_ready: the call waits for the connection instead of failing at once
            # while the agent is not listening yet.
            if self._check(min(remaining, 1.0), wait_for_ready=True):
                return
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["AgentCallError", "AgentClient"]

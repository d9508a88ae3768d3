"""The agent's gRPC server: the wire side of the in-process agent.

Each training process runs one agent. This module owns everything between the network and the
training logic: it checks each request (field by field, before the training side sees it),
applies the proto's defaults, hands the call to a :class:`Control` object (the training side,
which does the work of Prepare/Commit/Abort/Status), and turns the outcome into a response or
a gRPC status code. It also serves the standard ``grpc.health.v1`` service and wires in the
caller authentication of :mod:`dynatrain.agent.auth`.

Because the agent lives inside the trainer, a bad request must never hurt training: RPCs run
on the server's own thread pool (never on the training thread), every exception of the control
is turned into a status (INTERNAL for unexpected ones), and a payload that is not a valid
protobuf is answered with INVALID_ARGUMENT rather than gRPC's default INTERNAL/UNKNOWN. For the
latter the service is registered with handlers that take the raw request bytes and parse them
themselves (see :func:`agent_method_handlers`), since a deserializer that raises can only yield
INTERNAL.

**What the agent answers** (:data:`ANSWER_CODES`; the proto's header lists the same). Any other
code, INTERNAL and UNKNOWN included, is a bug of the agent:

=====================  ==========================================================================
OK                     the call did what it asks
INVALID_ARGUMENT       a malformed request: a payload that is not the method's message, a field
                       over its bound (:data:`MAX_WORLD` devices, :data:`MAX_TEXT` characters,
                       :data:`MAX_TIMEOUT_S`, :data:`MAX_STAGING_BYTES`,
                       :data:`MAX_DEVICES_PER_NODE`), a layout the devices do not match, a
                       checkpoint path outside the worker's checkpoint roots
FAILED_PRECONDITION    the agent's state does not allow the call (stale generation, nothing
                       prepared, left/failed/finished, store unreachable)
UNAUTHENTICATED        no or wrong bearer token
PERMISSION_DENIED      the TLS client certificate does not name the allowed caller
                       (``--tls-client-name``), or the rendezvous store of a Prepare is not on
                       the caller's own address (nor an ``--allow-rendezvous`` host)
RESOURCE_EXHAUSTED     every call slot is taken, the server's concurrent-call bound is reached,
                       or the message is larger than :data:`MAX_MESSAGE_BYTES`
ABORTED                the switch failed on some device and was rolled back or abandoned
DEADLINE_EXCEEDED      a Commit did not complete within its timeout (or the caller's deadline)
UNIMPLEMENTED          an unknown method (asked with valid credentials), Health/Watch
=====================  ==========================================================================

The health service adds its own NOT_FOUND (outside :data:`ANSWER_CODES`): a Health/Check of a
service name it does not know, as the standard health protocol says.

A refused TLS handshake (no client certificate, one of another CA) is not an answer: the caller
sees UNAVAILABLE from its own side.

**Capacity.** Agent calls take one of ``max_workers`` slots; the thread pool has
:data:`HEALTH_THREADS` more, so a health check is answered even while every slot holds a long
Commit, and a call that finds no slot free is refused at once with RESOURCE_EXHAUSTED. gRPC
itself refuses calls beyond ``maximum_concurrent_rpcs`` (rather than queueing them without end)
and messages over :data:`MAX_MESSAGE_BYTES`. With ``health_port``, a second plaintext server
answers the health service and nothing else, on its own threads: the kubelet's gRPC probe cannot
present a client certificate to the TLS port.

**Where the parts live.** This module holds the :class:`Control` interface, the servicer
(:class:`AgentServicer`) and :func:`serve`. The request checks, with the bounds and defaults of
the fields, are :mod:`dynatrain.agent.requests`; the errors (:class:`AgentError` and its
subclasses) are :mod:`dynatrain.agent.errors`; the gRPC plumbing (the raw-bytes method
handlers, :class:`CallSlots`, the health service, :class:`AgentServer`) is
:mod:`dynatrain.agent.serving`. The names other modules import from here are re-exported.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Protocol, runtime_checkable

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health

from . import auth
from .errors import (AgentError, CommitTimeout, InvalidRequest, PermissionDenied,
                     PreconditionFailed, SwitchAborted)
from .requests import (DEFAULT_COMMIT_TIMEOUT_S, DEFAULT_DEVICES_PER_NODE,
                       DEFAULT_PREPARE_TIMEOUT_S, MAX_DEVICES_PER_NODE, MAX_NODE_NAME,
                       MAX_STAGING_BYTES, MAX_TEXT, MAX_TIMEOUT_S, MAX_WORLD, PrepareArgs,
                       Recovery, check_abort, check_checkpoint, check_commit, check_prepare,
                       check_rendezvous, check_rendezvous_owner, peer_host)
from .serving import (HEALTH_SERVICE, SERVICE_NAME, AgentServer, CallSlots, _add_health, _bind,
                      bracket_host, _options, agent_method_handlers, health_method_handlers)
from .v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 20
"""Largest request gRPC accepts (``grpc.max_receive_message_length``; 1 MiB, where gRPC's
default is 4 MiB): MAX_WORLD devices take under 200 KiB, and a bigger message is refused by
gRPC with RESOURCE_EXHAUSTED before it is parsed."""
MAX_DETAILS = 2000
"""Longest status details sent back (a client's metadata limit is 8 KiB by default)."""
HEALTH_THREADS = 4
"""Threads of the pool beyond the Agent call slots: health checks' own capacity."""
HEALTH_PORT_THREADS = 2
"""Threads of the separate plaintext health server (``health_port``)."""

ANSWER_CODES = frozenset({
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNIMPLEMENTED,
})
"""The gRPC codes the agent answers with (see the module's docstring); anything else is a bug."""


# ----------------------------------------------------------------------------------------------
# The training side's interface


@runtime_checkable
class Control(Protocol):
    """What the agent's server needs from the training side.

    The server calls these from its own worker threads, possibly several at a time (a Status
    while a Commit waits), so an implementation must be thread-safe. Arguments arrive checked
    and with the proto's defaults applied. To refuse a call, raise :class:`AgentError` (or one
    of its subclasses); any other exception is answered with INTERNAL and logged.
    """

    def prepare(self, args: PrepareArgs) -> None:
        """Start preparing ``args.generation`` (newer than any this agent has seen) in the
        background; ``args`` is the checked request (:class:`PrepareArgs`), as it arrived.

        Must return at once; Status reports ``prepared_ready`` (or ``prepared_error``) later.
        ``args.devices[r]`` is the device of rank ``r`` in ``args.layout`` (``len ==
        layout.world``, unique), ``args.rendezvous`` is ``host:port``, ``args.timeout_s``
        bounds every wait of the generation's groups. ``args.reason`` labels the switch's
        metrics; ``args.old_layout`` (its devices bound) is the world the switch starts from,
        None for the job's first one. ``args.recovery`` (with ``old_layout``) abandons the
        running generation and starts from the in-memory snapshots; ``args.checkpoint``
        (without ``old_layout``) starts from a DCP checkpoint.
        """
        ...

    def commit(self, generation: int, at_step: int,
               timeout_s: float) -> agent_pb2.CommitResponse:
        """Switch to the prepared ``generation`` at step ``at_step`` (0: the first boundary
        every old device agrees on); block until the switch happened and return its report.
        Raise :class:`CommitTimeout` after ``timeout_s`` and :class:`SwitchAborted` on failure.
        """
        ...

    def abort(self, generation: int, reason: str) -> bool:
        """Drop the prepared ``generation``; False when nothing was prepared for it."""
        ...

    def write_checkpoint(self, generation: int, stop: bool,
                   timeout_s: float) -> agent_pb2.CheckpointResponse:
        """Write a checkpoint of the running ``generation`` at the first step boundary every
        rank agrees on; with ``stop``, train no further (SUSPENDED). Block until it is whole
        and return where it is; raise :class:`CommitTimeout` after ``timeout_s``."""
        ...

    def status(self, since_step: int) -> agent_pb2.StatusResponse:
        """The agent's state, with the step records after ``since_step``."""
        ...


# ----------------------------------------------------------------------------------------------
# The servicer


class AgentServicer(agent_pb2_grpc.AgentServicer):
    """Checks each request and delegates it to ``control``; errors become status codes.

    Usable with the generated ``add_AgentServicer_to_server`` too, but :func:`serve` registers
    it through :func:`agent_method_handlers` so that undecodable payloads get INVALID_ARGUMENT.
    """

    def __init__(self, control: Control, *, allow_rendezvous: Iterable[str] = ()):
        self.control = control
        self.allow_rendezvous = tuple(allow_rendezvous)
        """Rendezvous hosts accepted beside the caller's own address (``--allow-rendezvous``)."""

    def _run(self, method: str, context: grpc.ServicerContext, call: Callable[[], Message],
             response_type: type[Message]) -> Message:
        """Run ``call``; map its exceptions to a status and abort the RPC with it.

        ``context.abort`` raises, so it is called outside the ``try``: the exception it raises
        must reach gRPC and not be caught here and turned into INTERNAL.
        """
        try:
            response = call()
            if not isinstance(response, response_type):
                raise TypeError(f"the control returned {type(response).__name__}, "
                                f"expected {response_type.__name__}")
            return response
        except AgentError as e:
            code, details = e.code, e.message or str(e) or type(e).__name__
            if code == grpc.StatusCode.OK:  # an error must not look like success
                code = grpc.StatusCode.UNKNOWN
        except Exception as e:
            # Logged with its traceback here; the caller gets the text. The training process
            # carries on: this thread belongs to the gRPC pool.
            log.exception("agent %s failed unexpectedly", method)
            code, details = grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
        if len(details) > MAX_DETAILS:    # trailers beyond the client's metadata limit fail
            details = details[:MAX_DETAILS - 20] + f"... ({len(details)} chars)"
        context.abort(code, details)

    def Prepare(self, request, context):
        def call():
            a = check_prepare(request)
            if (why := check_rendezvous_owner(a.rendezvous, context.peer(),
                                              self.allow_rendezvous)) is not None:
                raise PermissionDenied(why)
            self.control.prepare(a)
            return agent_pb2.PrepareResponse(generation=a.generation)
        return self._run("Prepare", context, call, agent_pb2.PrepareResponse)

    def Commit(self, request, context):
        def call():
            return self.control.commit(*check_commit(request))
        return self._run("Commit", context, call, agent_pb2.CommitResponse)

    def Abort(self, request, context):
        def call():
            generation, reason = check_abort(request)
            return agent_pb2.AbortResponse(aborted=bool(self.control.abort(generation, reason)))
        return self._run("Abort", context, call, agent_pb2.AbortResponse)

    def Checkpoint(self, request, context):
        def call():
            return self.control.write_checkpoint(*check_checkpoint(request))
        return self._run("Checkpoint", context, call, agent_pb2.CheckpointResponse)

    def Status(self, request, context):
        return self._run("Status", context, lambda: self.control.status(request.since_step),
                         agent_pb2.StatusResponse)


# ----------------------------------------------------------------------------------------------
# Serving


def serve(control: Control, *, host: str = "127.0.0.1", port: int = 0,
          token_file: str | os.PathLike | None = None, tls: auth.TlsFiles | None = None,
          tls_dir: str | os.PathLike | None = None, client_name: str | None = None,
          health_port: int | None = None, allow_rendezvous: Iterable[str] = (),
          max_workers: int = 8, insecure: bool = False) -> AgentServer:
    """Start the agent's gRPC server on ``host:port`` (0: any free port) and return it.

    Callers must authenticate with the bearer token in ``token_file``, with a client
    certificate, or both. Mutual TLS comes from ``tls`` (fixed files) or ``tls_dir``
    (``tls.crt``, ``tls.key``, ``client-ca.crt``, re-read when they change); with
    ``client_name`` the caller's certificate must carry that name (subject CN or a SAN).
    Serving without a token or TLS needs ``insecure=True``, for local runs and tests only.

    ``max_workers`` Agent calls run at once (a Commit holds one while it waits); more are
    refused with RESOURCE_EXHAUSTED, and the pool's :data:`HEALTH_THREADS` further threads
    keep health checks answered. ``health_port`` (None or 0: none; use a fixed port, as the
    kubelet's probe needs one) serves the health service alone, in plaintext, on its own
    threads. A Prepare's rendezvous must be on the caller's address or in
    ``allow_rendezvous``.
    """
    if tls is not None and tls_dir is not None:
        raise ValueError("pass tls (fixed files) or tls_dir (a directory re-read when it "
                         "changes), not both")
    secure = tls is not None or tls_dir is not None
    if token_file is None and not secure and not insecure:
        raise ValueError("the agent needs caller authentication: pass token_file (a bearer "
                         "token file), tls/tls_dir (mutual TLS) or both; insecure=True serves "
                         "without authentication (local runs and tests only)")
    if client_name is not None and not secure:
        raise ValueError(f"client_name={client_name!r} needs mutual TLS (tls or tls_dir): "
                         "without it no caller presents a certificate")
    if max_workers < 1:
        raise ValueError(f"max_workers={max_workers} is invalid; expected >= 1")
    if health_port is not None and not 0 <= health_port <= 65535:
        raise ValueError(f"health_port={health_port} is invalid; expected 1..65535 (0 or None: "
                         "no separate health port)")
    interceptors = []
    if token_file is not None:
        interceptors.append(auth.BearerTokenInterceptor(token_file))  # raises if unusable
    reloadable = auth.ServerTlsDir(tls_dir) if tls_dir is not None else None
    credentials = (reloadable.credentials() if reloadable is not None
                   else auth.server_credentials(tls) if tls is not None else None)

    slots = CallSlots(max_workers)
    threads = max_workers + HEALTH_THREADS
    pool = futures.ThreadPoolExecutor(max_workers=threads,
                                      thread_name_prefix="dynatrain-agent-rpc")
    # gRPC refuses calls beyond this (RESOURCE_EXHAUSTED) instead of queueing them for the
    # pool without end; room for a burst of health checks and refusals beyond the threads.
    server = grpc.server(pool, interceptors=interceptors, maximum_concurrent_rpcs=4 * threads,
                         options=_options(MAX_MESSAGE_BYTES))
    servicer = AgentServicer(control, allow_rendezvous=allow_rendezvous)
    handlers = agent_method_handlers(servicer, client_name=client_name, slots=slots)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)

    health_servicer = health.HealthServicer()
    _add_health(server, health_servicer)

    bound = _bind(server, f"{bracket_host(host)}:{port}", credentials, pool)
    health_server, health_bound = None, 0
    if health_port:
        # Health alone, plaintext (a probe has no client certificate), its own few threads.
        health_pool = futures.ThreadPoolExecutor(max_workers=HEALTH_PORT_THREADS,
                                                 thread_name_prefix="dynatrain-agent-health")
        health_server = grpc.server(health_pool, maximum_concurrent_rpcs=8 * HEALTH_PORT_THREADS,
                                    options=_options(64 * 1024))
        _add_health(health_server, health_servicer)
        try:
            health_bound = _bind(health_server, f"{bracket_host(host)}:{health_port}", None,
                                 health_pool)
        except OSError:
            pool.shutdown(wait=False)
            raise
        health_server.start()
    server.start()
    result = AgentServer(server, health_servicer, host, bound, health_server, health_bound,
                         slots, reloadable)
    result.set_health(True)
    log.info("agent serving on %s (%s)%s", result.address,
             " + ".join(n for n, on in (("bearer token", token_file is not None),
                                        ("mutual TLS", secure)) if on) or "insecure",
             f", health on {result.health_address}" if health_bound else "")
    return result


__all__ = [
    "ANSWER_CODES",
    "MAX_DEVICES_PER_NODE",
    "MAX_MESSAGE_BYTES",
    "MAX_STAGING_BYTES",
    "MAX_TEXT",
    "MAX_TIMEOUT_S",
    "MAX_WORLD",
    "SERVICE_NAME",
    "CallSlots",
    "PermissionDenied",
    "AgentError",
    "AgentServer",
    "AgentServicer",
    "CommitTimeout",
    "Control",
    "InvalidRequest",
    "PreconditionFailed",
    "PrepareArgs",
    "SwitchAborted",
    "agent_method_handlers",
    "check_abort",
    "check_checkpoint",
    "check_commit",
    "check_prepare",
    "check_rendezvous",
    "check_rendezvous_owner",
    "peer_host",
    "serve",
    # Defined here before the split too (now in requests and serving), re-exported.
    "DEFAULT_COMMIT_TIMEOUT_S",
    "DEFAULT_DEVICES_PER_NODE",
    "DEFAULT_PREPARE_TIMEOUT_S",
    "HEALTH_SERVICE",
    "MAX_NODE_NAME",
    "Recovery",
    "health_method_handlers",
]

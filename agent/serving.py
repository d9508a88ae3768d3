"""The gRPC plumbing under :func:`~dynatrain.agent.server.serve`: handlers, slots, health.

:func:`agent_method_handlers` registers the Agent service with handlers that parse the request
bytes themselves (so a payload that is not the method's message gets INVALID_ARGUMENT, not
gRPC's INTERNAL), check the caller's certificate name and take one of the :class:`CallSlots`;
:func:`health_method_handlers` serves the standard health service's Check (and refuses Watch);
:class:`AgentServer` is the running server that :func:`~dynatrain.agent.server.serve` returns,
and ``_options``/``_bind`` set up its ports. This was part of :mod:`dynatrain.agent.server`,
which re-exports the public names.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2

from . import auth
from .v1 import agent_pb2

if TYPE_CHECKING:
    from .server import AgentServicer

# Under the agent server's name, as before this module was split out of it.
log = logging.getLogger("dynatrain.agent.server")

SERVICE_NAME = agent_pb2.DESCRIPTOR.services_by_name["Agent"].full_name  # dynatrain.agent.v1.Agent


# (method name, request class, response class) of the Agent service, read from the proto so
# that a method added there cannot be forgotten here (the servicer must then implement it).
_METHODS = tuple(
    (m.name, getattr(agent_pb2, m.input_type.name), getattr(agent_pb2, m.output_type.name))
    for m in agent_pb2.DESCRIPTOR.services_by_name["Agent"].methods)


class CallSlots:
    """A bound on the Agent calls in flight: :meth:`take` gives a slot or refuses at once.

    Refusing rather than waiting keeps a flood (or many long Commits) from queueing without
    end on the server's pool, whose remaining threads stay free for health checks.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"call slots={limit} is invalid; expected >= 1")
        self.limit = limit
        self.in_flight = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.in_flight >= self.limit:
                return False
            self.in_flight += 1
            return True

    def give(self) -> None:
        with self._lock:
            self.in_flight -= 1


def agent_method_handlers(servicer: AgentServicer, *, client_name: str | None = None,
                          slots: CallSlots | None = None) -> dict[str, grpc.RpcMethodHandler]:
    """Unary handlers of the Agent service that parse the request bytes themselves.

    gRPC turns an exception in a request deserializer into INTERNAL; by registering no
    deserializer and parsing inside the handler, a payload that is not the method's message
    is answered with INVALID_ARGUMENT, like any other malformed request. Before that, in this
    order: with ``client_name``, the caller's TLS certificate must name it (else
    PERMISSION_DENIED; the bearer token, if any, was checked by the interceptor already); with
    ``slots``, the call takes a slot or is refused with RESOURCE_EXHAUSTED.
    """
    handlers = {}
    for name, request_type, response_type in _METHODS:
        behaviour = getattr(servicer, name)

        # Defaults bind this iteration's values (a plain closure would see the last ones).
        def handle(payload: bytes, context, *, _type=request_type, _behaviour=behaviour,
                   _name=name):
            if client_name is not None:
                problem = auth.client_name_problem(context.auth_context(), client_name)
                if problem is not None:
                    log.warning("refused %s from %s: %s", _name, context.peer(), problem)
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)
            if slots is not None and not slots.take():
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{slots.in_flight} agent calls are in flight, the most this "
                              f"agent runs at once ({slots.limit}); retry later")
            try:
                try:
                    request = _type.FromString(payload)
                except DecodeError as e:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"the payload ({len(payload)} bytes) is not a valid "
                                  f"{_type.DESCRIPTOR.full_name}: {e}")
                return _behaviour(request, context)
            finally:
                if slots is not None:
                    slots.give()

        handlers[name] = grpc.unary_unary_rpc_method_handler(
            handle, request_deserializer=None,
            response_serializer=response_type.SerializeToString)
    return handlers


# ----------------------------------------------------------------------------------------------
# The server


class AgentServer:
    """A running agent server (returned by :func:`serve`)."""

    def __init__(self, server: grpc.Server, health_servicer: health.HealthServicer,
                 host: str, port: int, health_server: grpc.Server | None = None,
                 health_port: int = 0, slots: CallSlots | None = None,
                 tls_dir: auth.ServerTlsDir | None = None):
        self._server = server
        self._health = health_servicer
        self._health_server = health_server
        self.host = host
        self.port = port
        self.health_port = health_port
        """The plaintext health-only port (0: none)."""
        self.slots = slots
        self.tls_dir = tls_dir
        """The reloadable TLS files, when serving from a directory."""

    @property
    def address(self) -> str:
        """``host:port`` to dial (IPv6 hosts in brackets)."""
        return f"{bracket_host(self.host)}:{self.port}"

    @property
    def health_address(self) -> str | None:
        """``host:port`` of the plaintext health port, or None without one."""
        return f"{bracket_host(self.host)}:{self.health_port}" if self.health_port else None

    def set_health(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING, for the whole server and the Agent service."""
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            self._health.set(service, status)

    def stop(self, grace: float | None = None) -> None:
        """Stop serving: health reports NOT_SERVING, then calls get ``grace`` seconds to end."""
        self._health.enter_graceful_shutdown()
        stopping = [self._server.stop(grace)]
        if self._health_server is not None:
            stopping.append(self._health_server.stop(grace))
        for event in stopping:
            event.wait()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout)

    def __enter__(self) -> AgentServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop(0)


def bracket_host(host: str) -> str:
    """``host`` as it goes before ``:port`` in an address (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


HEALTH_SERVICE = "grpc.health.v1.Health"


def health_method_handlers(servicer: health.HealthServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The standard health service as the agent serves it: Check, parsed by the handler (so a
    payload that is not a HealthCheckRequest gets INVALID_ARGUMENT, not gRPC's INTERNAL), and
    Watch refused with UNIMPLEMENTED: a Watch stream holds a server thread for as long as the
    caller likes, and the service needs no credentials, so a few of them would take the
    threads kept for health checks. Probes (the kubelet's, :class:`AgentClient`'s) poll Check.
    """
    def check(payload: bytes, context):
        try:
            request = health_pb2.HealthCheckRequest.FromString(payload)
        except DecodeError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the payload ({len(payload)} bytes) is not a valid "
                          f"grpc.health.v1.HealthCheckRequest: {e}")
        return servicer.Check(request, context)

    def watch(payload: bytes, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED,
                      "the agent does not serve Health/Watch (it would hold a thread per "
                      "caller); poll Health/Check")

    return {
        "Check": grpc.unary_unary_rpc_method_handler(
            check, response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
        "Watch": grpc.unary_stream_rpc_method_handler(
            watch, response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
    }


def _add_health(server: grpc.Server, servicer: health.HealthServicer) -> None:
    handlers = health_method_handlers(servicer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(HEALTH_SERVICE, handlers),))
    server.add_registered_method_handlers(HEALTH_SERVICE, handlers)


def _options(max_message_bytes: int) -> list[tuple[str, object]]:
    return [
        # Without this, Linux lets a second server bind the same port silently and the two
        # share its calls; an agent must own its port.
        ("grpc.so_reuseport", 0),
        # Stated, not left to gRPC's default (4 MiB): a bigger request is refused with
        # RESOURCE_EXHAUSTED before any of it is parsed.
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def _bind(server: grpc.Server, bind: str, credentials, pool) -> int:
    try:
        bound = (server.add_secure_port(bind, credentials) if credentials is not None
                 else server.add_insecure_port(bind))
    except RuntimeError as e:
        bound, reason = 0, str(e)
    else:
        reason = "the address is in use or not local"
    if not bound:
        pool.shutdown(wait=False)
        raise OSError(f"the agent cannot listen on {bind}: {reason}")
    return bound

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
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dynatrain.vps.layout import Layout, LayoutError, parse_layout

from . import auth
from .v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = agent_pb2.DESCRIPTOR.services_by_name["Agent"].full_name  # dynatrain.agent.v1.Agent

# Defaults that a zero field stands for (see the proto's comments).
DEFAULT_DEVICES_PER_NODE = 8
DEFAULT_STAGING_BYTES = 256 * 1024 * 1024
DEFAULT_PREPARE_TIMEOUT_S = 60.0
DEFAULT_COMMIT_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------------------------
# Errors the control raises


class AgentError(Exception):
    """A rule of the agent's protocol was broken; ``code`` is the gRPC status to answer with.

    The control raises it (or a subclass) for anything the caller should learn about; the
    message becomes the status details, so it should name the value and what would be valid.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, code: grpc.StatusCode | None = None, message: str = ""):
        # Allow both AgentError(code, message) and Subclass(message).
        if isinstance(code, str) and not message:
            code, message = None, code
        if code is not None:
            self.code = code
        super().__init__(message)
        self.message = message


class PreconditionFailed(AgentError):
    """Wrong state for the call (busy, nothing prepared, stale or skipped generation)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class InvalidRequest(AgentError):
    """A request that is well-formed but does not fit this agent (e.g. a device it lacks)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class SwitchAborted(AgentError):
    """The switch failed on some device and was rolled back or abandoned."""

    code = grpc.StatusCode.ABORTED


class CommitTimeout(AgentError):
    """The Commit did not complete within its timeout."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


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

    def prepare(self, generation: int, layout: Layout, devices: tuple[int, ...],
                rendezvous: str, devices_per_node: int, staging_bytes: int,
                timeout_s: float, *, reason: str = "", old_layout: Layout | None = None,
                recovery: Recovery | None = None, checkpoint: str = "") -> None:
        """Start preparing ``generation`` (newer than any this agent has seen) in the background.

        Must return at once; Status reports ``prepared_ready`` (or ``prepared_error``) later.
        ``devices[r]`` is the device of rank ``r`` in ``layout`` (``len == layout.world``,
        unique), ``rendezvous`` is ``host:port``, ``timeout_s`` bounds every wait of the
        generation's groups. ``reason`` labels the switch's metrics; ``old_layout`` (its
        devices bound) is the world the switch starts from, None for the job's first one.
        ``recovery`` (with ``old_layout``) abandons the running generation and starts from
        the in-memory snapshots; ``checkpoint`` (without ``old_layout``) starts from a DCP
        checkpoint.
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

    def status(self, since_step: int) -> agent_pb2.StatusResponse:
        """The agent's state, with the step records after ``since_step``."""
        ...


# ----------------------------------------------------------------------------------------------
# Request checks


def _finite_timeout(field: str, value: float, default: float, problems: list[str]) -> float:
    if not math.isfinite(value) or value < 0:
        problems.append(f"{field}={value!r} is invalid; expected a finite number of seconds "
                        f">= 0 (0 means the default, {default:g} s)")
        return default
    return value if value > 0 else default


def _generation(value: int, problems: list[str]) -> None:
    if value < 1:
        problems.append(f"generation={value} is invalid; generations start at 1 (Prepare "
                        "names the agent's current generation + 1)")


def check_rendezvous(text: str) -> str | None:
    """Why ``text`` is not a valid ``host:port`` (IPv6 hosts in brackets), or None."""
    hint = "expected host:port with port 1..65535, e.g. 'worker-0:29500' or '[fd00::1]:29500'"
    if not text:
        return f"rendezvous is empty; {hint}"
    if text != text.strip() or any(c.isspace() for c in text):
        return f"rendezvous={text!r} contains whitespace; {hint}"
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        return f"rendezvous={text!r} has no {'port' if not sep else 'host'}; {hint}"
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            return f"rendezvous={text!r} has an unclosed or empty IPv6 bracket; {hint}"
    elif ":" in host:
        return f"rendezvous={text!r}: an IPv6 host must be in brackets; {hint}"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"rendezvous={text!r} has port {port!r}; {hint}"
    return None


@dataclass(frozen=True)
class PrepareArgs:
    """A checked PrepareRequest with the defaults applied (the control's arguments)."""

    generation: int
    layout: Layout
    devices: tuple[int, ...]
    rendezvous: str
    devices_per_node: int
    staging_bytes: int
    timeout_s: float
    reason: str = ""
    old_layout: Layout | None = None
    """With its devices; None for the job's first generation."""
    recovery: Recovery | None = None
    checkpoint: str = ""


@dataclass(frozen=True)
class Recovery:
    """A Prepare that recovers from an unplanned failure (see the proto's PrepareRequest)."""

    restore_step: int
    failed: frozenset[int]
    proxies: dict[int, int]


def check_prepare(req: agent_pb2.PrepareRequest) -> PrepareArgs:
    """Check every field of ``req``; :class:`InvalidRequest` lists all problems at once."""
    problems: list[str] = []
    _generation(req.generation, problems)
    layout = None
    try:
        layout = parse_layout(req.layout)
    except LayoutError as e:
        problems.append(f"layout: {e}")
    devices = tuple(req.devices)
    if layout is not None and len(devices) != layout.world:
        problems.append(f"devices lists {len(devices)} devices {list(devices)}, but layout "
                        f"{req.layout!r} has world size {layout.world} (dp*tp*pp); give one "
                        "device per rank")
    duplicates = sorted({d for d in devices if devices.count(d) > 1})
    if duplicates:
        problems.append(f"devices {list(devices)} repeats {duplicates}; each rank needs its "
                        "own device")
    if (why := check_rendezvous(req.rendezvous)) is not None:
        problems.append(why)
    timeout_s = _finite_timeout("timeout_seconds", req.timeout_seconds,
                                DEFAULT_PREPARE_TIMEOUT_S, problems)
    old = None
    old_devices = tuple(req.old_devices)
    if req.old_layout:
        try:
            old = parse_layout(req.old_layout)
        except LayoutError as e:
            problems.append(f"old_layout: {e}")
        if old is not None and len(old_devices) != old.world:
            problems.append(f"old_devices lists {len(old_devices)} devices "
                            f"{list(old_devices)}, but old_layout {req.old_layout!r} has world "
                            f"size {old.world}")
        elif len(set(old_devices)) != len(old_devices):
            problems.append(f"old_devices {list(old_devices)} repeats a device")
        elif old is not None:
            old = old.with_devices(old_devices)
    elif old_devices:
        problems.append(f"old_devices {list(old_devices)} given without old_layout")
    recovery = _check_recovery(req, old_devices, devices, problems)
    if req.checkpoint and req.old_layout:
        problems.append(f"checkpoint {req.checkpoint!r} given with old_layout "
                        f"{req.old_layout!r}: a generation starts from a checkpoint or from "
                        "the old world's state, not both")
    if problems:
        raise InvalidRequest("; ".join(problems))
    return PrepareArgs(
        generation=req.generation, layout=layout, devices=devices, rendezvous=req.rendezvous,
        devices_per_node=req.devices_per_node or DEFAULT_DEVICES_PER_NODE,
        staging_bytes=req.staging_bytes or DEFAULT_STAGING_BYTES, timeout_s=timeout_s,
        reason=req.reason, old_layout=old, recovery=recovery, checkpoint=req.checkpoint)


def _check_recovery(req, old_devices: tuple[int, ...], devices: tuple[int, ...],
                    problems: list[str]) -> Recovery | None:
    failed = frozenset(req.failed_devices)
    proxies = dict(req.proxies)
    if not req.recover:
        if failed or proxies or req.restore_step:
            problems.append("failed_devices, proxies and restore_step need recover=true")
        return None
    if not req.old_layout:
        problems.append("recover=true needs old_layout (the generation that failed)")
    if bad := sorted(failed - set(old_devices)):
        problems.append(f"failed_devices {bad} are not devices of old_layout "
                        f"{list(old_devices)}")
    if bad := sorted(failed & set(devices)):
        problems.append(f"failed_devices {bad} cannot be devices of the new layout")
    for dead, proxy in sorted(proxies.items()):
        if dead not in failed:
            problems.append(f"proxies names device {dead}, which is not in failed_devices "
                            f"{sorted(failed)}")
        if proxy in failed or proxy not in set(old_devices) | set(devices):
            problems.append(f"proxy {proxy} of device {dead} must be a live device of the "
                            "old or new layout")
    return Recovery(req.restore_step, failed, proxies)


def check_commit(req: agent_pb2.CommitRequest) -> tuple[int, int, float]:
    """(generation, at_step, timeout_s) of a checked CommitRequest."""
    problems: list[str] = []
    _generation(req.generation, problems)
    # at_step is a uint64 on the wire, so it is always >= 0; 0 means "first agreed boundary".
    timeout_s = _finite_timeout("timeout_seconds", req.timeout_seconds,
                                DEFAULT_COMMIT_TIMEOUT_S, problems)
    if problems:
        raise InvalidRequest("; ".join(problems))
    return req.generation, req.at_step, timeout_s


def check_abort(req: agent_pb2.AbortRequest) -> tuple[int, str]:
    problems: list[str] = []
    _generation(req.generation, problems)
    if problems:
        raise InvalidRequest("; ".join(problems))
    return req.generation, req.reason


# ----------------------------------------------------------------------------------------------
# The servicer


class AgentServicer(agent_pb2_grpc.AgentServicer):
    """Checks each request and delegates it to ``control``; errors become status codes.

    Usable with the generated ``add_AgentServicer_to_server`` too, but :func:`serve` registers
    it through :func:`agent_method_handlers` so that undecodable payloads get INVALID_ARGUMENT.
    """

    def __init__(self, control: Control):
        self.control = control

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
        context.abort(code, details)

    def Prepare(self, request, context):
        def call():
            a = check_prepare(request)
            self.control.prepare(a.generation, a.layout, a.devices, a.rendezvous,
                                 a.devices_per_node, a.staging_bytes, a.timeout_s,
                                 reason=a.reason, old_layout=a.old_layout,
                                 recovery=a.recovery, checkpoint=a.checkpoint)
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

    def Status(self, request, context):
        return self._run("Status", context, lambda: self.control.status(request.since_step),
                         agent_pb2.StatusResponse)


# (method name, request class, response class) of the Agent service, read from the proto so
# that a method added there cannot be forgotten here (the servicer must then implement it).
_METHODS = tuple(
    (m.name, getattr(agent_pb2, m.input_type.name), getattr(agent_pb2, m.output_type.name))
    for m in agent_pb2.DESCRIPTOR.services_by_name["Agent"].methods)


def agent_method_handlers(servicer: AgentServicer) -> dict[str, grpc.RpcMethodHandler]:
    """Unary handlers of the Agent service that parse the request bytes themselves.

    gRPC turns an exception in a request deserializer into INTERNAL; by registering no
    deserializer and parsing inside the handler, a payload that is not the method's message
    is answered with INVALID_ARGUMENT, like any other malformed request.
    """
    handlers = {}
    for name, request_type, response_type in _METHODS:
        behaviour = getattr(servicer, name)

        # Defaults bind this iteration's values (a plain closure would see the last ones).
        def handle(payload: bytes, context, *, _type=request_type, _behaviour=behaviour):
            try:
                request = _type.FromString(payload)
            except DecodeError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the payload ({len(payload)} bytes) is not a valid "
                              f"{_type.DESCRIPTOR.full_name}: {e}")
            return _behaviour(request, context)

        handlers[name] = grpc.unary_unary_rpc_method_handler(
            handle, request_deserializer=None,
            response_serializer=response_type.SerializeToString)
    return handlers


# ----------------------------------------------------------------------------------------------
# The server


class AgentServer:
    """A running agent server (returned by :func:`serve`)."""

    def __init__(self, server: grpc.Server, health_servicer: health.HealthServicer,
                 host: str, port: int):
        self._server = server
        self._health = health_servicer
        self.host = host
        self.port = port

    @property
    def address(self) -> str:
        """``host:port`` to dial (IPv6 hosts in brackets)."""
        return f"{_bracket(self.host)}:{self.port}"

    def set_health(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING, for the whole server and the Agent service."""
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            self._health.set(service, status)

    def stop(self, grace: float | None = None) -> None:
        """Stop serving: health reports NOT_SERVING, then calls get ``grace`` seconds to end."""
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout)

    def __enter__(self) -> AgentServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop(0)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def serve(control: Control, *, host: str = "127.0.0.1", port: int = 0,
          token_file: str | os.PathLike | None = None, tls: auth.TlsFiles | None = None,
          max_workers: int = 8, insecure: bool = False) -> AgentServer:
    """Start the agent's gRPC server on ``host:port`` (0: any free port) and return it.

    Callers must authenticate with the bearer token in ``token_file``, with a client
    certificate (``tls``: the server's cert/key and the CA of its clients), or both. Serving
    without either needs ``insecure=True``, for local runs and tests only. RPCs run on a pool
    of ``max_workers`` threads; a Commit holds one of them while it waits.
    """
    if token_file is None and tls is None and not insecure:
        raise ValueError("the agent needs caller authentication: pass token_file (a bearer "
                         "token file), tls (mutual TLS files) or both; insecure=True serves "
                         "without authentication (local runs and tests only)")
    if max_workers < 1:
        raise ValueError(f"max_workers={max_workers} is invalid; expected >= 1")
    interceptors = []
    if token_file is not None:
        interceptors.append(auth.BearerTokenInterceptor(token_file))  # raises if unusable
    credentials = auth.server_credentials(tls) if tls is not None else None

    pool = futures.ThreadPoolExecutor(max_workers=max_workers,
                                      thread_name_prefix="dynatrain-agent-rpc")
    server = grpc.server(
        pool, interceptors=interceptors,
        # Without this, Linux lets a second server bind the same port silently and the two
        # share its calls; an agent must own its port.
        options=[("grpc.so_reuseport", 0)])
    servicer = AgentServicer(control)
    handlers = agent_method_handlers(servicer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)

    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    bind = f"{_bracket(host)}:{port}"
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
    server.start()
    result = AgentServer(server, health_servicer, host, bound)
    result.set_health(True)
    log.info("agent serving on %s (%s)", result.address,
             " + ".join(n for n, on in (("bearer token", token_file is not None),
                                        ("mutual TLS", tls is not None)) if on) or "insecure")
    return result


__all__ = [
    "SERVICE_NAME",
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
    "check_commit",
    "check_prepare",
    "check_rendezvous",
    "serve",
]

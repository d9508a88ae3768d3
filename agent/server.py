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
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import math
import os
import re
import socket
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2

from dynatrain.vps.layout import Layout, LayoutError, parse_layout
from dynatrain.vps.rounds import DEFAULT_STAGING_BYTES

from . import auth
from .v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = agent_pb2.DESCRIPTOR.services_by_name["Agent"].full_name  # dynatrain.agent.v1.Agent

# Defaults that a zero field stands for (see the proto's comments).
DEFAULT_DEVICES_PER_NODE = 8
DEFAULT_PREPARE_TIMEOUT_S = 60.0
DEFAULT_COMMIT_TIMEOUT_S = 120.0

# Upper bounds of a request's fields. Every check is linear in the request's size, and these
# come first, so that a huge request costs little before it is refused.
MAX_TIMEOUT_S = 3600.0
"""Longest timeout_seconds of a Prepare or Commit (an hour: a switch takes seconds)."""
MAX_STAGING_BYTES = 64 << 30
"""Largest staging budget (64 GiB) a Prepare may ask a device to allocate."""
MAX_DEVICES_PER_NODE = 1024
MAX_NODE_NAME = 253
"""A node's name is a DNS subdomain."""
MAX_WORLD = 65536
"""Most entries of devices, old_devices, failed_devices and proxies."""
MAX_TEXT = 4096
"""Longest layout, old_layout, rendezvous, reason and checkpoint text, in characters."""
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


class PermissionDenied(AgentError):
    """The caller may not ask for this (e.g. a rendezvous store that is not its own)."""

    code = grpc.StatusCode.PERMISSION_DENIED


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
                recovery: Recovery | None = None, checkpoint: str = "",
                nodes: dict[int, str] | None = None) -> None:
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
# Request checks


def _finite_timeout(field: str, value: float, default: float, problems: list[str]) -> float:
    if not math.isfinite(value) or value < 0 or value > MAX_TIMEOUT_S:
        problems.append(f"{field}={value!r} is invalid; expected a finite number of seconds "
                        f"from 0 to {MAX_TIMEOUT_S:g} (MAX_TIMEOUT_S; 0 means the default, "
                        f"{default:g} s)")
        return default
    return value if value > 0 else default


def _ids(values, limit: int = 8) -> str:
    """A list for an error message: at most ``limit`` entries, then '...'."""
    values = list(values[:limit + 1]) if isinstance(values, (list, tuple)) else sorted(values)
    if len(values) <= limit:
        return str(values)
    return f"[{', '.join(map(str, values[:limit]))}, ...]"


def _short(text: str, limit: int = 80) -> str:
    """``text`` quoted for an error message, cut to ``limit`` characters."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} chars)"


def _bounds(fields: Iterable[tuple[str, int, int, str, str]]) -> None:
    """Raise :class:`InvalidRequest` naming every (field, size, limit, unit, constant) over
    its limit."""
    over = [f"{name} has {size} {unit}, over the limit {limit} ({const})"
            for name, size, limit, unit, const in fields if size > limit]
    if over:
        raise InvalidRequest("; ".join(over))


def _text_bounds(**texts: str) -> list[tuple[str, int, int, str, str]]:
    return [(name, len(value), MAX_TEXT, "characters", "MAX_TEXT")
            for name, value in texts.items()]


def _generation(value: int, problems: list[str]) -> None:
    if value < 1:
        problems.append(f"generation={value} is invalid; generations start at 1 (Prepare "
                        "names the agent's current generation + 1)")


# DNS labels of 1..63 letters, digits and '-' (not at either end), joined by dots. One way to
# match any text, so no backtracking blow-up on hostile input.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?", re.ASCII)


def check_rendezvous(text: str) -> str | None:
    """Why ``text`` is not a valid ``host:port`` (IPv6 hosts in brackets), or None. The host
    is an IP address or a DNS name (letters, digits, '-' and '.')."""
    hint = "expected host:port with port 1..65535, e.g. 'worker-0:29500' or '[fd00::1]:29500'"
    if len(text) > MAX_TEXT:
        return f"rendezvous has {len(text)} characters, over the limit {MAX_TEXT} (MAX_TEXT)"
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
    if not (port.isascii() and port.isdigit()) or len(port) > 5 or not 1 <= int(port) <= 65535:
        return f"rendezvous={_short(text)} has port {_short(port)}; {hint}"
    bare = host[1:-1] if host.startswith("[") else host
    if _ip(bare) is None and (host.startswith("[") or not _HOSTNAME.fullmatch(bare)):
        return (f"rendezvous={_short(text)}: host {_short(host)} is neither an IP address nor "
                f"a DNS name; {hint}")
    return None


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an IP address (an IPv4-mapped IPv6 address as its IPv4 one), or None."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def peer_host(peer: str) -> str:
    """The address in gRPC's ``context.peer()`` (``ipv4:10.0.0.5:5555``, ``ipv6:[::1]:5555``),
    or the whole text for another kind (``unix:...``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        host = rest.rpartition(":")[0]
        return host[1:-1] if host.startswith("[") else host
    return peer


def _resolve(host: str) -> set:
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return set()
    return {ip for info in infos if (ip := _ip(info[4][0])) is not None}


def check_rendezvous_owner(rendezvous: str, peer: str,
                           allowed: Iterable[str] = ()) -> str | None:
    """Why a Prepare from ``peer`` (``context.peer()``) may not name the store ``rendezvous``
    (already a valid ``host:port``), or None.

    The store is torch's TCPStore, which authenticates nobody, and a worker builds its
    generation's groups through it: it must be the controller's own. So its host must be the
    caller's address (a DNS name is resolved and compared by address), or one of ``allowed``
    (the worker's ``--allow-rendezvous`` hosts, for NAT or a mesh; compared as written, or as
    addresses when they are IP addresses).
    """
    host = rendezvous.rpartition(":")[0]
    bare = host[1:-1] if host.startswith("[") else host
    caller_text = peer_host(peer)
    caller = _ip(caller_text)
    allowed_texts = {a.strip().strip("[]").lower() for a in allowed if a.strip()}
    if bare.lower() in allowed_texts:
        return None
    ip = _ip(bare)
    addresses = {ip} if ip is not None else _resolve(bare)
    if caller is not None and caller in addresses:
        return None
    allowed_ips = {a for text in allowed_texts if (a := _ip(text)) is not None}
    if addresses & allowed_ips:
        return None
    seen = ("" if ip is not None else
            f" (it resolves to {_ids(sorted(map(str, addresses)))})" if addresses
            else " (it does not resolve)")
    extra = f" or one of --allow-rendezvous {sorted(allowed_texts)}" if allowed_texts else ""
    return (f"rendezvous {_short(rendezvous)}{seen} is not on the caller's own address "
            f"{caller_text!r}{extra}: a Prepare may only name the caller's own rendezvous "
            "store (behind NAT, start the worker with --allow-rendezvous HOST)")


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
    nodes: dict[int, str] = field(default_factory=dict)
    """device -> the node it runs on (``device_nodes`` and ``old_device_nodes``); empty:
    unknown."""


@dataclass(frozen=True)
class Recovery:
    """A Prepare that recovers from an unplanned failure (see the proto's PrepareRequest)."""

    restore_step: int
    failed: frozenset[int]
    proxies: dict[int, int]


def check_prepare(req: agent_pb2.PrepareRequest) -> PrepareArgs:
    """Check every field of ``req``; :class:`InvalidRequest` lists all problems at once.

    Bounds first (each over-long list or text, too large a devices_per_node or staging
    budget), then the rest; every check is linear in the size of the request."""
    _bounds(_text_bounds(layout=req.layout, old_layout=req.old_layout,
                         rendezvous=req.rendezvous, reason=req.reason,
                         checkpoint=req.checkpoint)
            + [(name, len(getattr(req, name)), MAX_WORLD, "entries", "MAX_WORLD")
               for name in ("devices", "old_devices", "failed_devices", "proxies",
                            "device_nodes", "old_device_nodes")]
            + [(name, max(map(len, getattr(req, name)), default=0), MAX_NODE_NAME,
                "characters", "MAX_NODE_NAME")
               for name in ("device_nodes", "old_device_nodes")]
            + [("devices_per_node", req.devices_per_node, MAX_DEVICES_PER_NODE, "devices",
                "MAX_DEVICES_PER_NODE"),
               ("staging_bytes", req.staging_bytes, MAX_STAGING_BYTES, "bytes",
                "MAX_STAGING_BYTES")])
    problems: list[str] = []
    _generation(req.generation, problems)
    layout = None
    try:
        layout = parse_layout(req.layout)
    except LayoutError as e:
        problems.append(f"layout: {e}")
    devices = tuple(req.devices)
    if layout is not None and len(devices) != layout.world:
        problems.append(f"devices lists {len(devices)} devices {_ids(devices)}, but layout "
                        f"{_short(req.layout)} has world size {layout.world} (dp*tp*pp); give "
                        "one device per rank")
    duplicates = sorted(d for d, n in collections.Counter(devices).items() if n > 1)
    if duplicates:
        problems.append(f"devices {_ids(devices)} repeats {_ids(duplicates)}; each rank needs "
                        "its own device")
    if (why := check_rendezvous(req.rendezvous)) is not None:
        problems.append(why)
    nodes = dict(zip(devices, req.device_nodes))
    if req.device_nodes and (len(req.device_nodes) != len(devices)
                             or not all(req.device_nodes)):
        problems.append(f"device_nodes lists {len(req.device_nodes)} node names for "
                        f"{len(devices)} devices (empty ones included); give one per device, "
                        "or none")
    timeout_s = _finite_timeout("timeout_seconds", req.timeout_seconds,
                                DEFAULT_PREPARE_TIMEOUT_S, problems)
    old = None
    old_devices = tuple(req.old_devices)
    if req.old_device_nodes and (len(req.old_device_nodes) != len(old_devices)
                                 or not all(req.old_device_nodes)):
        problems.append(f"old_device_nodes lists {len(req.old_device_nodes)} node names for "
                        f"{len(old_devices)} old devices (empty ones included); give one per "
                        "old device, or none")
    else:
        for d, n in zip(old_devices, req.old_device_nodes):
            if nodes.setdefault(d, n) != n:
                problems.append(f"device {d} is on node {_short(nodes[d])} in device_nodes "
                                f"but on {_short(n)} in old_device_nodes; a device never "
                                "moves")
                break
    if req.old_layout:
        try:
            old = parse_layout(req.old_layout)
        except LayoutError as e:
            problems.append(f"old_layout: {e}")
        if old is not None and len(old_devices) != old.world:
            problems.append(f"old_devices lists {len(old_devices)} devices "
                            f"{_ids(old_devices)}, but old_layout {_short(req.old_layout)} has "
                            f"world size {old.world}")
        elif len(set(old_devices)) != len(old_devices):
            problems.append(f"old_devices {_ids(old_devices)} repeats a device")
        elif old is not None:
            old = old.with_devices(old_devices)
    elif old_devices:
        problems.append(f"old_devices {_ids(old_devices)} given without old_layout")
    recovery = _check_recovery(req, old_devices, devices, problems)
    if req.checkpoint and req.old_layout:
        problems.append(f"checkpoint {_short(req.checkpoint)} given with old_layout "
                        f"{_short(req.old_layout)}: a generation starts from a checkpoint or "
                        "from the old world's state, not both")
    if "\x00" in req.checkpoint:
        problems.append(f"checkpoint {_short(req.checkpoint)} contains a NUL character; "
                        "expected a path")
    if problems:
        raise InvalidRequest("; ".join(problems))
    return PrepareArgs(
        generation=req.generation, layout=layout, devices=devices, rendezvous=req.rendezvous,
        devices_per_node=req.devices_per_node or DEFAULT_DEVICES_PER_NODE,
        staging_bytes=req.staging_bytes or DEFAULT_STAGING_BYTES, timeout_s=timeout_s,
        reason=req.reason, old_layout=old, recovery=recovery, checkpoint=req.checkpoint,
        nodes=nodes)


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
    old_set, new_set = set(old_devices), set(devices)
    if bad := sorted(failed - old_set):
        problems.append(f"failed_devices {_ids(bad)} are not devices of old_layout "
                        f"{_ids(old_devices)}")
    if bad := sorted(failed & new_set):
        problems.append(f"failed_devices {_ids(bad)} cannot be devices of the new layout")
    live = old_set | new_set        # once, not per proxy: linear in the request
    wrong = [(dead, proxy) for dead, proxy in sorted(proxies.items())
             if dead not in failed or proxy in failed or proxy not in live]
    for dead, proxy in wrong[:8]:   # a few named (the details stay short); the count says all
        if dead not in failed:
            problems.append(f"proxies names device {dead}, which is not in failed_devices "
                            f"{_ids(sorted(failed))}")
        if proxy in failed or proxy not in live:
            problems.append(f"proxy {proxy} of device {dead} must be a live device of the "
                            "old or new layout")
    if len(wrong) > 8:
        problems.append(f"{len(wrong)} entries of proxies are wrong in all")
    return Recovery(req.restore_step, failed, proxies)


def _generation_and_timeout(req) -> float:
    """The checks a Commit and a Checkpoint share (a generation, a timeout); the timeout."""
    problems: list[str] = []
    _generation(req.generation, problems)
    timeout_s = _finite_timeout("timeout_seconds", req.timeout_seconds,
                                DEFAULT_COMMIT_TIMEOUT_S, problems)
    if problems:
        raise InvalidRequest("; ".join(problems))
    return timeout_s


def check_commit(req: agent_pb2.CommitRequest) -> tuple[int, int, float]:
    """(generation, at_step, timeout_s) of a checked CommitRequest. at_step is a uint64 on
    the wire, so it is always >= 0; 0 means "first agreed boundary"."""
    return req.generation, req.at_step, _generation_and_timeout(req)


def check_checkpoint(req: agent_pb2.CheckpointRequest) -> tuple[int, bool, float]:
    """(generation, stop, timeout_s) of a checked CheckpointRequest."""
    return req.generation, req.stop, _generation_and_timeout(req)


def check_abort(req: agent_pb2.AbortRequest) -> tuple[int, str]:
    _bounds(_text_bounds(reason=req.reason))
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
            self.control.prepare(a.generation, a.layout, a.devices, a.rendezvous,
                                 a.devices_per_node, a.staging_bytes, a.timeout_s,
                                 reason=a.reason, old_layout=a.old_layout,
                                 recovery=a.recovery, checkpoint=a.checkpoint,
                                 nodes=a.nodes)
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
        return f"{_bracket(self.host)}:{self.port}"

    @property
    def health_address(self) -> str | None:
        """``host:port`` of the plaintext health port, or None without one."""
        return f"{_bracket(self.host)}:{self.health_port}" if self.health_port else None

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


def _bracket(host: str) -> str:
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

    bound = _bind(server, f"{_bracket(host)}:{port}", credentials, pool)
    health_server, health_bound = None, 0
    if health_port:
        # Health alone, plaintext (a probe has no client certificate), its own few threads.
        health_pool = futures.ThreadPoolExecutor(max_workers=HEALTH_PORT_THREADS,
                                                 thread_name_prefix="dynatrain-agent-health")
        health_server = grpc.server(health_pool, maximum_concurrent_rpcs=8 * HEALTH_PORT_THREADS,
                                    options=_options(64 * 1024))
        _add_health(health_server, health_servicer)
        try:
            health_bound = _bind(health_server, f"{_bracket(host)}:{health_port}", None,
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
]

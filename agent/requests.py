"""The agent's request checks: every field of a request, before the training side sees it.

Each ``check_*`` function takes a decoded request of the Agent service, checks each field
against its bound (:data:`MAX_WORLD` entries, :data:`MAX_TEXT` characters,
:data:`MAX_TIMEOUT_S`, :data:`MAX_STAGING_BYTES`, :data:`MAX_DEVICES_PER_NODE`) and its
rules, applies the proto's defaults (a zero field stands for a ``DEFAULT_*``), and returns the
control's arguments (one :class:`PrepareArgs` for a Prepare) or raises
:class:`~dynatrain.agent.errors.InvalidRequest` naming every problem at once.
:func:`check_rendezvous_owner` says whether a Prepare's rendezvous store is the caller's own.
The servicer (:class:`~dynatrain.agent.server.AgentServicer`) runs them; each is linear in the
size of the request. They were part of :mod:`dynatrain.agent.server`, which re-exports them.
"""

from __future__ import annotations

import collections
import ipaddress
import math
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

from dynatrain.vps.layout import Layout, LayoutError, parse_layout
from dynatrain.vps.rounds import DEFAULT_STAGING_BYTES

from .errors import InvalidRequest
from .v1 import agent_pb2

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

    The store (the controller's, :mod:`dynatrain.controller.rendezvous`) authenticates nobody,
    and a worker builds its generation's groups through it: it must be the controller's own.
    So its host must be the caller's address (a DNS name is resolved and compared by address),
    or one of ``allowed`` (the worker's ``--allow-rendezvous`` hosts, for NAT or a mesh;
    compared as written, or as addresses when they are IP addresses).
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
    """A checked PrepareRequest with the defaults applied: the control's one argument.

    It travels whole from the servicer to :meth:`Control.prepare
    <dynatrain.agent.server.Control.prepare>`, and the worker keeps it as it is in its
    prepared generation (:class:`~dynatrain.agent.worker_control.Pending`'s ``args``)."""

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

"""The transition engine: carry out one device's part of a switch plan over torch.distributed.

Order of work on a device: adopt every old local tensor that is already exactly a new one (same
pieces, same shape: a DP replica that stays, a stage that keeps its layers) without copying it;
allocate the other new local tensors; do the local copies (no network); then the network
rounds, which every device derives the same from the full plan
(:func:`~dynatrain.vps.rounds.schedule_rounds`), so sends and receives always pair up and the
schedule cannot deadlock. In a round a device posts all its sends and receives at once (one
message per peer, that peer's small regions packed into one staging buffer; large regions as
messages of their own, straight from the old tensor into the new one) and waits for them. An
old tensor is released as soon as its last reader (local copy or send) is done, so memory
peaks near old + new + staging rather than at two copies of everything. Optional checksums
(two 64-bit sums per message) prove the bytes arrived intact.

After a failure, a device may hold **mirrors**: copies of dead devices' old local tensors (its
buddies' host-memory backups). The plan then names it as the sender of the dead devices' data
(each move's ``owner`` says whose old tensor to read); it reads those regions from the mirror,
both for local copies and for sends. Mirrors are never adopted and never released: they may be
the last copy of a dead device's state, still needed if this switch fails and is retried.

**Carving** (CPU, on by default): a new local tensor that is one contiguous block of this
device's own unshared old tensor becomes a view of it, and the old tensor's other pages go back
to the OS (:mod:`dynatrain.vps.carving`).

Two CPU costs need not sit in the training pause, and the caller may move them out: faulting
in freshly allocated pages (the kernel zeroes each one, as dear as the copy into it), and handing
freed pages back to the OS. ``preallocated`` takes new local tensors allocated and touched in the
background beforehand (:meth:`DeviceManager.prepare`'s ``preallocate``); ``retired`` collects old
tensors as their last reader finishes instead of dropping them, for
:func:`~dynatrain.vps.carving.free_in_background` after the switch. Both keep the peak within
old + new + staging. (On a GPU neither costs much: the caching allocator neither faults nor
unmaps.)

Every wait has a timeout; a failure raises :class:`TransitionError` naming the round, the peer
and what went wrong. The engine knows nothing about training: it moves (tensor, state) local
tensors described by the mapping's pieces, on any process group whose ranks are devices.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from . import abandon, faults
from .carving import CARVING, Trim, carve_views, give_back, unshared
from .planner import Plan
from .regions import region_view
from .rounds import (CHECKSUM_BYTES, DEFAULT_STAGING_BYTES, DIRECT_BYTES, Message, slot_bytes,
                     split_direct, staging_need)


class TransitionError(RuntimeError):
    """A switch transfer failed: a peer vanished, a wait timed out, or bytes arrived damaged."""


@dataclass(frozen=True, kw_only=True)
class TransitionConfig:
    staging_bytes: int = DEFAULT_STAGING_BYTES
    """Most bytes a device stages (sent plus received) in one round."""
    checksums: bool = False
    """Append two 64-bit sums to every message and check them on arrival."""
    direct_bytes: int = DIRECT_BYTES
    """Regions at least this large are sent unpacked, each as its own message, from and into
    the tensors themselves (when contiguous). Checksums turn this off: they cover packed
    buffers."""
    carve: bool = True
    """On CPU, make new local tensors that are one contiguous block of an old one views of it
    (see :mod:`dynatrain.vps.carving`); where carving is unavailable this is ignored."""
    timeout: timedelta = field(default_factory=lambda: timedelta(
        seconds=float(os.environ.get("DYNATRAIN_TRANSITION_TIMEOUT_S", "60"))))
    """Longest wait for one round's messages (env DYNATRAIN_TRANSITION_TIMEOUT_S)."""

    def __post_init__(self) -> None:
        if self.staging_bytes < 1:
            raise ValueError(f"staging_bytes={self.staging_bytes} must be positive")
        if self.direct_bytes < 1:
            raise ValueError(f"direct_bytes={self.direct_bytes} must be positive")



@dataclass
class TransitionStats:
    seconds: float = 0.0
    copy_seconds: float = 0.0
    network_seconds: float = 0.0
    bytes_copied: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    peak_staging_bytes: int = 0
    bytes_adopted: int = 0
    """Old local tensors kept as new ones without a copy."""
    bytes_preallocated: int = 0
    """New local tensors and staging that were allocated (and faulted in) before the switch."""
    bytes_carved: int = 0
    """New local tensors made views of old ones instead of copies (see :mod:`.carving`)."""
    bytes_allocated: int = 0
    """New local tensors and staging allocated during the switch: none of the above."""
    setup_seconds: float = 0.0
    """Adopting, carving and allocating the new local tensors (before the local copies)."""
    post_seconds: float = 0.0
    """Network rounds: packing sends into staging and posting every send and receive."""
    wait_seconds: float = 0.0
    """Network rounds: waiting for the posted messages to complete."""
    unpack_seconds: float = 0.0
    """Network rounds: copying received staging (and non-contiguous regions) into place,
    and releasing old tensors whose last reader is done."""
    messages_sent: int = 0
    messages_received: int = 0

    @property
    def bytes_local(self) -> int:
        """The plan's local bytes this device moved: copied, or carved instead."""
        return self.bytes_copied + self.bytes_carved



def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (a copy if it is not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


CHECKSUM_CHUNK = 1 << 20
"""Bytes summed at a time: widened to int64 with its weights, a chunk costs 24 times its size
in temporaries (24 MiB), where the whole staging buffer at once cost 6 GiB per 256 MiB."""


def _checksum(buf: torch.Tensor) -> torch.Tensor:
    """Two sums over the bytes: plain, and position-weighted (catches reordering too). Summed a
    chunk at a time with each byte's global weight: integer sums, so exactly the whole
    buffer's."""
    total = torch.zeros(2, dtype=torch.int64, device=buf.device)
    for start in range(0, buf.numel(), CHECKSUM_CHUNK):
        b = buf[start:start + CHECKSUM_CHUNK].to(torch.int64)
        weights = torch.arange(start + 1, start + b.numel() + 1, dtype=torch.int64,
                               device=b.device) % 65521 + 1
        total[0] += b.sum()
        total[1] += (b * weights).sum()
    return total


@dataclass(kw_only=True)
class TransitionInputs:
    """What one device's part of a switch works on (for :func:`execute_transition`). The
    engine reads these and changes only ``old`` (entries released as their last reader
    finishes) and ``retired`` (released old tensors appended)."""

    plan: Plan
    device: int
    """The device whose part of ``plan`` runs here."""
    old: dict
    """(tensor name, state) -> this device's old local tensor (empty for a joiner); entries
    are released as their last reader finishes."""
    new_shapes: dict
    """(tensor name, state) -> (shape, dtype) of this device's new local tensors (empty for a
    leaver)."""
    group: object
    """A process group over every device of the switch (None if no message is sent)."""
    group_rank: dict[int, int]
    """Device -> its rank in ``group``."""
    rounds: list[list[Message]]
    """The network rounds (:func:`~dynatrain.vps.rounds.schedule_rounds`), alike on every
    device."""
    torch_device: torch.device | None = None
    """Where the new local tensors and staging live (the CPU if None)."""
    old_pieces: dict | None = None
    """Same keys as ``old``, the mapping's pieces: with ``new_pieces``, lets identical tensors
    be adopted uncopied. An adopted tensor is never written, so sending from it to other
    devices stays correct."""
    new_pieces: dict | None = None
    """Same keys as ``new_shapes``, the mapping's pieces (also needed for carving)."""
    mirrored: dict[int, dict[tuple[str, str], torch.Tensor]] | None = None
    """Dead device -> its old local tensors (same keys and shapes as its ``old`` would have
    had) that this device holds as its proxy; moves owned by that device read from there.
    Mirrors are only read, never adopted or released."""
    preallocated: dict | None = None
    """(tensor name, state) -> a tensor to use as that new local tensor (used when its shape
    and dtype match; it is overwritten entirely)."""
    retired: list | None = None
    """If a list, released old tensors are appended to it rather than dropped here (see the
    module docstring)."""
    staging: torch.Tensor | None = None
    """A uint8 buffer of at least :func:`staging_need` bytes that every round packs its sends
    into and receives into; without one (or if it is too small) one is allocated here."""


def execute_transition(inputs: TransitionInputs, config: TransitionConfig = TransitionConfig()
                       ) -> tuple[dict, TransitionStats]:
    """Run ``inputs.device``'s part of ``inputs.plan`` (see :class:`TransitionInputs`): set up
    the new local tensors, do the local copies, then the network rounds, each posting its
    sends and receives (:func:`_post_round`), waiting for them (:func:`_exchange`) and
    unpacking what arrived (:func:`_unpack`).
    Returns the new local tensors and statistics.
    """
    t0 = time.perf_counter()
    run = _Run(inputs, config)
    stats = run.stats
    _set_up(run)
    stats.setup_seconds = time.perf_counter() - t0
    run.last_use = _last_uses(inputs.plan, inputs.device, inputs.rounds)
    for key in [k for k in run.old if k not in run.last_use]:   # never read: free at once
        run.drop(key)

    with torch.no_grad():
        _local_copies(run)
        run.release(-1)
        stats.copy_seconds = time.perf_counter() - t0

        t1 = time.perf_counter()
        faults.inject("transfer", run.device)
        _stage(run)
        for r, messages in enumerate(inputs.rounds):
            mine = [msg for msg in messages if run.device in (msg.src, msg.dst)]
            if not mine:
                continue
            faults.inject("round", run.device, r)
            stats.rounds += 1
            _network_round(run, r, mine)
        stats.network_seconds = time.perf_counter() - t1
    stats.seconds = time.perf_counter() - t0
    return run.new, stats


class _Run:
    """One call of :func:`execute_transition`: its inputs, the new local tensors as they are
    set up, and what is needed to release each old tensor after its last reader."""

    def __init__(self, inputs: TransitionInputs, config: TransitionConfig):
        self.inputs, self.config = inputs, config
        self.plan, self.device, self.old = inputs.plan, inputs.device, inputs.old
        self.stats = TransitionStats()
        self.dev = inputs.torch_device or torch.device("cpu")
        self.mirrored = inputs.mirrored or {}
        self.new: dict = {}
        self.adopted: set = set()
        self.carved: dict = {}   # key -> where the kept block lies, for giving the rest back
        self.last_use: dict = {}
        self.staging = inputs.staging
        # One buffer for every round (see _stage); checksums turn direct messages off.
        self.direct_bytes = None if config.checksums else config.direct_bytes
        self.extra = CHECKSUM_BYTES if config.checksums else 0

    def source(self, m, name: str) -> torch.Tensor:
        """The old local tensor ``m`` reads ``name`` from: ours, or a dead device's mirror."""
        device, mirrored = self.device, self.mirrored
        owner = m.src_owner
        if owner == device:
            return self.old[(name, m.state)]
        held = mirrored.get(owner)
        if held is None:
            raise TransitionError(
                f"device {device}: the plan has it read dead device {owner}'s {name} "
                f"({m.state}) as its proxy, but it holds no mirror of device {owner} (it holds "
                f"mirrors of {sorted(mirrored)}); pass them as mirrored={{{owner}: ...}}")
        t = held.get((name, m.state))
        if t is None:
            raise TransitionError(f"device {device}: the mirror of device {owner} lacks {name} "
                                  f"({m.state}), which the plan reads from it")
        return t

    def drop(self, key) -> None:
        t = self.old.pop(key, None)
        if t is None or key in self.adopted:
            return
        retired = self.inputs.retired
        if key in self.carved:
            trim = Trim(t, *self.carved[key])
            if retired is None:
                give_back(trim)
            else:
                retired.append(trim)
        elif retired is not None:
            retired.append(t)

    def release(self, upto: int) -> None:
        for key in [k for k, r in self.last_use.items() if r <= upto]:
            self.drop(key)
            del self.last_use[key]


def _set_up(run: _Run) -> None:
    """The new local tensors: old ones adopted as they are, carved views of old ones, the
    preallocated ones, and freshly allocated ones, in that order of preference."""
    inputs, new, stats = run.inputs, run.new, run.stats
    old_pieces, new_pieces = inputs.old_pieces, inputs.new_pieces
    for key, (shape, dtype) in inputs.new_shapes.items():
        t = run.old.get(key)
        if (t is not None and old_pieces is not None and new_pieces is not None
                and old_pieces.get(key) == new_pieces.get(key)
                and tuple(t.shape) == tuple(shape) and t.dtype == dtype):
            new[key] = t
            run.adopted.add(key)
    if run.config.carve and CARVING and run.dev.type == "cpu" and new_pieces is not None:
        _carve(run)
    preallocated = inputs.preallocated or {}
    for key, (shape, dtype) in inputs.new_shapes.items():
        if key not in new:
            t = preallocated.get(key)
            if (t is not None and tuple(t.shape) == tuple(shape) and t.dtype == dtype
                    and t.device == run.dev):
                new[key] = t
                stats.bytes_preallocated += t.numel() * t.element_size()
            else:
                new[key] = torch.empty(shape, dtype=dtype, device=run.dev)
                stats.bytes_allocated += new[key].numel() * new[key].element_size()
    stats.bytes_adopted = sum(new[k].numel() * new[k].element_size() for k in run.adopted)


def _carve(run: _Run) -> None:
    """Make the new local tensors that are one contiguous block of an unshared old tensor of
    ours views of it (:mod:`dynatrain.vps.carving`)."""
    candidates = {k: t for k, t in run.old.items() if k not in run.new and unshared(t)}
    for key, view in carve_views(run.plan, run.device, candidates, run.inputs.new_shapes,
                                 run.inputs.new_pieces).items():
        nbytes = view.numel() * view.element_size()
        run.new[key] = view
        run.carved[key] = (view.data_ptr(), view.data_ptr() + nbytes)
        run.stats.bytes_carved += nbytes
    del candidates


def _last_uses(plan: Plan, device: int, rounds: list[list[Message]]) -> dict:
    """Last reader of each of our own old tensors: -1 = the local copies, r = network round r.
    Reads from mirrors do not count: mirrors are kept (see the module docstring)."""
    last_use: dict = {}
    for m in plan.copies:
        if m.dst == device and m.src_owner == device:
            for name in plan.groups[m.group].names:
                last_use[(name, m.state)] = -1
    for r, messages in enumerate(rounds):
        for msg in messages:
            if msg.src != device:
                continue
            for it in msg.items:
                mv = plan.transfers[it.move]
                if mv.src_owner == device:
                    last_use[(it.name, mv.state)] = r
    return last_use


def _local_copies(run: _Run) -> None:
    """The plan's copies into this device's new local tensors (no network)."""
    plan, device, new = run.plan, run.device, run.new
    for m in plan.copies:
        if m.dst != device:
            continue
        for name in plan.groups[m.group].names:
            if (name, m.state) in run.adopted and m.src_owner == device:
                continue  # already in place: the old tensor is the new one
            if (name, m.state) in run.carved:
                continue  # already in place: a view of the old tensor (its only writer)
            region_view(new[(name, m.state)], m.dst_piece, m.box).copy_(
                region_view(run.source(m, name), m.src_piece, m.box))
            run.stats.bytes_copied += m.nbytes


def _stage(run: _Run) -> None:
    """One buffer for every round, faulted in once (or beforehand), rather than fresh
    buffers per round: each round's packed messages are slices of it."""
    need = staging_need(run.inputs.rounds, run.device, run.direct_bytes)
    staging = run.staging
    if need and (staging is None or staging.numel() < need or staging.device != run.dev):
        run.staging = torch.empty(need, dtype=torch.uint8, device=run.dev)
        run.stats.bytes_allocated += need
    elif need:
        run.stats.bytes_preallocated += staging.numel()


@dataclass
class _Round:
    """One network round in flight: what was posted, and what to unpack once it arrived."""

    works: list = field(default_factory=list)
    """(message, work) for every send and receive posted, in the order posted."""
    inbound: list = field(default_factory=list)
    """(message, indices of its packed items, staging slice) for every packed receive."""
    unstaged: list = field(default_factory=list)
    """(non-contiguous destination, contiguous buffer received into) of direct receives."""
    staged: int = 0
    offset: int = 0

    def slot(self, staging: torch.Tensor, size: int, extra: int) -> torch.Tensor:
        """The next slice of ``staging`` for a packed message of ``size`` bytes."""
        buf = staging[self.offset:self.offset + size + extra]
        self.offset += slot_bytes(size)
        self.staged += size + extra
        return buf


def _network_round(run: _Run, r: int, mine: list[Message]) -> None:
    """Round ``r`` of this device's messages ``mine``: post, wait, unpack, release."""
    stats = run.stats
    t_round = time.perf_counter()
    rnd = _post_round(run, r, mine)
    stats.peak_staging_bytes = max(stats.peak_staging_bytes, rnd.staged)
    t_wait = time.perf_counter()
    stats.post_seconds += t_wait - t_round
    _exchange(run, r, rnd.works)
    t_unpack = time.perf_counter()
    stats.wait_seconds += t_unpack - t_wait
    _unpack(run, r, rnd)
    run.release(r)
    stats.unpack_seconds += time.perf_counter() - t_unpack


def _post_round(run: _Run, r: int, mine: list[Message]) -> _Round:
    """Pack and post every send and receive of round ``r``, message by message in the
    round's order (every device numbers and orders them alike)."""
    rnd = _Round()
    for msg in mine:
        packed, direct = split_direct(msg, run.direct_bytes)
        if msg.src == run.device:
            _post_send(run, r, msg, packed, direct, rnd)
        else:
            _post_recv(run, r, msg, packed, direct, rnd)
    return rnd


# A packed message has tag r << 16, the direct region j of it (r << 16) + 1 + j: both ends
# number them the same way.


def _post_send(run: _Run, r: int, msg: Message, packed: list, direct: list,
               rnd: _Round) -> None:
    """Post ``msg``'s direct regions, then pack its other regions into staging and post it."""
    plan, group, group_rank = run.plan, run.inputs.group, run.inputs.group_rank
    tag = r << 16
    run.stats.bytes_sent += msg.nbytes
    for j in direct:
        it = msg.items[j]
        mv = plan.transfers[it.move]
        region = region_view(run.source(mv, it.name), mv.src_piece, mv.box)
        if not region.is_contiguous():
            region = region.contiguous()
            rnd.staged += it.nbytes
        rnd.works.append((msg, group.send([_as_bytes(region)], group_rank[msg.dst],
                                          tag + 1 + j)))
    if not packed:
        return
    size = sum(msg.items[j].nbytes for j in packed)
    buf = rnd.slot(run.staging, size, run.extra)
    parts = []
    for j in packed:
        it = msg.items[j]
        mv = plan.transfers[it.move]
        parts.append(_as_bytes(region_view(run.source(mv, it.name), mv.src_piece, mv.box)))
    torch.cat(parts, out=buf[:size])
    if run.config.checksums:
        buf[size:].copy_(_checksum(buf[:size]).view(torch.uint8))
    rnd.works.append((msg, group.send([buf], group_rank[msg.dst], tag)))


def _post_recv(run: _Run, r: int, msg: Message, packed: list, direct: list,
               rnd: _Round) -> None:
    """Post receives of ``msg``'s direct regions (into the new tensor where contiguous),
    then of its packed regions into staging."""
    plan, group, group_rank = run.plan, run.inputs.group, run.inputs.group_rank
    tag = r << 16
    run.stats.bytes_received += msg.nbytes
    for j in direct:
        it = msg.items[j]
        mv = plan.transfers[it.move]
        dst = region_view(run.new[(it.name, mv.state)], mv.dst_piece, mv.box)
        into = dst
        if not dst.is_contiguous():
            into = torch.empty(dst.shape, dtype=dst.dtype, device=run.dev)
            rnd.unstaged.append((dst, into))
            rnd.staged += it.nbytes
        rnd.works.append((msg, group.recv([_as_bytes(into)], group_rank[msg.src],
                                          tag + 1 + j)))
    if not packed:
        return
    size = sum(msg.items[j].nbytes for j in packed)
    buf = rnd.slot(run.staging, size, run.extra)
    rnd.works.append((msg, group.recv([buf], group_rank[msg.src], tag)))
    rnd.inbound.append((msg, packed, buf))


def _exchange(run: _Run, r: int, works: list) -> None:
    """Wait for every message posted in round ``r``, in the order posted."""
    device, timeout, stats = run.device, run.config.timeout, run.stats
    for msg, _ in works:
        if msg.src == device:
            stats.messages_sent += 1
        else:
            stats.messages_received += 1
    for msg, work in works:
        peer = msg.dst if msg.src == device else msg.src
        try:
            if abandon.wait(work, timeout) is False:
                raise TimeoutError("wait returned False")
        except Exception as e:  # gloo/NCCL report timeouts and lost peers differently
            raise TransitionError(
                f"device {device}: round {r} with device {peer} failed after up to "
                f"{timeout.total_seconds():.0f} s: {e}") from e


def _unpack(run: _Run, r: int, rnd: _Round) -> None:
    """Copy round ``r``'s received staging (and non-contiguous regions) into place."""
    for dst, into in rnd.unstaged:
        dst.copy_(into)
    for msg, packed, buf in rnd.inbound:
        if run.config.checksums:
            buf = _verified(run, r, msg, buf)
        at = 0
        for j in packed:
            it = msg.items[j]
            mv = run.plan.transfers[it.move]
            dst = region_view(run.new[(it.name, mv.state)], mv.dst_piece, mv.box)
            dst.copy_(buf[at:at + it.nbytes].view(dst.dtype).reshape(dst.shape))
            at += it.nbytes


def _verified(run: _Run, r: int, msg: Message, buf: torch.Tensor) -> torch.Tensor:
    """The payload of a packed message received with checksums, once they match."""
    # The sums follow the payload, which need not be a multiple of 8 bytes (fp32 regions of
    # odd length): copy them out to view them as int64.
    payload = buf[:-CHECKSUM_BYTES]
    tail = buf[-CHECKSUM_BYTES:].clone()
    if not torch.equal(_checksum(payload), tail.view(torch.int64)):
        raise TransitionError(f"device {run.device}: checksum mismatch in the "
                              f"message from device {msg.src} (round {r})")
    return payload

"""In-memory redundancy: recover from a lost device without a checkpoint.

Every rank keeps host copies of its own training state at the last two step boundaries, and a
*mirror* of one other rank's *unique* state (what no third rank holds: ZeRO shards of the
optimizer, the stages of a pipeline without data parallelism) at the last two boundaries as
well. When devices die, the survivors between them still hold every piece of some recent step:
replicated state on its surviving replicas, unique state in the mirror of the dead rank's buddy.
:func:`recovery_needs` and :func:`restore_step` say which step that is; :meth:`Redundancy.restore`
and :meth:`Redundancy.restore_mirror` hand the state back for a switch to the survivors' layout.

Costs are kept off the step's critical path. A snapshot is one copy into a host buffer per
slot (the unique part first, so it leaves as one contiguous message); the buffers come from a
:class:`~dynatrain.trainer.hostbuffers.HostBuffers` pool: exact size, pinned once under CUDA,
reused by the next generation. On a GPU the copies run on a side stream and end in an event:
the training thread does not wait for them; the compute stream waits for that event only
before the next optimizer update (:meth:`Redundancy.before_update`), the one kernel that
overwrites what is being copied, and the mirror exchange is posted by a short-lived thread once
the event has fired. On the CPU the copy is synchronous and the exchange posted at once. The
mirror exchange is an asynchronous gloo send/recv that overlaps the next step and is only
waited for just before that step's final all-reduce (:meth:`Redundancy.wait_mirror`), after
the gradient all-reduce. That placement gives the invariant recovery relies on: once any rank
has finished step s+1, every mirror of step s has arrived everywhere, while own snapshots of s
and the one before (s-1, or s-k when the worker snapshots every k steps) are both kept.

Buddies are a rotation over the ranks ordered by node, so the map is a permutation (everyone
sends one message and receives one) and, whenever no node holds more than half the ranks, a
rank's mirror lives on another node: losing a whole node never loses both copies. The node of
a device is where it really runs when that is known (:data:`~dynatrain.vps.topology.Nodes`:
device -> node name, from the pods' ``spec.nodeName`` on a cluster), else
``device // devices_per_node``; the switch planner reads the same map for its link costs. Every
decision here reads only layout metadata, so all ranks derive the same pairs without talking.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dynatrain.vps.layout import BoundLayout, Layout
from dynatrain.vps.mapping import RankShard, rank_shards, shard_pattern
from dynatrain.vps.topology import Nodes, node_of

from .hostbuffers import HostBuffers
from .trainer import LocalState
from .weights import TORCH_DTYPES

_ALIGN = 64
"""Byte alignment of every tensor in a slot buffer (any dtype view of it is then legal)."""
_HEADER = _ALIGN
"""A slot starts with its step (int64), so a receiver can check which step a mirror is of."""
_TAG = 0x5EDA
_POSTING = object()
"""Stands for a send or recv whose posting waits for the copies' event (a thread posts it)."""


# -- pure metadata: who mirrors whom, what is unique -----------------------------------------
def buddy_map(layout: Layout, devices_per_node: Nodes = 1) -> tuple[int, ...]:
    """``buddy[r]``: the rank that mirrors rank ``r``'s unique state. A permutation.

    Ranks are ordered by (node, device) (:func:`node_of`) and rotated by the size of the
    largest node: two ranks that far apart in that order are on different nodes whenever no
    node holds more than half the ranks. With one node (or a node holding every rank) the
    rotation is by one, so each rank still mirrors to another device.
    """
    if isinstance(devices_per_node, bool) or (isinstance(devices_per_node, int)
                                            and devices_per_node < 1) \
            or not isinstance(devices_per_node, (int, Mapping)):
        raise ValueError(f"devices_per_node={devices_per_node!r} must be a positive integer or "
                         "a mapping of device to node")
    world = layout.world
    devices = layout.device_of
    order = sorted(range(world), key=lambda r: (node_of(devices_per_node, devices[r]), devices[r]))
    per_node: dict = {}
    for d in devices:
        n = node_of(devices_per_node, d)
        per_node[n] = per_node.get(n, 0) + 1
    k = max(per_node.values())
    if k >= world:
        k = 1
    buddy = [0] * world
    for i, r in enumerate(order):
        buddy[r] = order[(i + k) % world]
    return tuple(buddy)


def source_map(layout: Layout, devices_per_node: Nodes = 1) -> tuple[int, ...]:
    """``source[r]``: the rank whose unique state rank ``r`` mirrors (the inverse of buddies)."""
    buddy = buddy_map(layout, devices_per_node)
    source = [0] * len(buddy)
    for r, b in enumerate(buddy):
        source[b] = r
    return tuple(source)


def _replica_count(bound: BoundLayout, rs: RankShard) -> int:
    """How many ranks of the layout hold exactly ``rs.pieces`` of this tensor's state."""
    pattern = shard_pattern(rs.tensor, rs.state, bound.layout)
    holders = next(len(s.holders) for s in pattern if s.pieces == rs.pieces)
    # A stage's pattern depends only on (dp, tp, ep, zero), so every stage that holds the
    # tensor (two for a tied embedding) holds the same shards.
    return holders * len(bound.stages_of(rs.tensor.layer, rs.tensor.tied_to_last))


def unique_shards(bound: BoundLayout, rank: int) -> list[RankShard]:
    """What ``rank`` holds that no other rank holds (identical pieces count as a replica).

    Empty shards (a ZeRO range of a tensor smaller than the group) are never unique: there is
    nothing to lose.
    """
    if not 0 <= rank < bound.layout.world:
        raise ValueError(f"rank={rank} is not a rank of {bound.layout.to_text()} "
                         f"(world {bound.layout.world})")
    return [rs for rs in rank_shards(bound, rank)
            if rs.pieces and _replica_count(bound, rs) == 1]


def recovery_needs(bound: BoundLayout, dead_devices, devices_per_node: Nodes = 1
                   ) -> dict[int, int | None]:
    """Which surviving device must supply the mirror of each dead device.

    Returns {dead device: buddy device} for every dead device with unique state; the value is
    None when that buddy died too, or when some replicated state of a dead device has no
    surviving replica either: that state survives nowhere. Dead devices whose state all lives
    on survivors need nothing and are left out.
    """
    lay = bound.layout
    rank_of = {d: r for r, d in enumerate(lay.device_of)}
    unknown = [d for d in dead_devices if d not in rank_of]
    if unknown:
        raise ValueError(f"dead device {unknown[0]} is not a device of {lay.to_text()} "
                         f"(devices {list(lay.device_of)})")
    dead = {rank_of[d] for d in dead_devices}
    buddy = buddy_map(lay, devices_per_node)
    survivors_hold: set = set()
    for r in range(lay.world):
        if r not in dead:
            survivors_hold.update((rs.tensor.name, rs.state, rs.pieces)
                                  for rs in rank_shards(bound, r))
    needs: dict[int, int | None] = {}
    for r in sorted(dead):
        lost = False
        has_unique = False
        for rs in rank_shards(bound, r):
            if rs.pieces and _replica_count(bound, rs) == 1:
                has_unique = True
            elif rs.pieces and (rs.tensor.name, rs.state, rs.pieces) not in survivors_hold:
                lost = True                        # every replica of it died as well
        if lost:
            needs[lay.device_of[r]] = None
        elif has_unique:
            needs[lay.device_of[r]] = None if buddy[r] in dead else lay.device_of[buddy[r]]
    return needs


def restore_step(own_steps: dict, mirror_steps: dict, needs: dict) -> int | None:
    """The latest step whose state survives in full, or None.

    ``own_steps``: surviving device -> steps of its own snapshots; ``mirror_steps``: surviving
    device -> steps of its complete mirrors; ``needs``: dead device -> the surviving device
    holding its mirror (None: no copy survives), as :func:`recovery_needs` gives it. The rule:
    the largest step in every survivor's own steps and in the mirror steps of every needed
    buddy.
    """
    if not own_steps:
        return None
    common = set.intersection(*(set(steps) for steps in own_steps.values()))
    for holder in needs.values():
        if holder is None or holder not in own_steps:
            return None                            # its buddy died too: no mirror survives
        common &= set(mirror_steps.get(holder, ()))
    return max(common) if common else None


# -- the per-rank store ----------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    key: tuple[str, str]
    pieces: tuple
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def _layout_entries(shards: list[RankShard], start: int) -> tuple[list[_Entry], int]:
    """Entries of ``shards`` packed from byte ``start``, each aligned; and the end offset."""
    out, off = [], start
    for rs in shards:
        dtype = TORCH_DTYPES[rs.tensor.dtype] if rs.state == "param" else torch.float32
        numel = 1
        for n in rs.local_shape:
            numel *= n
        nbytes = numel * dtype.itemsize
        out.append(_Entry((rs.tensor.name, rs.state), rs.pieces, tuple(rs.local_shape), dtype,
                          off, nbytes))
        off += -(-nbytes // _ALIGN) * _ALIGN
    return out, off


@dataclass(frozen=True)
class SlotSizes:
    """Bytes of one rank's host buffers, exactly as :class:`Redundancy` packs them (each entry
    aligned, a header first); what :mod:`dynatrain.controller.memory` models a node with."""

    snapshot: int
    """One snapshot slot: the rank's whole local state (a Redundancy keeps two)."""
    unique: int
    """The leading part of a snapshot slot that goes to the buddy (its unique state)."""
    mirror: int
    """One mirror slot: the source's unique state (two are kept); 0 without a source."""


def slot_sizes(bound: BoundLayout, rank: int, devices_per_node: Nodes = 1,
               mirror: bool = True) -> SlotSizes:
    """The sizes of ``rank``'s snapshot and mirror slots under ``bound`` (no allocation)."""
    own, unique = rank_shards(bound, rank), unique_shards(bound, rank)
    keys = {(rs.tensor.name, rs.state) for rs in unique}
    _, unique_end = _layout_entries(unique, _HEADER)
    _, total = _layout_entries([rs for rs in own if (rs.tensor.name, rs.state) not in keys],
                               unique_end)
    mirror_end = 0
    if mirror and bound.layout.world > 1:
        source = source_map(bound.layout, devices_per_node)[rank]
        src_unique = unique_shards(bound, source)
        if src_unique:
            mirror_end = _layout_entries(src_unique, _HEADER)[1]
    return SlotSizes(total, unique_end, mirror_end)


def _view(buf: torch.Tensor, e: _Entry) -> torch.Tensor:
    return buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)


def _copy(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A copy of a slot's view that owns its memory: on ``device`` if it is not the CPU."""
    if device is None or device.type == "cpu":
        return t.clone()
    return t.to(device, copy=True)


class _Slot:
    """One host buffer and what it holds: a step, or nothing (``step is None``)."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.step: int | None = None
        self.data_position = 0
        self.rng: dict = {}
        self.work = None                           # a recv still writing into this slot
        self.copied = None                         # the CUDA event that ends its copies


def _pick(slots: list[_Slot], step: int) -> _Slot:
    """The slot for ``step``: the one already holding it, else the empty or older one."""
    for s in slots:
        if s.step == step:
            return s
    return min(slots, key=lambda s: -1 if s.step is None else s.step)


class Redundancy:
    """One rank's snapshots of its own state and its mirror of its source's unique state.

    ``group``: a gloo process group whose rank i is layout rank i, best one of its own so the
    mirror traffic never interleaves with the trainer's collectives. ``wait(work)`` is used for
    every wait (callers pass one that gives up when the job is aborted).
    """

    def __init__(self, bound: BoundLayout, rank: int, group, *, mirror: bool = True,
                 devices_per_node: Nodes = 1, wait=None, buffers: HostBuffers | None = None,
                 mirror_buffers: HostBuffers | None = None, post_in_background: bool = False,
                 calls_before_update: bool = False):
        """``buffers``: where the snapshot slots come from (by default a pool of this
        Redundancy's own, pinned when CUDA is there: device-to-host copies want pinned
        memory); ``mirror_buffers``: the mirror slots' (never pinned: only gloo writes them).
        ``post_in_background``: post the mirror exchange from a thread even when the copies
        were synchronous (CPU), as it is on a GPU; for tests of that path.
        ``calls_before_update``: the caller calls :meth:`before_update` before every optimizer
        update (the trainer's ``before_update`` hook); otherwise the compute stream waits for
        a snapshot's copies at once (still without blocking the host)."""
        lay = bound.layout
        if not 0 <= rank < lay.world:
            raise ValueError(f"rank={rank} is not a rank of {lay.to_text()} (world {lay.world})")
        self.bound, self.rank, self.group = bound, rank, group
        self._wait = wait or (lambda work: work.wait())
        self.buffers = buffers or HostBuffers(pin=torch.cuda.is_available())
        self.mirror_buffers = mirror_buffers or HostBuffers(pin=False)
        self._post_in_background = post_in_background
        self._calls_before_update = calls_before_update
        self._stream = None                        # the side stream of the copies (CUDA)
        self._poster: threading.Thread | None = None
        self._post_error: BaseException | None = None

        own = rank_shards(bound, rank)
        unique = unique_shards(bound, rank)
        unique_keys = {(rs.tensor.name, rs.state) for rs in unique}
        # Unique state first, right after the header: it leaves as one contiguous message,
        # packed exactly as the buddy packs its mirror slot (the sizes must match).
        first, self._unique_end = _layout_entries(unique, _HEADER)
        rest, total = _layout_entries(
            [rs for rs in own if (rs.tensor.name, rs.state) not in unique_keys], self._unique_end)
        self._entries = first + rest
        self.unique = tuple((rs.tensor.name, rs.state) for rs in unique)
        self._slots = [_Slot(self.buffers.take(total)), _Slot(self.buffers.take(total))]

        self.buddy: int | None = None
        self.source: int | None = None
        self._mirror_entries: list[_Entry] = []
        self._mirror_slots: list[_Slot] = []
        if mirror and lay.world > 1:
            buddy = buddy_map(lay, devices_per_node)[rank]
            source = source_map(lay, devices_per_node)[rank]
            if unique:
                self.buddy = buddy
            src_unique = unique_shards(bound, source)
            if src_unique:
                self.source = source
                self._mirror_entries, end = _layout_entries(src_unique, _HEADER)
                self._mirror_slots = [_Slot(self.mirror_buffers.take(end)),
                                      _Slot(self.mirror_buffers.take(end))]
        if self.buddy is not None or self.source is not None:
            if group is None:
                raise ValueError(f"rank {rank} of {lay.to_text()} mirrors unique state, which "
                                 "needs a process group over the layout's ranks; got None")
            if group.size() != lay.world:
                raise ValueError(f"rank {rank}: the group has {group.size()} ranks but layout "
                                 f"{lay.to_text()} has {lay.world}")
        self._send = None                          # (work, slot) of the send in flight
        self._recv_slot: _Slot | None = None

    # -- taking snapshots --------------------------------------------------------------------
    def snapshot(self, state: LocalState) -> None:
        """Keep ``state`` (taken at a step boundary) and start the mirror exchange of it."""
        if not self._slots:
            raise RuntimeError(f"rank {self.rank}: snapshot of step {state.step} after close()")
        for e in self._entries:                    # check first: a bad state evicts nothing
            if e.key not in state.tensors:
                raise KeyError(f"rank {self.rank}: the state of step {state.step} lacks "
                               f"{e.key[0]} ({e.key[1]}), which layout "
                               f"{self.bound.layout.to_text()} gives this rank")
            src = state.tensors[e.key][0]
            if tuple(src.shape) != e.shape or src.dtype != e.dtype:
                raise ValueError(f"rank {self.rank}: {e.key[0]} ({e.key[1]}) at step "
                                 f"{state.step} is {tuple(src.shape)} {src.dtype}; the "
                                 f"mapping says {e.shape} {e.dtype}")
        self.wait_mirror()                         # normally finished during the last step
        slot = _pick(self._slots, state.step)
        slot.step = None                           # invalid until the copy is whole
        self._settle_copy(slot)                    # (an older copy into it, never waited)
        slot.copied = self._copy_in(slot, state)
        slot.buf[:8].view(torch.int64)[0] = state.step
        slot.data_position = state.data_position
        slot.rng = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in state.rng.items()}
        slot.step = state.step

        mslot = None
        if self.source is not None:
            mslot = _pick(self._mirror_slots, state.step)
            # The older mirror is overwritten from now on; it counts again once complete.
            mslot.step = state.step
            mslot.work = _POSTING
            self._recv_slot = mslot
        if self.buddy is not None:
            self._send = (_POSTING, slot)
        if slot.copied is None and not self._post_in_background:
            self._post(slot, mslot)
        elif self.buddy is not None or mslot is not None:
            # The send may leave only once the copies are whole: wait for their event off the
            # training thread (a recv is posted by the same thread, after it: one order).
            self._poster = threading.Thread(target=self._post_when_copied,
                                            args=(slot.copied, slot, mslot),
                                            name=f"mirror-post-{state.step}", daemon=True)
            self._poster.start()

    def _copy_in(self, slot: _Slot, state: LocalState):
        """Copy ``state`` into ``slot``: synchronously from CPU tensors; from GPU tensors on
        the side stream, returning the event that ends the copies."""
        cuda = next((t for t, _ in state.tensors.values() if t.is_cuda), None)
        with torch.no_grad():
            if cuda is None:
                for e in self._entries:
                    _view(slot.buf, e).copy_(state.tensors[e.key][0].detach())
                return None
            main = torch.cuda.current_stream(cuda.device)
            if self._stream is None:
                self._stream = torch.cuda.Stream(cuda.device)
            self._stream.wait_stream(main)         # the state as the last update left it
            with torch.cuda.stream(self._stream):
                for e in self._entries:
                    _view(slot.buf, e).copy_(state.tensors[e.key][0].detach(),
                                             non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
            if not self._calls_before_update:
                main.wait_event(event)
            return event

    def before_update(self) -> None:
        """Call before the optimizer overwrites the state: the compute stream waits (on the
        GPU, the host does not) for the copies of the newest snapshot. A no-op on the CPU."""
        for s in self._slots:
            if s.copied is not None:
                torch.cuda.current_stream().wait_event(s.copied)

    def _settle_copy(self, slot: _Slot) -> None:
        """The host waits for ``slot``'s copies (before reading or overwriting it)."""
        if slot.copied is not None:
            slot.copied.synchronize()
            slot.copied = None

    def _post(self, slot: _Slot, mslot: _Slot | None) -> None:
        if self.buddy is not None:
            self._send = (self.group.send([slot.buf[:self._unique_end]], self.buddy, _TAG),
                          slot)
        if mslot is not None:
            mslot.work = self.group.recv([mslot.buf], self.source, _TAG)

    def _post_when_copied(self, copied, slot: _Slot, mslot: _Slot | None) -> None:
        # ``copied`` is passed, not read from the slot: the training thread may settle (and
        # clear) the slot's event meanwhile (drop, restore).
        try:
            if copied is not None:
                copied.synchronize()
            self._post(slot, mslot)
        except BaseException as e:  # noqa: BLE001 - raised on the training thread
            self._post_error = e

    def _join_poster(self) -> None:
        """Wait until the exchange in flight is posted (it follows the copies' event)."""
        if self._poster is not None:
            self._poster.join()
            self._poster = None
            if self._post_error is not None:
                e, self._post_error = self._post_error, None
                if self._recv_slot is not None:
                    self._recv_slot.step, self._recv_slot.work = None, None
                    self._recv_slot = None
                self._send = None
                raise RuntimeError(f"rank {self.rank}: posting the mirror exchange failed: "
                                   f"{e}") from e

    def wait_mirror(self) -> None:
        """Wait for the exchange in flight (call it before the next step's final all-reduce:
        a rank that finished that step then knows every mirror of this one arrived)."""
        self._join_poster()
        if self._send is not None:
            work, _ = self._send
            self._send = None
            self._wait(work)
        self._finish_recv()

    def _finish_recv(self) -> None:
        if self._recv_slot is not None:
            slot, self._recv_slot = self._recv_slot, None
            work, slot.work = slot.work, None
            try:
                self._wait(work)
            except BaseException:
                slot.step = None                  # half written: not a mirror of anything
                raise
            self._check_mirror(slot)

    def _check_mirror(self, slot: _Slot) -> None:
        got = int(slot.buf[:8].view(torch.int64)[0])
        if got != slot.step:
            bad, slot.step = slot.step, None
            raise RuntimeError(f"rank {self.rank}: the mirror from rank {self.source} is of "
                               f"step {got}, but this rank snapshotted step {bad}; ranks must "
                               "snapshot at the same step boundaries")

    # -- what survives -----------------------------------------------------------------------
    def holdings(self) -> tuple[list[int], list[int]]:
        """(steps of own snapshots, steps of complete mirrors), ascending. Never blocks.

        A mirror still being received does not count. Gloo's send/recv works only report
        completion once waited (measured on torch 2.15: ``is_completed()`` stays False after the
        data has arrived), so under gloo the newest mirror counts from :meth:`wait_mirror` on;
        that is conservative, and the older mirror is what recovery needs in that window.
        """
        own = sorted(s.step for s in self._slots if s.step is not None)
        slot = self._recv_slot
        if slot is not None and slot.work not in (None, _POSTING) and slot.work.is_completed():
            # Completed, so this returns at once. A failed recv (its source died) has already
            # marked its slot invalid, and holdings are asked for exactly after failures.
            with contextlib.suppress(RuntimeError):
                self._finish_recv()
        mirrors = sorted(s.step for s in self._mirror_slots
                         if s.step is not None and s.work is None)
        return own, mirrors

    def restore(self, step: int, device: torch.device | None = None) -> LocalState:
        """This rank's own state at ``step``, copied (a trainer built from it mutates it):
        onto ``device`` straight from the slot (pinned under CUDA: one DMA, no pageable
        clone on the way), else on the CPU."""
        slot = next((s for s in self._slots if s.step == step), None)
        if slot is None:
            raise KeyError(f"rank {self.rank} holds no snapshot of step {step}; it holds "
                           f"{self.holdings()[0]}")
        self._settle_copy(slot)
        tensors = {e.key: (_copy(_view(slot.buf, e), device), e.pieces)
                   for e in self._entries}
        rng = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in slot.rng.items()}
        return LocalState(tensors, step, slot.data_position, rng)

    def restore_mirror(self, step: int, device: torch.device | None = None
                       ) -> dict[tuple[str, str], torch.Tensor]:
        """The source rank's unique state at ``step``, copied as :meth:`restore` does:
        {(name, state): tensor}."""
        complete = self.holdings()[1]
        slot = next((s for s in self._mirror_slots if s.step == step and s.work is None), None)
        if slot is None:
            what = ("mirrors nothing (its source has no unique state, or mirror=False)"
                    if self.source is None
                    else f"holds complete mirrors of rank {self.source} at steps {complete}")
            raise KeyError(f"rank {self.rank} holds no complete mirror of step {step}; "
                           f"it {what}")
        return {e.key: _copy(_view(slot.buf, e), device) for e in self._mirror_entries}

    def slot_bytes(self) -> SlotSizes:
        """The sizes of this rank's slots (as :func:`slot_sizes` gives them)."""
        snap = self._slots[0].buf.numel() if self._slots else 0
        mirror = self._mirror_slots[0].buf.numel() if self._mirror_slots else 0
        return SlotSizes(snap, self._unique_end, mirror)

    def memory_bytes(self) -> int:
        """Host bytes held: both own snapshot slots and both mirror slots."""
        return sum(s.buf.numel() for s in self._slots + self._mirror_slots)

    def _give_back(self, keep_out=()) -> None:
        """Every slot's buffer back to its pool, except ``keep_out`` (lost: an exchange that
        will never be waited may still use them)."""
        for pool, slots in ((self.buffers, self._slots),
                            (self.mirror_buffers, self._mirror_slots)):
            for s in slots:
                self._settle_copy(s)               # a GPU copy never hangs on a dead peer
                if any(s.buf is b for b in keep_out):
                    pool.lose(s.buf)
                else:
                    pool.give(s.buf)
        self._slots, self._mirror_slots = [], []

    def settle(self) -> None:
        """Finish the exchange in flight and keep every buffer: the end of a generation that
        switched as planned, whose snapshots stay restorable for a while (its peers settle
        theirs too). A failed exchange is not an error: the half-received mirror is not
        counted (:meth:`holdings`)."""
        try:
            self.wait_mirror()
        except Exception:  # noqa: BLE001 - the slot is already marked invalid
            pass

    def close(self) -> None:
        """Finish the exchange in flight, then drop every buffer: the end of a generation
        that switched as planned (its buddy and source are alive and finish their part).

        An exchange that failed is not an error here. A generation that was abandoned (a
        recovery, a restart from a checkpoint) is ended with :meth:`drop` instead: its buddy
        may be dead, or alive but stuck, and waiting would last the group's timeout."""
        try:
            self.wait_mirror()                     # gloo may still be writing into a slot
        except Exception:  # noqa: BLE001 - gloo is done with a failed op (and its Work
            pass           # holds the buffers it used, so dropping ours is safe anyway)
        finally:
            self._give_back()                      # for the next generation's slots
            self._send, self._recv_slot = None, None

    def drop(self) -> list[tuple[object, torch.Tensor]]:
        """Drop every buffer now, without waiting for the exchange in flight.

        Returns the works still in flight, each with the buffer it reads or writes: the
        caller keeps them referenced and never waits on them (gloo may touch those buffers
        until the works end, when the peer's socket closes or the group times out). Only the
        slots in flight are kept that way; every other buffer is freed at once."""
        in_flight = []
        if self._send is not None:
            work, slot = self._send
            in_flight.append((work, slot.buf))
        slot = self._recv_slot
        if slot is not None and slot.work is not None:
            in_flight.append((slot.work, slot.buf))
        if self._poster is not None:
            # Still to post (waiting for the copies): it will post into these buffers, and
            # its works are never waited. Keep the thread with them.
            in_flight = [(self._poster, buf) for _, buf in in_flight]
            self._poster = None
        self._give_back(keep_out=[buf for _, buf in in_flight])
        self._send, self._recv_slot = None, None
        return in_flight

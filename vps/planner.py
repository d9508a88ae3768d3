"""The planner: which bytes move from which device to which, to turn one layout into another.

Inputs are metadata only (model, old layout, new layout, devices), so every rank computes the
same plan with no coordinator. The plan lists, per tensor group and state, the **copies** (the
destination device already holds the data under the old layout: no network) and the
**transfers** (device to device) that together deliver every element of every new piece exactly
once.

How it stays fast for 1024 devices: tensors that shard identically (same :attr:`signature`) and
live on the same old and new pipeline stages form a **tensor group** (e.g. the q projections of
the 12 layers that move from old stage 3 to new stage 2). The group is planned once and each
of its records stands for every tensor in it.

How sources are chosen: a destination region whose data some of its receivers already hold is
copied locally on those. The other receivers R of that region, and the holders H of the data,
define a **replica class** (H, R). Within a class, regions are taken largest first and each
(region, receiver) goes to the least-loaded holder on the receiver's node, or the least-loaded
holder anywhere if none shares the node (ties rotate by class so that remainders spread). A
class's decisions depend only on its own regions, which is what lets one rank plan just its own
part (:func:`plan_for_device`) and get exactly the records the full plan has for it.

How failures are survived: a **dead** device's state is gone unless a live device (its
**proxy**, e.g. the buddy that keeps a mirror of it in host memory) holds a copy of its old
local tensors. A proxy stands in for the dead device in every holder set: it sends that data
itself, or copies it locally when it is a receiver. Each move records the **owner** whose old
local tensor the region is read from, since a proxy reads from its own tensors or a mirror.

Pure metadata: no torch import.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from .boxes import Box, box_numel, intersect
from .layout import BoundLayout, Layout, LayoutError, bind
from .mapping import Piece, model_states, shard_pattern, state_itemsize
from .model import ModelSpec, TensorSpec


class PlanError(ValueError):
    """The switch cannot be planned (e.g. some state has no surviving copy)."""


class TensorGroup(NamedTuple):
    """Tensors that shard identically and sit on the same old and new stages."""

    names: tuple[str, ...]
    tensor: TensorSpec
    """A representative: every tensor of the group has its signature."""
    old_stages: tuple[int, ...]
    new_stages: tuple[int, ...]


class Move(NamedTuple):
    """One region of one state of every tensor in a group, from one device to another.

    ``src == dst`` is a local copy. ``src_piece``/``dst_piece`` say where ``box`` sits in the
    old local tensor of ``owner`` and the receiver's new local tensor (see
    :class:`~.mapping.Piece`). ``src`` is the process that reads and sends the data: the owner
    itself, or the owner's proxy when the owner is dead and ``src`` holds a mirror of it.
    """

    group: int
    state: str
    src: int
    dst: int
    box: Box
    src_piece: Piece
    dst_piece: Piece
    nbytes: int
    """Bytes per tensor of the group (multiply by ``len(group.names)`` for the total)."""
    owner: int = -1
    """The old device whose local tensor holds ``src_piece``; -1 means ``src`` itself. The
    planner always fills it in; the default keeps hand-built moves short."""

    @property
    def src_owner(self) -> int:
        """The device whose old local tensor ``src`` reads: ``owner``, or ``src`` if unset."""
        return self.src if self.owner < 0 else self.owner


class _Placed(NamedTuple):
    pieces: tuple[Piece, ...]
    devices: tuple[int, ...]


@dataclass
class Plan:
    """A switch plan: the moves, and the devices on either side."""

    model: ModelSpec
    old: BoundLayout
    new: BoundLayout
    groups: list[TensorGroup]
    copies: list[Move]
    transfers: list[Move]
    gpus_per_node: int
    class_loads: dict[tuple[int, ...], int] = field(default_factory=dict)
    """Network bytes each holder set H must send in total (input to the lower bound)."""
    need: dict[int, int] = field(default_factory=dict)
    """Network bytes each device must receive: its new state that it does not hold."""
    plan_seconds: float = 0.0

    def group_size(self, move: Move) -> int:
        return len(self.groups[move.group].names)

    def for_device(self, device: int) -> list[Move]:
        """Every move ``device`` takes part in (copies, sends and receives)."""
        return [m for m in self.copies + self.transfers if m.src == device or m.dst == device]


def tensor_groups(model: ModelSpec, old: BoundLayout, new: BoundLayout) -> list[TensorGroup]:
    """Group tensors by (signature, old stages, new stages), in model order."""
    groups: dict[tuple, list[TensorSpec]] = {}
    for t in model.tensors:
        key = (t.signature, old.stages_of(t.layer, t.tied_to_last),
               new.stages_of(t.layer, t.tied_to_last))
        groups.setdefault(key, []).append(t)
    return [TensorGroup(tuple(t.name for t in ts), ts[0], key[1], key[2])
            for key, ts in groups.items()]


def _placed(bound: BoundLayout, tensor: TensorSpec, state: str, stages: tuple[int, ...]
            ) -> list[_Placed]:
    """The state's distinct shards on ``stages``, each with the devices holding it."""
    grids = [bound.stage_devices[s] for s in stages]
    out = []
    for shard in shard_pattern(tensor, state, bound.layout):
        if len(grids) == 1:
            grid = grids[0]
            devices = tuple([grid[i] for i in shard.slots])
        else:
            devices = tuple([g[i] for g in grids for i in shard.slots])
        out.append(_Placed(shard.pieces, devices))
    return out


def _overlaps(olds: list[tuple[Piece, int]], news: list[tuple[Piece, int]]
              ) -> Iterable[tuple[Box, Piece, int, Piece, int]]:
    """Every overlapping (old piece, new piece) pair, by a sweep along dim 0.

    Pieces of one layout are disjoint and mostly thin along dim 0 (ZeRO flat ranges are runs
    of rows), so few are active at once and the join is close to linear.
    """
    if not olds or not news:
        return
    events = sorted([(p.box[0][0] if p.box else 0, 0, i) for i, (p, _) in enumerate(olds)]
                    + [(p.box[0][0] if p.box else 0, 1, i) for i, (p, _) in enumerate(news)])
    active: tuple[list, list] = ([], [])
    for start, side, i in events:
        item = (olds if side == 0 else news)[i]
        other = active[1 - side]
        if other:
            other[:] = [x for x in other if not x[0].box or x[0].box[0][1] > start]
            for o in other:
                region = intersect(item[0].box, o[0].box)
                if region is not None:
                    if side == 0:
                        yield region, item[0], item[1], o[0], o[1]
                    else:
                        yield region, o[0], o[1], item[0], item[1]
        active[side].append(item)


class _Item(NamedTuple):
    total: int          # bytes for the whole group, one receiver
    group: int
    state_index: int
    box: Box
    src_piece: Piece
    dst_piece: Piece
    nbytes: int         # bytes per tensor
    owners: tuple[int, ...]  # per holder of the class: whose old tensor it reads this from


def _validate_devices(old: Layout, new: Layout, dead: frozenset[int],
                      proxies: Mapping[int, int]) -> None:
    bad = sorted(dead & set(new.device_of))
    if bad:
        raise PlanError(f"device(s) {bad} are marked dead but the new layout uses them")
    known = set(old.device_of) | set(new.device_of)
    for d, p in sorted(proxies.items()):
        if d not in dead:
            raise PlanError(f"proxies[{d}] = {p}, but device {d} is not marked dead; only a dead "
                            f"device's state needs a proxy (dead: {sorted(dead)})")
        if p in dead:
            raise PlanError(f"proxies[{d}] = {p}, but device {p} is dead too; a proxy must be a "
                            "live device of the old or new layout")
        if p not in known:
            raise PlanError(f"proxies[{d}] = {p}, but device {p} is in neither layout; a proxy "
                            f"must be a live device of the old or new layout ({sorted(known)})")


def _senders(devices: tuple[int, ...], dead: frozenset[int], proxies: Mapping[int, int]
             ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(holders, owners) of one old shard once failures are taken into account.

    Live holders keep their place and read their own tensor. Only a shard with no live holder
    left is read from a mirror: a dead holder with a proxy is then replaced by the proxy. That
    is exactly what a mirror holds (a device mirrors the shards that no other device holds),
    so a replicated shard is never asked of a mirror. The proxy is listed once even if it
    stands in for several dead holders.
    """
    holders = [h for h in devices if h not in dead]
    owners = list(holders)
    if holders:
        return tuple(holders), tuple(owners)
    for h in devices:
        p = proxies.get(h) if h in dead else None
        if p is not None and p not in holders:
            holders.append(p)
            owners.append(h)
    return tuple(holders), tuple(owners)


def plan_switch(model: ModelSpec, old: Layout, new: Layout, *, gpus_per_node: int = 8,
                dead: Iterable[int] = (), proxies: Mapping[int, int] | None = None,
                only_device: int | None = None) -> Plan:
    """Plan the switch of ``model`` from ``old`` to ``new`` (layouts carry their devices).

    ``dead`` devices are not used as sources (their state is lost). ``proxies[d] = p`` says
    that live device ``p`` holds a mirror of dead device ``d``'s old local tensors (exactly its
    old pieces): ``p`` then serves ``d``'s data, and the moves it reads from the mirror have
    ``owner == d``. With ``only_device``, only the records that involve that device are produced
    (its own part of the plan): they are exactly the full plan's records for it, at a fraction
    of the cost.
    """
    t0 = time.perf_counter()
    if gpus_per_node < 1:
        raise PlanError(f"gpus_per_node={gpus_per_node} must be >= 1")
    ob, nb = bind(old, model), bind(new, model)
    dead_set = frozenset(dead)
    proxies = dict(proxies or {})
    _validate_devices(ob.layout, nb.layout, dead_set, proxies)
    groups = tensor_groups(model, ob, nb)
    states = model_states(model)
    copies: list[Move] = []
    classes: dict[tuple[tuple[int, ...], tuple[int, ...]], list[_Item]] = {}
    d = only_device
    # The old devices whose state ``d`` can read: its own (if alive) and its mirrors.
    held = None if d is None else (
        {d} - dead_set) | {dead_d for dead_d, p in proxies.items() if p == d}

    for gi, g in enumerate(groups):
        if d is not None and not _group_touches(g, ob, nb, d, held):
            continue
        n_tensors = len(g.names)
        for si, state in enumerate(states):
            itemsize = state_itemsize(g.tensor, state)
            olds = _placed(ob, g.tensor, state, g.old_stages)
            news = _placed(nb, g.tensor, state, g.new_stages)
            # Per old shard, on first use (one device's part touches few): its holders, whose
            # tensor each reads, and holder -> owner.
            senders: dict[int, tuple] = {}
            for region, op, oi, np_, ni in _region_pairs(olds, news, d, held):
                if oi not in senders:
                    devs = olds[oi].devices
                    hs, os_ = _senders(devs, dead_set, proxies) if dead_set else (devs, devs)
                    senders[oi] = (hs, os_, dict(zip(hs, os_)))
                holders, owners, owner_of = senders[oi]
                nbytes = box_numel(region) * itemsize
                remote = []
                for r in news[ni].devices:
                    owner = owner_of.get(r)
                    if owner is not None:
                        if d is None or r == d:
                            copies.append(Move(gi, state, r, r, region, op, np_, nbytes, owner))
                    else:
                        remote.append(r)
                if not remote:
                    continue
                if not holders:
                    raise PlanError(
                        f"no surviving copy of {g.names[0]} ({state}) region {list(region)}: "
                        f"all of its holders {sorted(olds[oi].devices)} are dead and none has "
                        "a proxy")
                classes.setdefault((holders, tuple(remote)), []).append(
                    _Item(nbytes * n_tensors, gi, si, region, op, np_, nbytes, owners))

    transfers, class_loads, need = _assign_sources(classes, states, gpus_per_node, d)
    plan = Plan(model, ob, nb, groups, copies, transfers, gpus_per_node, class_loads, need)
    plan.plan_seconds = time.perf_counter() - t0
    return plan


def plan_for_device(model: ModelSpec, old: Layout, new: Layout, device: int, **kw) -> Plan:
    """One device's own part of the plan: the moves it sends, receives or copies (``kw`` as
    for :func:`plan_switch`, e.g. ``dead`` and ``proxies``)."""
    return plan_switch(model, old, new, only_device=device, **kw)


def _group_touches(g: TensorGroup, ob: BoundLayout, nb: BoundLayout, device: int,
                   held: set[int]) -> bool:
    """Whether ``device`` can serve the group (it or a device it mirrors holds it under the old
    layout) or receives it under the new."""
    for owner in held:
        rank = ob.rank_of_device.get(owner)
        if rank is not None and ob.coords(rank)[0] in g.old_stages:
            return True
    rank = nb.rank_of_device.get(device)
    return rank is not None and nb.coords(rank)[0] in g.new_stages


def _region_pairs(olds: list[_Placed], news: list[_Placed], device: int | None,
                  held: set[int] | None = None):
    """Overlapping (old piece, new piece) pairs; with ``device``, only pairs it is part of.

    ``held`` are the old devices whose state ``device`` serves (itself if alive, and those it
    mirrors): it is a holder of an old shard exactly when one of them holds the shard.
    """
    def flat(placed, keep):
        return [(p, i) for i, s in enumerate(placed) if keep(s) for p in s.pieces]

    if device is None:
        yield from _overlaps(flat(olds, lambda s: True), flat(news, lambda s: True))
        return

    def mine_old(s: _Placed) -> bool:
        return not held.isdisjoint(s.devices)

    # Pairs where the device is a holder, then pairs where it is a receiver (and not a holder).
    yield from _overlaps(flat(olds, mine_old), flat(news, lambda s: True))
    yield from _overlaps(flat(olds, lambda s: not mine_old(s)),
                         flat(news, lambda s: device in s.devices))


def _assign_sources(classes, states, gpus_per_node: int, device: int | None):
    """Choose a holder for every (region, receiver) of every replica class."""
    transfers: list[Move] = []
    class_loads: dict[tuple[int, ...], int] = {}
    need: dict[int, int] = {}
    for (holders, receivers), items in classes.items():
        if device is not None and device not in holders and device not in receivers:
            continue  # an incomplete class seen from another device's pairs
        items.sort(key=lambda it: (-it.total, it.group, it.state_index, it.box))
        k = len(holders)
        # Rotate tie-breaks per class so that, across classes, the remainder of an uneven
        # split does not always land on the same holder.
        rot = zlib.crc32(repr((holders[:2], receivers[:2], len(items))).encode()) % k
        tiebreak = [(i - rot) % k for i in range(k)]
        nodes = [h // gpus_per_node for h in holders]
        candidates = []
        for r in receivers:
            same = [i for i in range(k) if nodes[i] == r // gpus_per_node]
            candidates.append(same or list(range(k)))
        loads = [0] * k
        for it in items:
            for r, cands in zip(receivers, candidates):
                if len(cands) == 1:
                    best = cands[0]
                else:
                    best = min(cands, key=lambda i: (loads[i], tiebreak[i]))
                loads[best] += it.total
                src = holders[best]
                if device is None or src == device or r == device:
                    transfers.append(Move(it.group, states[it.state_index], src, r, it.box,
                                          it.src_piece, it.dst_piece, it.nbytes,
                                          it.owners[best]))
        class_loads[holders] = class_loads.get(holders, 0) + sum(loads)
        per_receiver = sum(it.total for it in items)
        for r in receivers:
            need[r] = need.get(r, 0) + per_receiver
    return transfers, class_loads, need


__all__ = ["Move", "Plan", "PlanError", "TensorGroup", "plan_for_device", "plan_switch",
           "tensor_groups", "LayoutError"]

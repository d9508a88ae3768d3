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
define a **replica class** (H, R). Every (region, receiver) of every class gets its holder in
one assignment over all classes, against shared per-device loads on four ports (intra-node and
inter-node, send and receive: :mod:`.timemodel`; which devices share a node is the node map of
:mod:`.topology`), so that the modelled pause approaches its
lower bound and the busiest device's bytes approach theirs (:func:`_assign_sources`): a busier
NVLink sender can still finish before an idle remote one, and a device's load in one class is
seen by every other. Large regions are cut along their first dim so that the work can be
spread over holders. Because the choice for one device depends on every device's load,
:func:`plan_for_device` plans in full and keeps that device's records: exactly the full plan's,
since every rank computes the same deterministic assignment from the same inputs.

How failures are survived: a **dead** device's state is gone unless a live device (its
**proxy**, e.g. the buddy that keeps a mirror of it in host memory) holds a copy of its old
local tensors. A proxy stands in for the dead device in every holder set: it sends that data
itself, or copies it locally when it is a receiver. Each move records the **owner** whose old
local tensor the region is read from, since a proxy reads from its own tensors or a mirror.

Pure metadata: no torch import.
"""

from __future__ import annotations

import gc
import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from .boxes import Box, box_numel, intersect
from .layout import BoundLayout, Layout, LayoutError, bind
from .mapping import Piece, model_states, shard_pattern, state_itemsize
from .model import ModelSpec, TensorSpec
from .timemodel import Links, lower_bound_bytes, lower_bound_ratio, lower_bound_seconds
from .localsearch import WINDOW, improve
from .topology import DEFAULT_DEVICES_PER_NODE, Nodes, check_nodes, node_table


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
    devices_per_node: Nodes
    """Where the devices run, as the sources were chosen for: devices per node, or device ->
    node name (:mod:`.topology`)."""
    need: dict[int, int] = field(default_factory=dict)
    """Network bytes each device must receive: its new state that it does not hold."""
    demand: dict[tuple[int, ...], dict[int, int]] = field(default_factory=dict)
    """Bytes each receiver needs from the data held exactly by each holder set (the input to
    both lower bounds, :mod:`.timemodel`)."""
    links: Links = field(default_factory=Links)
    """The link bandwidths the sources were chosen for."""
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


def plan_switch(model: ModelSpec, old: Layout, new: Layout, *,
                devices_per_node: Nodes = DEFAULT_DEVICES_PER_NODE,
                dead: Iterable[int] = (), proxies: Mapping[int, int] | None = None,
                links: Links | None = None, only_device: int | None = None) -> Plan:
    """Plan the switch of ``model`` from ``old`` to ``new`` (layouts carry their devices).

    ``dead`` devices are not used as sources (their state is lost). ``proxies[d] = p`` says
    that live device ``p`` holds a mirror of dead device ``d``'s old local tensors (exactly its
    old pieces): ``p`` then serves ``d``'s data, and the moves it reads from the mirror have
    ``owner == d``. ``links`` are the intra- and inter-node bandwidths the sources are chosen
    for (default: H100 NVLink and one 400 Gb/s NIC per GPU, :mod:`.timemodel`).
    ``devices_per_node`` says which devices share a node (:mod:`.topology`): devices per node
    (node ``device // devices_per_node``), or device -> node name where the real nodes are known
    (a device missing from it is a node of its own); every rank must pass the same. With
    ``only_device``, only the records that involve that device are kept (its own part of the
    plan): exactly the full plan's records for it, in the same order. Sources are chosen by one
    assignment over all devices' loads, so that part costs as much as the full plan.
    """
    t0 = time.perf_counter()
    check_nodes(devices_per_node, "devices_per_node", PlanError)
    if not isinstance(devices_per_node, int):
        # The plan keeps the map it was made for: a caller's later edit must not change it.
        devices_per_node = dict(devices_per_node)
    # Planning allocates hundreds of thousands of small tuples and no reference cycles: the
    # cyclic collector's passes over them would double the time, so it waits until we are done.
    paused = gc.isenabled()
    gc.disable()
    try:
        plan = _plan(model, old, new, devices_per_node, dead, proxies, links, only_device)
    finally:
        if paused:
            gc.enable()
    plan.plan_seconds = time.perf_counter() - t0
    return plan


def _plan(model, old, new, devices_per_node, dead, proxies, links, only_device) -> Plan:
    links = links or Links()
    ob, nb = bind(old, model), bind(new, model)
    dead_set = frozenset(dead)
    proxies = dict(proxies or {})
    _validate_devices(ob.layout, nb.layout, dead_set, proxies)
    # Every holder is a device of the old layout or a proxy, every receiver one of the new.
    nodes = node_table(devices_per_node, set(ob.layout.device_of) | set(nb.layout.device_of))
    groups = tensor_groups(model, ob, nb)
    states = model_states(model)
    copies: list[Move] = []
    classes: dict[tuple[tuple[int, ...], tuple[int, ...]], list[_Item]] = {}

    for gi, g in enumerate(groups):
        n_tensors = len(g.names)
        for si, state in enumerate(states):
            itemsize = state_itemsize(g.tensor, state)
            olds = _placed(ob, g.tensor, state, g.old_stages)
            news = _placed(nb, g.tensor, state, g.new_stages)
            # Per old shard, on first use: its holders, whose tensor each reads, holder -> owner.
            senders: dict[int, tuple] = {}
            flat_old = [(p, i) for i, s in enumerate(olds) for p in s.pieces]
            flat_new = [(p, i) for i, s in enumerate(news) for p in s.pieces]
            for region, op, oi, np_, ni in _overlaps(flat_old, flat_new):
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

    transfers, demand = _assign_sources(classes, states, devices_per_node, nodes, links)
    need: dict[int, int] = {}
    for per_r in demand.values():
        for r, b in per_r.items():
            need[r] = need.get(r, 0) + b
    if only_device is not None:
        d = only_device
        copies = [m for m in copies if m.dst == d]
        transfers = [m for m in transfers if m.src == d or m.dst == d]
    return Plan(model, ob, nb, groups, copies, transfers, devices_per_node, need, demand=demand,
                links=links)


def plan_for_device(model: ModelSpec, old: Layout, new: Layout, device: int, **kw) -> Plan:
    """One device's own part of the plan: the moves it sends, receives or copies (``kw`` as
    for :func:`plan_switch`, e.g. ``dead`` and ``proxies``). Every device's loads decide every
    source (:func:`_assign_sources`), so this plans in full and keeps the device's records."""
    return plan_switch(model, old, new, only_device=device, **kw)


#: Regions larger than 1/CHUNKS of the busiest device's bound (in bytes, or in bytes the
#: inter-node link carries in the time bound) are cut along their first splittable dim, so
#: that no single choice can unbalance the devices by more than that fraction.
CHUNKS = 48
MAX_CUTS = 64
#: A holder on the receiver's node is chosen while the costs it leaves stay within this
#: multiple of the bounds (times the joint bound where both cannot be met).
NEAR_OK = 1.0


def _split(it: _Item, chunk: float) -> list[_Item]:
    """``it`` cut into pieces of at most about ``chunk`` bytes along its first dim of extent
    >= 2 (rows first: a run of whole rows stays contiguous)."""
    pieces = min(MAX_CUTS, -(-it.total // max(1, int(chunk))))
    box = it.box
    for dim, (lo, hi) in enumerate(box):
        if hi - lo >= 2:
            break
    else:
        return [it]
    pieces = min(pieces, hi - lo)
    if pieces <= 1:
        return [it]
    n_tensors = it.total // it.nbytes
    per_elem = it.nbytes // box_numel(box)
    out = []
    for j in range(pieces):
        a, b = lo + (hi - lo) * j // pieces, lo + (hi - lo) * (j + 1) // pieces
        sub = box[:dim] + ((a, b),) + box[dim + 1:]
        nbytes = box_numel(sub) * per_elem
        out.append(it._replace(total=nbytes * n_tensors, box=sub, nbytes=nbytes))
    return out


def _assign_sources(classes, states, devices_per_node: Nodes, node: Mapping[int, str],
                    links: Links):
    """Choose a holder for every (region, receiver) of every replica class, over all classes at
    once, to minimise the modelled makespan while keeping the busiest device's bytes near
    their bound.

    Each device's cost is ``max(time / T_lb, bytes / B_lb)``: its modelled time (four ports,
    :mod:`.timemodel`) and its max(sent, received) bytes, each over its lower bound, so 1.0 is
    optimal on both counts; where the two bounds cannot both be met (a holder's NVLink
    neighbours need more than its byte share), the larger ratio is what is minimised.

    Forced choices (one holder) are placed first. Then the (region, receiver) pairs that have
    a holder on the receiver's node, largest first: such a holder takes the pair while the
    costs it leaves stay within the bounds (NVLink is the cheap way to deliver it), else the
    pair goes to the holder that minimises the larger cost of sender and receiver after the
    move (then the sender's send-side cost; ties rotate per class). Then the pairs with no
    holder on the receiver's node, largest first, by the same rule. Regions larger than
    ``1/CHUNKS`` of the byte bound are cut into chunks first so that the choices can balance.
    A local search (:func:`~.localsearch.improve`) then moves single pairs off the costliest device.
    Everything is a deterministic function of the inputs. ``node[d]`` is device ``d``'s node
    under the node map ``devices_per_node`` (:func:`~.topology.node_table`); nodes are only
    compared, so the choices do not depend on how nodes are named.
    """
    demand: dict[tuple[int, ...], dict[int, int]] = {}
    for (holders, receivers), items in classes.items():
        per = sum(it.total for it in items)
        dh = demand.setdefault(holders, {})
        for r in receivers:
            dh[r] = dh.get(r, 0) + per
    if not classes:
        return [], demand
    b_lb = lower_bound_bytes(demand)
    t_lb = lower_bound_seconds(demand, devices_per_node, links)
    wi, we, wb = 1 / (links.intra * t_lb), 1 / (links.inter * t_lb), 1 / b_lb
    chunk = b_lb / CHUNKS
    # Where the two bounds provably conflict, a holder on the receiver's node may go as far
    # as the joint bound before the pair looks elsewhere.
    near_ok = NEAR_OK * lower_bound_ratio(demand, devices_per_node, links, t_lb, b_lb)

    top = 1 + max(max(max(h), max(r)) for h, r in classes)
    isd, esd, ird, erd = [0] * top, [0] * top, [0] * top, [0] * top
    pieces = []    # (item, class index): the regions to send, cut where large
    order = []     # (phase, -bytes, piece index, receiver): one per choice to make
    info = []      # per class: holders, their nodes, tie-break rotation
    near = []      # per class: node -> indices of the holders on it
    for ci, ((holders, receivers), items) in enumerate(classes.items()):
        k = len(holders)
        rot = zlib.crc32(repr((holders[:2], receivers[:2], len(items))).encode()) % k
        hnodes = [node[h] for h in holders]
        info.append((holders, hnodes, rot))
        by_node: dict[str, list[int]] = {}
        for i, n in enumerate(hnodes):
            by_node.setdefault(n, []).append(i)
        near.append(by_node)
        if k == 1:
            for it in items:
                pi = len(pieces)
                pieces.append((it, ci))
                order.extend([(0, 0, pi, r) for r in receivers])
            continue
        items.sort(key=lambda it: (-it.total, it.group, it.state_index, it.box))
        phase = [1 if node[r] in by_node else 2 for r in receivers]
        for it in items:
            for p in (_split(it, chunk) if it.total > chunk else (it,)):
                pi = len(pieces)
                pieces.append((p, ci))
                order.extend([(ph, -p.total, pi, r) for ph, r in zip(phase, receivers)])
    # Forced choices first, then the ones with a holder on the receiver's node (few good
    # options), then the rest (any holder is as far as another); largest first within each,
    # then in class and region order.
    order.sort()
    jobs = [(*pieces[pi], r) for _, _, pi, r in order]
    del order
    choice = [0] * len(jobs)
    for ji, (it, ci, r) in enumerate(jobs):
        holders, hnodes, rot = info[ci]
        b = it.total
        k = len(holders)
        if k == 1:
            h = holders[0]
            if hnodes[0] == node[r]:
                isd[h] += b
                ird[r] += b
            else:
                esd[h] += b
                erd[r] += b
            continue
        rn = node[r]
        ir_, er_ = ird[r], erd[r]
        r_send = max(isd[r] * wi, esd[r] * we, (isd[r] + esd[r]) * wb)
        rb = (ir_ + er_ + b) * wb
        rc_near = max((ir_ + b) * wi, er_ * we, rb, r_send)
        rc_far = max(ir_ * wi, (er_ + b) * we, rb, r_send)
        mine = near[ci].get(rn)
        # A holder on the receiver's node is taken while it stays within both bounds: its
        # bytes would go over NVLink; otherwise the best of all (or of a rotating window).
        passes = [mine, None] if mine else [None]
        for cands in passes:
            if cands is None:
                if k <= WINDOW:
                    cands = range(rot, rot + k)
                else:
                    off = rot + ji
                    cands = [*(mine or ()), *range(off, off + WINDOW)]
            best = -1
            best_c = best_s = 0.0
            for j in cands:
                i = j % k
                h = holders[i]
                i_, e_ = isd[h], esd[h]
                if hnodes[i] == rn:
                    s = max((i_ + b) * wi, e_ * we, (i_ + e_ + b) * wb)
                    c = rc_near
                else:
                    s = max(i_ * wi, (e_ + b) * we, (i_ + e_ + b) * wb)
                    c = rc_far
                if s > c:
                    c = s
                h_recv = max(ird[h] * wi, erd[h] * we, (ird[h] + erd[h]) * wb)
                if h_recv > c:
                    c = h_recv
                if best < 0 or c < best_c or (c == best_c and s < best_s):
                    best, best_c, best_s = i, c, s
            if best_c <= near_ok:
                break
        choice[ji] = best
        h = holders[best]
        if hnodes[best] == rn:
            isd[h] += b
            ird[r] += b
        else:
            esd[h] += b
            erd[r] += b

    improve(jobs, choice, info, near, node, (isd, esd, ird, erd), (wi, we, wb))

    transfers = []
    for ji, (it, ci, r) in enumerate(jobs):
        holders = info[ci][0]
        best = choice[ji]
        transfers.append(Move(it.group, states[it.state_index], holders[best], r, it.box,
                              it.src_piece, it.dst_piece, it.nbytes, it.owners[best]))
    return transfers, demand


__all__ = ["Move", "Plan", "PlanError", "TensorGroup", "plan_for_device", "plan_switch",
           "tensor_groups", "LayoutError"]

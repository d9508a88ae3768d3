"""Independent check of a plan against the mapping: nothing missing, nothing twice, no fiction.

For every device of the new layout and every tensor and state it holds, the moves delivered
to it must tile its new pieces exactly: each move lies inside one of its pieces, no two moves
overlap, and together they cover every element. Every move's owner must really hold the
region under the old layout, at the place the move says, and the move must be sent by that
owner or, when the owner is dead, by the proxy holding its mirror: no dead device ever sends.
This re-derives what each device
holds from :func:`~.mapping.rank_shards` alone, not from the planner's internals, so it is the
reference the property tests hold the planner to. Cost grows with the model and world size:
it is meant for tests and for ``dynatrain plan --verify`` on small jobs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from .boxes import box_numel, intersect
from .mapping import rank_shards
from .planner import Plan, PlanError


def _contains(outer, inner) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def verify_plan(plan: Plan, dead: frozenset[int] = frozenset(),
                proxies: Mapping[int, int] | None = None) -> None:
    """Raise PlanError describing the first problem found; return None if the plan is sound.

    ``dead`` and ``proxies`` are the failures the plan was made for (see
    :func:`~.planner.plan_switch`): a dead device's pieces are still what its proxy's mirror
    holds, so they are kept, but only the proxy may read them.
    """
    old, new = plan.old, plan.new
    proxies = proxies or {}
    holds = {}  # (device, tensor name, state) -> pieces, under the old layout (dead ones too)
    for rank in range(old.world):
        device = old.device_of[rank]
        for rs in rank_shards(old, rank):
            holds[(device, rs.tensor.name, rs.state)] = set(rs.pieces)

    delivered = defaultdict(list)  # (device, tensor name, state) -> [(box, dst_piece)]
    for move in plan.copies + plan.transfers:
        group = plan.groups[move.group]
        owner = move.src_owner
        if move.src in dead:
            raise PlanError(f"dead device {move.src} is used as a source")
        if owner in dead:
            if proxies.get(owner) != move.src:
                raise PlanError(f"device {move.src} reads dead device {owner}'s state, but "
                                f"the proxy of {owner} is {proxies.get(owner, 'none')}")
        elif owner != move.src:
            raise PlanError(f"device {move.src} reads live device {owner}'s old state; only a "
                            "dead device's state is read by another device (its proxy)")
        for name in group.names:
            src_pieces = holds.get((owner, name, move.state))
            if src_pieces is None or move.src_piece not in src_pieces:
                raise PlanError(f"device {owner} does not hold {name} ({move.state}) piece "
                                f"{move.src_piece} under the old layout, but device "
                                f"{move.src} reads it from there")
            if not _contains(move.src_piece.box, move.box):
                raise PlanError(f"{name} ({move.state}): region {move.box} is not inside the "
                                f"source piece {move.src_piece.box}")
            delivered[(move.dst, name, move.state)].append((move.box, move.dst_piece))

    for rank in range(new.world):
        device = new.device_of[rank]
        for rs in rank_shards(new, rank):
            key = (device, rs.tensor.name, rs.state)
            got = delivered.pop(key, [])
            pieces = set(rs.pieces)
            for box, piece in got:
                if piece not in pieces or not _contains(piece.box, box):
                    raise PlanError(f"device {device} receives {rs.tensor.name} ({rs.state}) "
                                    f"region {box} outside its new pieces")
            for i in range(len(got)):
                for j in range(i + 1, len(got)):
                    if intersect(got[i][0], got[j][0]) is not None:
                        raise PlanError(f"device {device} receives {rs.tensor.name} "
                                        f"({rs.state}) region {intersect(got[i][0], got[j][0])} "
                                        "twice")
            want = sum(box_numel(p.box) for p in rs.pieces)
            have = sum(box_numel(b) for b, _ in got)
            if want != have:
                raise PlanError(f"device {device} gets {have} of the {want} elements of "
                                f"{rs.tensor.name} ({rs.state}) it needs")
    if delivered:
        key = next(iter(delivered))
        raise PlanError(f"device {key[0]} is sent {key[1]} ({key[2]}), which it does not hold "
                        "under the new layout")

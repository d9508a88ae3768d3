"""Placement: which device takes which rank of the new layout, so that data stays where it is.

The devices a new layout runs on are given (the survivors, plus any joiners); the order in
which its ranks take them is ours to choose. A pipeline stage's state is by far the largest
thing a device holds, so we match stages: each new stage claims, in order of shared bytes, the
devices of the old stage whose layers overlap it most; leftover slots take the remaining
devices (joiners last). Within a stage, if its shape (dp, tp, ep, ZeRO) is unchanged the
devices keep their (dp, tp) coordinates, so their state does not move at all; otherwise each
device takes the free coordinate whose shards overlap its old ones most (greedy on a score
matrix computed once per shard rule from the stage-independent shard patterns), so that, for
example, a device holding experts 2 and 3 under ep=4 becomes the ep=8 rank that needs expert 2
or 3. The result is kept only if it retains at least as many bytes in place as the order given.

Deterministic, and cheap next to planning, so every rank computes the same placement.
"""

from __future__ import annotations

from .boxes import box_numel
from .layout import BoundLayout, Layout, bind
from .mapping import model_states, shard_pattern, state_itemsize
from .model import ModelSpec
from .planner import _overlaps


def _stage_bytes(model: ModelSpec, old: BoundLayout, new: BoundLayout) -> dict:
    """Parameters shared by (old stage, new stage): the weight of keeping a stage's devices."""
    shared: dict[tuple[int, int], int] = {}
    for t in model.tensors:
        for s in old.stages_of(t.layer, t.tied_to_last):
            for s2 in new.stages_of(t.layer, t.tied_to_last):
                shared[(s, s2)] = shared.get((s, s2), 0) + t.numel
    return shared


def _retained(shared: dict, old: BoundLayout, new: BoundLayout, devices) -> int:
    """Estimated parameters kept in place if new rank i runs on ``devices[i]``."""
    total = 0
    for rank, d in enumerate(devices):
        old_rank = old.rank_of_device.get(d)
        if old_rank is not None:
            total += shared.get((old.coords(old_rank)[0], new.coords(rank)[0]), 0)
    return total


def place_devices(model: ModelSpec, old: Layout, new: Layout, devices) -> Layout:
    """``new`` with its rank → device list chosen from ``devices`` to keep data in place."""
    devices = tuple(devices)
    given = new.with_devices(devices)
    ob, nb = bind(old, model), bind(given, model)
    shared = _stage_bytes(model, ob, nb)
    per_stage = new.dp * new.tp

    by_old_stage: dict[int, list[int]] = {}
    for d in sorted(devices, key=lambda d: ob.rank_of_device.get(d, 1 << 60)):
        r = ob.rank_of_device.get(d)
        by_old_stage.setdefault(ob.coords(r)[0] if r is not None else -1, []).append(d)

    slots: dict[int, list[int]] = {s: [] for s in range(new.pp)}
    for (s, s2), _ in sorted(shared.items(), key=lambda kv: (-kv[1], kv[0][1], kv[0][0])):
        pool = by_old_stage.get(s, [])
        take = per_stage - len(slots[s2])
        if take > 0 and pool:
            slots[s2].extend(pool[:take])
            del pool[:take]
    rest = [d for s in sorted(by_old_stage, key=lambda s: (s < 0, s)) for d in by_old_stage[s]]
    for s2 in range(new.pp):
        take = per_stage - len(slots[s2])
        slots[s2].extend(rest[:take])
        del rest[:take]

    same_shape = (old.dp, old.tp, old.ep, old.zero) == (new.dp, new.tp, new.ep, new.zero)
    scores = None if same_shape else _coordinate_scores(model, ob, nb)
    chosen = [0] * new.world
    for s2, devs in slots.items():
        stage_ranks = sorted(r for r in range(new.world) if nb.coords(r)[0] == s2)
        if scores is None:
            for r, d in zip(stage_ranks, devs):
                chosen[r] = d
        else:
            for r, d in _match_coordinates(ob, nb, stage_ranks, devs, scores):
                chosen[r] = d
    if _retained(shared, ob, nb, chosen) >= _retained(shared, ob, nb, devices):
        return new.with_devices(chosen)
    return given


def _coordinate_scores(model: ModelSpec, ob: BoundLayout, nb: BoundLayout) -> dict:
    """Bytes shared by old (dp, tp) coordinates and new ones, summed over the model's tensors.

    Stage-independent (from shard patterns), weighted by how many tensors share each rule.
    """
    count: dict = {}
    rep = {}
    for t in model.tensors:
        count[t.signature] = count.get(t.signature, 0) + 1
        rep.setdefault(t.signature, t)
    scores: dict[tuple, int] = {}
    for sig, t in rep.items():
        for state in model_states(model):
            olds = shard_pattern(t, state, ob.layout)
            news = shard_pattern(t, state, nb.layout)
            weight = count[sig] * state_itemsize(t, state)
            old_pieces = [(p, i) for i, s in enumerate(olds) for p in s.pieces]
            new_pieces = [(p, i) for i, s in enumerate(news) for p in s.pieces]
            for region, _, oi, _, ni in _overlaps(old_pieces, new_pieces):
                b = box_numel(region) * weight
                for h in olds[oi].holders:
                    for r in news[ni].holders:
                        scores[(h, r)] = scores.get((h, r), 0) + b
    return scores


def _match_coordinates(ob: BoundLayout, nb: BoundLayout, stage_ranks, devices, scores):
    """Greedy: best-scoring (device, new rank) pairs first; joiners fill what is left."""
    slots = {r: nb.coords(r)[1:] for r in stage_ranks}
    pairs = []
    for d in devices:
        old_rank = ob.rank_of_device.get(d)
        if old_rank is None:
            continue
        c = ob.coords(old_rank)[1:]
        for r, c2 in slots.items():
            s = scores.get((c, c2), 0)
            if s:
                pairs.append((-s, old_rank, r, d))
    pairs.sort()
    taken_d, taken_r, out = set(), set(), []
    for _, _, r, d in pairs:
        if d not in taken_d and r not in taken_r:
            taken_d.add(d)
            taken_r.add(r)
            out.append((r, d))
    free = iter(d for d in devices if d not in taken_d)
    out.extend((r, next(free)) for r in stage_ranks if r not in taken_r)
    return out

"""Process groups of one layout: tp, dp, expert-dp, ep, pipeline neighbours, and two small ones.

Every rank creates every group, in the same order (torch.distributed requires that), but keeps
only the ones it belongs to. Groups of one rank are None: collectives over them are skipped.
The two small groups carry gradients the model's structure shares: ``embed`` ties the input
embedding on the first pipeline stage to its replica on the last; ``kv`` joins the TP ranks that
hold the same replicated GQA kv head (when tp exceeds the kv heads), whose gradients must be
summed because each rank's share comes from different query heads.

``make_group`` is injectable so that the elastic device manager can build the same groups from
a rendezvous store with a per-generation prefix instead of the default world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from dynatrain.vps.layout import BoundLayout


@dataclass
class ParallelGroups:
    rank: int
    pp_index: int
    dp_index: int
    tp_index: int
    tp: object = None
    dp: object = None
    edp: object = None
    ep: object = None
    embed: object = None
    kv: object = None
    prev_rank: int | None = None
    """Global rank of the previous pipeline stage's peer (same dp, tp), or None on stage 0."""
    next_rank: int | None = None

    @property
    def first_stage(self) -> bool:
        return self.prev_rank is None

    @property
    def last_stage(self) -> bool:
        return self.next_rank is None


def group_rank_lists(bound: BoundLayout) -> list[tuple[str, list[int]]]:
    """Every group of the layout as (kind, global ranks), in a fixed order."""
    lay, model = bound.layout, bound.model
    r = lay.rank
    out: list[tuple[str, list[int]]] = []
    for p in range(lay.pp):
        for j in range(lay.dp):
            out.append(("tp", [r(p, j, t) for t in range(lay.tp)]))
        for t in range(lay.tp):
            out.append(("dp", [r(p, j, t) for j in range(lay.dp)]))
            for e in range(lay.ep):
                out.append(("edp", [r(p, j, t) for j in range(e, lay.dp, lay.ep)]))
            for g in range(lay.dp // lay.ep):
                out.append(("ep", [r(p, j, t) for j in range(g * lay.ep, (g + 1) * lay.ep)]))
        nkv = model.num_kv_heads
        if lay.tp > nkv:
            per = lay.tp // nkv
            for j in range(lay.dp):
                for h in range(nkv):
                    out.append(("kv", [r(p, j, t) for t in range(h * per, (h + 1) * per)]))
    if model.tie_embeddings and lay.pp > 1:
        for j in range(lay.dp):
            for t in range(lay.tp):
                out.append(("embed", [r(0, j, t), r(lay.pp - 1, j, t)]))
    return out


def build_groups(bound: BoundLayout, rank: int,
                 make_group: Callable[[list[int]], object] | None = None) -> ParallelGroups:
    """Create the layout's groups (collective: every rank of the world must call it)."""
    make_group = make_group or (lambda ranks: dist.new_group(ranks))
    lay = bound.layout
    p, j, t = lay.coords(rank)
    groups = ParallelGroups(rank=rank, pp_index=p, dp_index=j, tp_index=t)
    for kind, ranks in group_rank_lists(bound):
        if len(ranks) == 1:
            continue
        handle = make_group(ranks)
        if rank in ranks:
            setattr(groups, kind, handle)
    if p > 0:
        groups.prev_rank = lay.rank(p - 1, j, t)
    if p < lay.pp - 1:
        groups.next_rank = lay.rank(p + 1, j, t)
    return groups

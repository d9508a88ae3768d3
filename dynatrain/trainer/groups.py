"""Process groups of one layout: tp, dp, expert-dp, ep, pipeline neighbours, and two small ones.

Every rank asks for every group, in the same order (``torch.distributed.new_group`` requires
that), but keeps only the ones it belongs to. Groups of one rank are None: collectives over
them are skipped. ``pp`` joins a (dp, tp) position's ranks across stages, in stage order, so
activations travel with the group's own send/recv by stage index; ``world`` carries the loss.
The two small groups carry gradients the model's structure shares: ``embed`` ties the input
embedding on the first pipeline stage to its replica on the last; ``kv`` joins the TP ranks that
hold the same replicated GQA kv head (when tp exceeds the kv heads), whose gradients must be
summed because each rank's share comes from different query heads.

``make_group(kind, ranks)`` is injectable so that the elastic device manager can build the same
groups from a rendezvous store with a per-generation prefix instead of the default world; the
trainer only uses the groups' own methods and ``dist`` collectives that take a group object, so
such unregistered groups work.
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
    pp: object = None
    """This (dp, tp) position's ranks across stages; its rank i is stage i."""
    world: object = None
    pp_size: int = 1

    @property
    def first_stage(self) -> bool:
        return self.pp_index == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_index == self.pp_size - 1


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
    for j in range(lay.dp):
        for t in range(lay.tp):
            out.append(("pp", [r(p, j, t) for p in range(lay.pp)]))
    out.append(("world", list(range(lay.world))))
    return out


def build_groups(bound: BoundLayout, rank: int,
                 make_group: Callable[[str, list[int]], object] | None = None
                 ) -> ParallelGroups:
    """Create the layout's groups. With the default ``make_group`` (``dist.new_group``) this
    is collective: every rank of the default world must call it."""
    make_group = make_group or (lambda kind, ranks: dist.new_group(ranks))
    lay = bound.layout
    p, j, t = lay.coords(rank)
    groups = ParallelGroups(rank=rank, pp_index=p, dp_index=j, tp_index=t, pp_size=lay.pp)
    for kind, ranks in group_rank_lists(bound):
        if len(ranks) == 1:
            continue
        handle = make_group(kind, ranks)
        if rank in ranks:
            setattr(groups, kind, handle)
    return groups


def shut_down(groups: ParallelGroups | None) -> int:
    """Shut down a generation's process groups that are done with: NCCL's (and nccl-sim's)
    communicators explicitly, gloo's by dropping them. Call it on the training thread at a
    quiet point (after a step, nothing of theirs in flight): torch's ``ProcessGroupNCCL``
    tears a communicator down with ``ncclCommDestroy``, which must not race kernels the same
    thread is launching on other communicators. Returns the number shut down explicitly."""
    if groups is None:
        return 0
    seen, n = set(), 0
    for g in (groups.tp, groups.dp, groups.edp, groups.ep, groups.embed, groups.kv, groups.pp,
              groups.world):
        if g is None or id(g) in seen or isinstance(g, dist.ProcessGroupGloo):
            continue
        seen.add(id(g))
        if hasattr(g, "shutdown"):
            g.shutdown()
            n += 1
    return n

"""Full, unsharded training state: assembled from every rank's pieces, or cut into them.

:func:`assemble_full` is the inverse of allocation: each rank's local tensor is cut back into
its pieces and each piece written to its box of the logical tensor. :func:`local_from_full`
goes the other way for any layout. Together they let tests compare runs under different
layouts and start a job from a given state under any layout (the same contract a live switch
fulfils without ever materialising the full state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynatrain.vps.boxes import box_extents
from dynatrain.vps.mapping import rank_shards

from .trainer import LocalState


@dataclass
class FullState:
    tensors: dict[tuple[str, str], torch.Tensor]
    """(tensor name, state kind) -> full tensor."""
    step: int
    data_position: int

    def __getitem__(self, key):
        return self.tensors[key]

    def items(self):
        return self.tensors.items()


def local_from_full(full: FullState, bound, rank: int) -> LocalState:
    """What ``rank`` of ``bound`` holds of ``full``, as the mapping describes it."""
    tensors = {}
    for rs in rank_shards(bound, rank):
        src = full.tensors[(rs.tensor.name, rs.state)]
        local = torch.empty(rs.local_shape, dtype=src.dtype)
        for p in rs.pieces:
            dst = local[tuple(slice(a, b) for a, b in p.local)]
            dst.copy_(src[tuple(slice(a, b) for a, b in p.box)].reshape(dst.shape))
        tensors[(rs.tensor.name, rs.state)] = (local, rs.pieces)
    return LocalState(tensors, full.step, full.data_position)


def assemble_full(model, states: list[LocalState]) -> FullState:
    """The full state, from the LocalStates of all ranks."""
    specs = {t.name: t for t in model.tensors}
    full: dict[tuple[str, str], torch.Tensor] = {}
    for st in states:
        for (name, kind), (local, pieces) in st.tensors.items():
            if (name, kind) not in full:
                full[(name, kind)] = torch.full(specs[name].shape, float("nan"),
                                                dtype=local.dtype)
            out = full[(name, kind)]
            for p in pieces:
                src = local[tuple(slice(a, b) for a, b in p.local)]
                out[tuple(slice(a, b) for a, b in p.box)] = src.reshape(box_extents(p.box)).cpu()
    missing = [k for k, t in full.items() if torch.isnan(t).any()]
    if missing:
        raise ValueError(f"no rank holds part of {missing[0][0]} ({missing[0][1]})")
    return FullState(full, states[0].step, states[0].data_position)

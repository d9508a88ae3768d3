"""Known full tensors and their cuts into local tensors, for tests of the transition engine."""

import torch

from dynatrain.vps.mapping import model_states, rank_shards
from dynatrain.vps.regions import piece_view


def full_state(model, seed: int) -> dict:
    """(tensor name, state) -> a random full tensor, the same in every process."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in model.tensors:
        for state in model_states(model):
            dtype = getattr(torch, model.dtype) if state == "param" else torch.float32
            out[(t.name, state)] = torch.randn(t.shape, generator=gen).to(dtype)
    return out


def box_of(full: torch.Tensor, box) -> torch.Tensor:
    return full[tuple(slice(a, b) for a, b in box)]


def cut(bound, device: int, full: dict) -> tuple[dict, dict]:
    """The local tensors of ``device`` under ``bound`` (and their pieces), cut from the full
    tensors."""
    local, pieces = {}, {}
    for rs in rank_shards(bound, bound.rank_of_device[device]):
        key = (rs.tensor.name, rs.state)
        t = torch.empty(rs.local_shape, dtype=full[key].dtype)
        for piece in rs.pieces:
            piece_view(t, piece).copy_(box_of(full[key], piece.box))
        local[key], pieces[key] = t, rs.pieces
    return local, pieces

"""Where a region of the global index space lies in a device's local tensors, as torch views.

A local tensor holds one or more *pieces* of a global tensor (the mapping's boxes, each at a
place in the local tensor); a move of the plan names a *box* inside one piece. These helpers
turn (piece, box) into views without copying. The box arithmetic is cached per (piece, box)
and done ahead of the pause (:func:`warm_up_regions`), so the pause only slices.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .boxes import box_extents, relative
from .planner import Plan


def piece_view(local: torch.Tensor, piece) -> torch.Tensor:
    """The elements of ``piece`` inside a local tensor, shaped like its global box (a view)."""
    return local[tuple(slice(a, b) for a, b in piece.local)].reshape(box_extents(piece.box))


@lru_cache(maxsize=1 << 16)
def region_index(piece, box) -> tuple:
    """How to index ``box`` of ``piece`` in a local tensor: (local slices, their extents, the
    shape to view them as or None if already so, slices of the box within the piece or None
    for all of it). Cached, and filled in before the pause by :func:`warm_up_regions`, so the
    pause does no box arithmetic; the Nones spare a view where a region is a whole tensor."""
    where_shape = box_extents(piece.local)
    shape = box_extents(piece.box)
    inside = relative(box, piece.box)
    whole = all(a == 0 and b == n for (a, b), n in zip(inside, shape))
    return (tuple(slice(a, b) for a, b in piece.local), where_shape,
            None if shape == where_shape else shape,
            None if whole else tuple(slice(a, b) for a, b in inside))


def region_view(local: torch.Tensor, piece, box) -> torch.Tensor:
    """The elements of ``box`` (global coordinates) inside ``piece`` of a local tensor."""
    where, where_shape, shape, inside = region_index(piece, box)
    view = local if local.shape == where_shape else local[where]  # equal: the whole tensor
    if shape is not None:
        view = view.reshape(shape)
    return view if inside is None else view[inside]


def warm_up_regions(plan: Plan, device: int) -> None:
    """Index every region ``device`` reads or writes in ``plan`` (for :func:`region_view`)."""
    for m in plan.copies + plan.transfers:
        if device in (m.src, m.dst, m.src_owner):
            region_index(m.src_piece, m.box)
            region_index(m.dst_piece, m.box)

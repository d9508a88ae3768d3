"""Boxes: hyper-rectangles in a tensor's index space, and the flat-range arithmetic of ZeRO.

A **box** is a tuple of ``(start, stop)`` pairs, one per dim, in a tensor's global (unsharded)
index space. Every shard in DynaTrain, whether a TP chunk, an EP slice of stacked experts or a
ZeRO flat range, is described as a few boxes, so the planner needs only the operations here:
intersect, measure, and cut a contiguous flat range of a row-major tensor into boxes.

Boxes are plain tuples rather than objects: the planner handles hundreds of thousands of them
when it plans a 1024-device switch, and tuples are the cheapest hashable value Python has.
"""

from __future__ import annotations

from math import prod
from typing import Sequence

Box = tuple[tuple[int, int], ...]


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return tuple((0, n) for n in shape)


def box_extents(box: Box) -> tuple[int, ...]:
    """The shape of the sub-tensor that ``box`` selects."""
    return tuple(stop - start for start, stop in box)


def box_numel(box: Box) -> int:
    """Number of elements in ``box`` (0 for an empty box)."""
    n = 1
    for start, stop in box:
        if stop <= start:
            return 0
        n *= stop - start
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same tensor, or None if they do not overlap."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo = a0 if a0 > b0 else b0
        hi = a1 if a1 < b1 else b1
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def shift(box: Box, offset: Sequence[int]) -> Box:
    """``box`` moved by ``offset`` (one integer per dim)."""
    return tuple((start + o, stop + o) for (start, stop), o in zip(box, offset))


def relative(box: Box, origin: Box) -> Box:
    """``box`` expressed in the coordinates of ``origin`` (which must contain it)."""
    return tuple((s - o, e - o) for (s, e), (o, _) in zip(box, origin))


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Cut the flat range ``[start, stop)`` of a row-major tensor of ``shape`` into boxes.

    The boxes come out in flat order and each is contiguous in memory, so the flat range is
    their concatenation: at most ``2 * len(shape) - 1`` boxes (a partial row, whole rows,
    a partial row, recursively). This is how a ZeRO shard, which is a contiguous slice of a
    rank's flattened local tensor, becomes a list of pieces.
    """
    if start >= stop:
        return []
    if len(shape) == 0:
        return [()]
    if len(shape) == 1:
        return [((start, stop),)]
    inner_shape = tuple(shape[1:])
    inner = prod(inner_shape)
    if inner == 0:
        return []
    row0, off0 = divmod(start, inner)
    row1, off1 = divmod(stop, inner)
    if row0 == row1:
        return [((row0, row0 + 1),) + b for b in flat_range_boxes(inner_shape, off0, off1)]
    out: list[Box] = []
    if off0:
        out.extend(((row0, row0 + 1),) + b for b in flat_range_boxes(inner_shape, off0, inner))
        row0 += 1
    if row1 > row0:
        out.append(((row0, row1),) + full_box(inner_shape))
    if off1:
        out.extend(((row1, row1 + 1),) + b for b in flat_range_boxes(inner_shape, 0, off1))
    return out


def even_split(n: int, parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` near-equal contiguous ranges of ``[0, n)``.

    The first ``n % parts`` ranges take one extra element, so sizes differ by at most one;
    the same rule places pipeline layers and ZeRO flat ranges.
    """
    base, rem = divmod(n, parts)
    start = index * base + min(index, rem)
    return start, start + base + (1 if index < rem else 0)

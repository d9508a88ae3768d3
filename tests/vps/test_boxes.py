from math import prod

from hypothesis import given
from hypothesis import strategies as st

from dynatrain.vps.boxes import (box_numel, even_split, flat_range_boxes, full_box, intersect,
                                 shift)


def _flat_indices(shape, box):
    """Row-major flat indices of the elements of ``box`` (brute force)."""
    strides = [prod(shape[i + 1:]) for i in range(len(shape))]
    out = [0]
    for (lo, hi), s in zip(box, strides):
        out = [base + i * s for base in out for i in range(lo, hi)]
    return out


@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_flat_range_boxes_tile_the_range_in_order(shape, data):
    n = prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    boxes = flat_range_boxes(shape, start, stop)
    got = [i for b in boxes for i in _flat_indices(shape, b)]
    assert got == list(range(start, stop))  # contiguous, in order, nothing twice
    assert len(boxes) <= 2 * len(shape) - 1


@given(st.integers(0, 100), st.integers(1, 9))
def test_even_split_partitions_and_front_loads_the_remainder(n, parts):
    ranges = [even_split(n, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_intersect_and_shift():
    a = ((0, 4), (2, 6))
    assert intersect(a, ((3, 9), (0, 3))) == ((3, 4), (2, 3))
    assert intersect(a, ((4, 9), (0, 9))) is None
    assert shift(a, (1, -2)) == ((1, 5), (0, 4))
    assert box_numel(full_box((3, 5))) == 15 and box_numel(((2, 2),)) == 0

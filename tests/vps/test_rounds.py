"""The round schedule: regions sent straight from the old tensor into the new one (direct and
contiguous at both ends) stage nothing, so they cost no staging budget and go in the first
round; packed or non-contiguous regions still fill rounds within the budget."""

import pytest

from dynatrain.trainer.config import make_config
from dynatrain.vps.mapping import Piece
from dynatrain.vps.placement import place_devices
from dynatrain.vps.planner import plan_switch
from dynatrain.vps.rounds import contiguous, schedule_rounds, staged_bytes


def _plan(model, old, new):
    o, n = make_config(model, old), make_config(model, new)
    ol = o.layout.with_devices(range(o.layout.world))
    return plan_switch(o.model, ol, place_devices(o.model, ol, n.layout, range(n.layout.world)))


def _whole(*shape):
    box = tuple((0, n) for n in shape)
    return Piece(box, box)


def test_row_blocks_are_contiguous_and_column_blocks_are_not():
    p = _whole(8, 6)
    assert contiguous(p, ((0, 8), (0, 6)))
    assert contiguous(p, ((2, 5), (0, 6)))          # whole rows
    assert contiguous(p, ((3, 4), (1, 4)))          # part of one row
    assert not contiguous(p, ((2, 5), (0, 3)))      # a column block spans rows
    # A piece at an offset in the global space: what counts is where the box sits in it.
    q = Piece(((8, 16), (6, 12)), ((0, 8), (0, 6)))
    assert contiguous(q, ((10, 12), (6, 12)))
    assert not contiguous(q, ((10, 12), (6, 9)))
    # A flat ZeRO piece: a 1-d range of the local tensor holding a box in row-major order.
    z = Piece(((2, 4), (0, 6)), ((100, 112),))
    assert contiguous(z, ((2, 4), (0, 6)))
    assert contiguous(z, ((3, 4), (2, 5)))
    assert not contiguous(z, ((2, 4), (0, 3)))
    # Anything else is not known to be contiguous: counted as staged.
    assert not contiguous(Piece(((0, 4), (0, 6)), ((0, 4), (0, 12))), ((0, 4), (0, 6)))


@pytest.mark.parametrize("old,new", [("dp=2", "dp=4"), ("pp=4", "dp=2"), ("tp=2", "tp=4"),
                                     ("dp=2,zero=1", "tp=2,pp=2")])
def test_every_message_is_scheduled_once_and_staging_stays_within_the_budget(old, new):
    plan = _plan("gpt-tiny", old, new)
    budget = 4096
    for direct in (None, 1024):
        rounds = schedule_rounds(plan, budget, direct)
        items = sorted((m.src, m.dst, it) for msgs in rounds for m in msgs for it in m.items)
        expected = sorted((m.src, m.dst, it) for msgs in schedule_rounds(plan, 1 << 40, None)
                          for m in msgs for it in m.items)
        assert items == expected
        for msgs in rounds:
            used = {}
            for m in msgs:
                staged = sum(staged_bytes(plan, it.move, direct) for it in m.items)
                for d in (m.src, m.dst):
                    used[d] = used.get(d, 0) + staged
            alone = [m for m in msgs if len(m.items) == 1]
            assert all(u <= budget for u in used.values()) or alone, (used, msgs)


def test_direct_contiguous_regions_go_in_one_round_whatever_the_budget():
    plan = _plan("gpt-tiny", "pp=4", "dp=2")
    assert len(schedule_rounds(plan, 1024, None)) > 1        # all packed: the budget splits
    rounds = schedule_rounds(plan, 1024, 1)                  # all direct, all contiguous
    assert len(rounds) == 1
    # Every pair that has anything to move moves it in that round, at once.
    assert {(m.src, m.dst) for m in rounds[0]} == {(m.src, m.dst) for m in plan.transfers}


def test_column_blocks_still_cost_budget():
    """tp=2 -> tp=4 cuts row-parallel weights by columns: those regions are not contiguous in
    the old shard, so they are staged and the budget still splits them into rounds."""
    plan = _plan("gpt-tiny", "tp=2", "tp=4")
    moves = [i for i, m in enumerate(plan.transfers)
             if not (contiguous(m.src_piece, m.box) and contiguous(m.dst_piece, m.box))]
    assert moves
    assert all(staged_bytes(plan, i, 1) == plan.transfers[i].nbytes for i in moves)

"""The engine's ways of keeping work out of the pause, on one process (no network needed).

Preallocated new tensors are used as the new local tensors (and only when they fit); retired
old tensors are collected instead of freed, and freed later on a thread; the staging buffer is
sized for what is packed, not for what travels direct; region indexing is done before the
pause; new tensors that are a contiguous block of an unshared old tensor are carved from it
(views, no copy) and the rest of its pages go back to the OS. The multi-process checks
(bit-exact switches with the direct path on and off) are in test_switch.py.
"""

import gc
import mmap
import weakref

import pytest
import torch

from dynatrain.vps import carving, regions
from dynatrain.vps.carving import free_in_background
from dynatrain.vps.layout import bind, parse_layout
from dynatrain.vps.mapping import rank_shards
from dynatrain.vps.planner import plan_switch
from dynatrain.vps.presets import PRESETS
from dynatrain.vps.regions import warm_up_regions
from dynatrain.vps.rounds import Item, Message, staging_need
from dynatrain.vps.transition import TransitionConfig, TransitionInputs, execute_transition
from engine_state import box_of, cut, full_state


def _local(plan, old, shapes, **kw) -> TransitionInputs:
    """Device 0's part of a switch whose moves are all local copies (no group, no rounds)."""
    return TransitionInputs(plan=plan, device=0, old=old, new_shapes=shapes, group=None,
                            group_rank={}, rounds=[], **kw)


def _local_switch():
    """Old tp=2 on devices 0 and 1 with device 1 dead and mirrored on 0, new dp=1 on 0: every
    move is a local copy on device 0, and no new tensor can be adopted (each is whole, each old
    one a half)."""
    model = PRESETS["gpt-tiny"]
    old = parse_layout("tp=2").with_devices([0, 1])
    new = parse_layout("dp=1").with_devices([0])
    plan = plan_switch(model, old, new, dead=frozenset({1}), proxies={1: 0})
    full = full_state(model, seed=3)
    ob, nb = bind(old, model), bind(new, model)
    shapes = {(rs.tensor.name, rs.state): (rs.local_shape, full[(rs.tensor.name, rs.state)].dtype)
              for rs in rank_shards(nb, 0)}
    return plan, full, ob, shapes


def test_preallocated_tensors_become_the_new_tensors_and_old_ones_are_retired():
    plan, full, ob, shapes = _local_switch()
    old, _ = cut(ob, 0, full)
    mirror, _ = cut(ob, 1, full)
    pre = {k: torch.zeros(s, dtype=d) for k, (s, d) in shapes.items()}
    wrong = next(iter(shapes))                      # one of the wrong shape: not used
    pre[wrong] = torch.zeros(3, dtype=shapes[wrong][1])
    old_refs = [weakref.ref(t) for t in old.values()]
    retired = []
    new, stats = execute_transition(_local(plan, old, shapes, mirrored={1: mirror},
                                           preallocated=pre, retired=retired))
    for key, t in new.items():
        assert torch.equal(t, full[key]), key
        assert (t is pre[key]) == (key != wrong), key
    expected = sum(t.numel() * t.element_size() for k, t in pre.items() if k != wrong)
    assert stats.bytes_preallocated == expected
    # Every old tensor was read (local copies), so each is retired, not freed, and not lost.
    assert not old and len(retired) == len(old_refs)
    assert all(r() is not None for r in old_refs)
    del pre
    free_in_background(retired).join(timeout=30)
    assert retired == []
    gc.collect()
    assert all(r() is None for r in old_refs)          # the thread dropped the last references


def test_without_retired_old_tensors_are_freed_during_the_switch():
    plan, full, ob, shapes = _local_switch()
    old, _ = cut(ob, 0, full)
    refs = [weakref.ref(t) for t in old.values()]
    execute_transition(_local(plan, old, shapes, mirrored={1: cut(ob, 1, full)[0]}))
    gc.collect()
    assert all(r() is None for r in refs)


def test_regions_are_indexed_before_the_pause():
    plan, full, ob, shapes = _local_switch()
    regions.region_index.cache_clear()
    warm_up_regions(plan, 0)
    before = regions.region_index.cache_info()
    assert before.currsize > 0
    execute_transition(_local(plan, cut(ob, 0, full)[0], shapes,
                              mirrored={1: cut(ob, 1, full)[0]}))
    after = regions.region_index.cache_info()
    assert after.misses == before.misses and after.hits > before.hits


def _msg(src, dst, *sizes):
    return Message(src, dst, tuple(Item(0, f"t{i}", n) for i, n in enumerate(sizes)), sum(sizes))


def test_staging_holds_only_what_is_packed():
    mib = 1 << 20
    rounds = [[_msg(0, 1, 100, 3 * mib, 28), _msg(2, 0, 5 * mib)], [_msg(1, 0, 64)]]
    # Device 0, round 0: packs 128 bytes for device 1; device 2's message travels direct.
    # A slot is the payload plus 16 bytes of checksums, rounded up to 64.
    assert staging_need(rounds, 0, direct_bytes=mib) == 192
    assert staging_need(rounds, 1, direct_bytes=mib) == 192
    assert staging_need(rounds, 2, direct_bytes=mib) == 0
    # Everything packed (checksums on): device 0 stages both messages of round 0.
    assert staging_need(rounds, 0, direct_bytes=None) == (
        -(-(3 * mib + 128 + 16) // 64) * 64 + -(-(5 * mib + 16) // 64) * 64)
    assert staging_need([], 0) == 0


def test_direct_threshold_must_be_positive():
    with pytest.raises(ValueError, match="direct_bytes=0 must be positive"):
        TransitionConfig(direct_bytes=0)


# -- carving ----------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def _replica_to_tp(model="gpt-tiny"):
    """Old dp=2, new tp=2, both on devices 0 and 1: device 0 keeps a tensor-parallel half of
    its full replica (local copies only, nothing on the network for it)."""
    spec = PRESETS[model]
    old = parse_layout("dp=2").with_devices([0, 1])
    new = parse_layout("tp=2").with_devices([0, 1])
    plan = plan_switch(spec, old, new)
    full = full_state(spec, seed=5)
    ob, nb = bind(old, spec), bind(new, spec)
    shapes = {(rs.tensor.name, rs.state): (rs.local_shape, full[(rs.tensor.name, rs.state)].dtype)
              for rs in rank_shards(nb, 0)}
    pieces = {(rs.tensor.name, rs.state): rs.pieces for rs in rank_shards(nb, 0)}
    old_t, old_pieces = cut(ob, 0, full)
    assert not [m for m in plan.transfers if 0 in (m.src, m.dst)]
    return plan, full, shapes, pieces, old_t, old_pieces


@pytest.mark.skipif(not carving.CARVING, reason="carving needs Linux madvise and torch's "
                    "storage use count; this platform copies instead")
def test_row_blocks_are_carved_and_the_rest_of_the_old_pages_go_back():
    plan, full, shapes, pieces, old, old_pieces = _replica_to_tp()
    # Row-parallel tensors (a column block of each row) are strided: those are copied.
    blocks = {k for k, m in carving.carvable(plan, 0, pieces).items()
              if carving.carve(old[k], m, *shapes[k]) is not None
              and old_pieces[k] != pieces[k]}         # not adopted whole
    assert 0 < len(blocks) < len(shapes)
    spans = {k: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for k, t in old.items()}
    originals = dict(old)
    retired = []
    new, stats = execute_transition(_local(plan, old, shapes, old_pieces=old_pieces,
                                           new_pieces=pieces, retired=retired),
                                    TransitionConfig(carve=True))
    carved = [k for k, t in new.items()
              if spans[k][0] <= t.data_ptr() < spans[k][1] and t is not originals[k]]
    del originals
    assert set(carved) == blocks
    assert stats.bytes_carved == sum(new[k].numel() * new[k].element_size() for k in carved)
    assert stats.bytes_copied > 0 and stats.bytes_carved > 0
    for key, t in new.items():
        assert not t._is_view(), key       # nothing keeps the whole old tensor object alive
        assert torch.equal(t, box_of(full[key], pieces[key][0].box)
                           .reshape(t.shape)), key
    rss = _rss_bytes()
    free_in_background(retired).join(timeout=30)
    given_back = rss - _rss_bytes()
    # Each carved old tensor kept half of itself; most of the other half went back.
    assert given_back >= 0.8 * stats.bytes_carved, (given_back, stats.bytes_carved)
    for key, t in new.items():              # the kept blocks are untouched
        assert torch.equal(t, box_of(full[key], pieces[key][0].box).reshape(t.shape)), key


def test_a_shared_old_tensor_is_copied_not_carved():
    """Something else using the old tensor's memory could read the pages carving gives back:
    such a tensor is copied, and its memory is left whole."""
    plan, _, shapes, pieces, old, old_pieces = _replica_to_tp()
    key = next(iter(carving.carvable(plan, 0, pieces)))
    other = old[key].view(-1)               # another tensor over the same storage
    kept = other.clone()
    retired = []
    new, _ = execute_transition(_local(plan, old, shapes, old_pieces=old_pieces,
                                       new_pieces=pieces, retired=retired),
                                TransitionConfig(carve=True))
    assert new[key].untyped_storage().data_ptr() != other.untyped_storage().data_ptr()
    free_in_background(retired).join(timeout=30)
    assert torch.equal(other, kept)


def test_carving_can_be_turned_off():
    plan, _, shapes, pieces, old, old_pieces = _replica_to_tp()
    new, stats = execute_transition(_local(plan, old, shapes, old_pieces=old_pieces,
                                           new_pieces=pieces),
                                    TransitionConfig(carve=False))
    assert stats.bytes_carved == 0
    assert all(carving.owned(t) is t for t in new.values())


def test_owned_copies_only_what_shares_a_larger_allocation():
    whole = torch.arange(12.0)
    assert carving.owned(whole) is whole
    part = whole[4:8].detach()
    got = carving.owned(part)
    assert got is not part and torch.equal(got, part)
    assert got.untyped_storage().nbytes() == 4 * 4

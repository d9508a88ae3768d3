"""The engine's ways of keeping work out of the pause, on one process (no network needed).

Preallocated new tensors are used as the new local tensors (and only when they fit); retired
old tensors are collected instead of freed, and freed later on a thread; the staging buffer is
sized for what is packed, not for what travels direct; region indexing is done before the
pause. The multi-process checks (bit-exact switches with the direct path on and off) are in
test_switch.py.
"""

import gc
import weakref

import pytest
import torch

from dynatrain.vps import transition
from dynatrain.vps.layout import bind, parse_layout
from dynatrain.vps.mapping import rank_shards
from dynatrain.vps.planner import plan_switch
from dynatrain.vps.presets import PRESETS
from dynatrain.vps.transition import (Item, Message, TransitionConfig, execute_transition,
                                      free_in_background, staging_need, warm_up_regions)
from engine_state import cut, full_state


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
    new, stats = execute_transition(plan, 0, old, shapes, None, {}, [], mirrored={1: mirror},
                                    preallocated=pre, retired=retired)
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
    execute_transition(plan, 0, old, shapes, None, {}, [], mirrored={1: cut(ob, 1, full)[0]})
    gc.collect()
    assert all(r() is None for r in refs)


def test_regions_are_indexed_before_the_pause():
    plan, full, ob, shapes = _local_switch()
    transition._region_index.cache_clear()
    warm_up_regions(plan, 0)
    before = transition._region_index.cache_info()
    assert before.currsize > 0
    execute_transition(plan, 0, cut(ob, 0, full)[0], shapes, None, {}, [],
                       mirrored={1: cut(ob, 1, full)[0]})
    after = transition._region_index.cache_info()
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

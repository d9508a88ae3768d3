import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynatrain.vps.boxes import box_numel
from dynatrain.vps.layout import bind, parse_layout
from dynatrain.vps.mapping import shards, state_bytes, state_itemsize
from dynatrain.vps.placement import place_devices
from dynatrain.vps.planner import PlanError, plan_for_device, plan_switch
from dynatrain.vps.presets import PRESETS
from dynatrain.vps.stats import device_traffic, plan_stats
from dynatrain.vps.verify import verify_plan

from harness.strategies import layouts, models, recoveries, transitions


@given(transitions())
def test_every_destination_element_arrives_once_from_a_real_holder(case):
    model, old, new = case
    plan = plan_switch(model, old, new, devices_per_node=2)
    verify_plan(plan)
    stats = plan_stats(plan)
    assert stats.lower_bound_max_rank_bytes <= stats.max_rank_bytes


@given(st.data())
def test_identity_transition_moves_nothing(data):
    model = data.draw(models())
    layout = data.draw(layouts(model))
    stats = plan_stats(plan_switch(model, layout, layout))
    assert stats.bytes_network == 0 and stats.transfers == 0
    assert stats.bytes_local == _bytes_held(model, layout)  # everything stays, copied locally
    assert stats.lower_bound_max_rank_bytes == 0


def _bytes_held(model, layout):
    bound = bind(layout, model)
    return sum(box_numel(p.box) * state_itemsize(rs.tensor, rs.state)
               for entries in shards(bound).values() for rs in entries for p in rs.pieces)


@settings(max_examples=25)
@given(transitions(), st.data())
def test_one_devices_part_equals_the_full_plan_for_it(case, data):
    model, old, new = case
    full = plan_switch(model, old, new, devices_per_node=2)
    devices = sorted(set(old.device_of) | set(new.device_of))
    d = data.draw(st.sampled_from(devices))
    part = plan_for_device(model, old, new, d, devices_per_node=2)
    assert sorted(part.copies + part.transfers) == sorted(full.for_device(d))


@settings(max_examples=25)
@given(transitions())
def test_plans_are_deterministic(case):
    model, old, new = case
    a, b = plan_switch(model, old, new), plan_switch(model, old, new)
    assert a.copies == b.copies and a.transfers == b.transfers


@settings(max_examples=40)
@given(transitions())
def test_placement_keeps_at_least_as_much_in_place(case):
    model, old, new = case
    placed = place_devices(model, old, new, new.device_of)
    assert sorted(placed.device_of) == sorted(new.device_of)
    plan = plan_switch(model, old, placed)
    verify_plan(plan)


def test_shrinking_data_parallelism_moves_nothing():
    model = PRESETS["gpt-tiny"]
    stats = plan_stats(plan_switch(model, parse_layout("dp=8"), parse_layout("dp=4")))
    assert stats.bytes_network == 0
    assert stats.bytes_local == 4 * state_bytes(model)


@pytest.mark.parametrize("model", ["gpt-tiny", "moe-tiny", "llama-7b"])
def test_doubling_data_parallelism_shares_the_work_among_holders(model):
    m = PRESETS[model]
    plan = plan_switch(m, parse_layout("dp=4"), parse_layout("dp=8"))
    stats = plan_stats(plan)
    replica = state_bytes(m)
    assert stats.bytes_network == 4 * replica
    send, recv, _ = device_traffic(plan)
    assert sorted(recv) == [4, 5, 6, 7] and all(v == replica for v in recv.values())
    assert sorted(send) == [0, 1, 2, 3] and all(v == replica for v in send.values())


def test_sources_on_the_receivers_node_are_preferred():
    m = PRESETS["gpt-tiny"]
    # Replicas on devices 0 (node 0) and 2 (node 1); receivers 1 (node 0) and 3 (node 1).
    # Over NVLink (9x the NIC) each receiver gets most of its replica from its own node; the
    # NICs, idle otherwise, carry the rest from the other node at the same time, which beats
    # NVLink alone (R / intra) and the byte balance stays exact.
    plan = plan_switch(m, parse_layout("dp=2").with_devices([0, 2]),
                       parse_layout("dp=4").with_devices([0, 1, 2, 3]), devices_per_node=2)
    verify_plan(plan)
    same = sum(t.nbytes * plan.group_size(t) for t in plan.transfers if t.src // 2 == t.dst // 2)
    stats = plan_stats(plan)
    assert same >= 0.85 * stats.bytes_network
    assert stats.max_rank_bytes == state_bytes(m) == stats.lower_bound_max_rank_bytes
    assert stats.modelled_seconds < state_bytes(m) / plan.links.intra


def test_dead_devices_are_not_sources_and_lost_state_is_named():
    m = PRESETS["gpt-tiny"]
    plan = plan_switch(m, parse_layout("dp=4"), parse_layout("dp=3").with_devices([1, 2, 4]),
                       dead=[0, 3])
    verify_plan(plan, frozenset({0, 3}))
    assert {t.src for t in plan.transfers} <= {1, 2}
    with pytest.raises(PlanError, match="no surviving copy of .* all of its holders"):
        plan_switch(m, parse_layout("dp=2,zero=1"), parse_layout("dp=1").with_devices([1]),
                    dead=[0])
    with pytest.raises(PlanError, match="marked dead but the new layout uses them"):
        plan_switch(m, parse_layout("dp=2"), parse_layout("dp=2"), dead=[1])


def test_placement_keeps_pipeline_stages_on_their_devices():
    m = PRESETS["gpt-tiny"]
    old = parse_layout("dp=2,pp=2").with_devices(range(4))
    new = place_devices(m, old, parse_layout("dp=2,pp=2"), [2, 3, 4, 5])
    assert new.device_of == (4, 5, 2, 3)  # stage 1 stays on 2,3; joiners take stage 0
    kept = plan_stats(plan_switch(m, old, new)).bytes_network
    naive = plan_stats(plan_switch(m, old, parse_layout("dp=2,pp=2").with_devices([2, 3, 4, 5])))
    assert kept < naive.bytes_network


@settings(max_examples=20)
@given(recoveries(), st.data())
def test_a_proxy_serves_its_dead_devices_state(case, data):
    """With a mirror of every dead device on a live proxy, no state is lost; the proxy (never
    the dead device) sends it, and a device's own part of the plan is still exact."""
    model, old, new, dead, proxies = case
    plan = plan_switch(model, old, new, devices_per_node=2, dead=dead, proxies=proxies)
    verify_plan(plan, dead, proxies)
    for m in plan.copies + plan.transfers:
        assert m.src not in dead, m
        if m.owner in dead:
            assert m.src == proxies[m.owner], m
        else:
            assert m.owner == m.src, m
    live = sorted((set(old.device_of) | set(new.device_of)) - dead)
    for d in {*proxies.values(), data.draw(st.sampled_from(live))}:
        part = plan_for_device(model, old, new, d, devices_per_node=2, dead=dead, proxies=proxies)
        assert sorted(part.copies + part.transfers) == sorted(plan.for_device(d)), d


def test_a_proxy_uses_its_own_copy_of_replicated_state():
    m = PRESETS["gpt-tiny"]
    old, new = parse_layout("dp=2"), parse_layout("dp=2").with_devices([0, 2])
    plain = plan_switch(m, old, new, dead=[1])
    proxied = plan_switch(m, old, new, dead=[1], proxies={1: 0})
    assert proxied.copies == plain.copies and proxied.transfers == plain.transfers
    assert {(t.src, t.owner) for t in proxied.copies + proxied.transfers} == {(0, 0)}


@pytest.mark.parametrize("old,new,devices,proxy", [
    ("tp=2", "dp=1", [0], 0),              # the proxy is the receiver: local copies only
    ("pp=2", "dp=2", [0, 2], 2),           # a joiner holds the mirror: copies and sends
    ("dp=1,tp=2,zero=1", "tp=2,pp=2", [0, 3, 4, 2], 3),  # ZeRO flat ranges to TP x PP
])
def test_unique_state_is_lost_without_a_proxy_and_recovered_with_one(old, new, devices, proxy):
    m = PRESETS["gpt-tiny"]
    old, new = parse_layout(old), parse_layout(new).with_devices(devices)
    with pytest.raises(PlanError, match=r"no surviving copy of \S+ \(\w+\) .* holders \[1\] "
                                        "are dead and none has a proxy"):
        plan_switch(m, old, new, dead=[1])
    plan = plan_switch(m, old, new, dead=[1], proxies={1: proxy})
    verify_plan(plan, frozenset({1}), {1: proxy})
    mirrored = [x for x in plan.copies + plan.transfers if x.owner == 1]
    assert mirrored and {x.src for x in mirrored} == {proxy}
    assert any(x.dst == proxy for x in mirrored)          # copied locally from the mirror
    if len(devices) > 1:
        assert any(x.dst != proxy for x in mirrored)      # and sent from it
    else:
        assert not plan.transfers
    with pytest.raises(PlanError, match="reads dead device 1's state, but the proxy of 1 is"):
        verify_plan(plan, frozenset({1}))                 # a plan for other failures


@pytest.mark.parametrize("dead,proxies,message", [
    ([1], {0: 2}, r"proxies\[0\] = 2, but device 0 is not marked dead"),
    ([1, 2], {1: 2}, r"proxies\[1\] = 2, but device 2 is dead too"),
    ([1], {1: 99}, r"proxies\[1\] = 99, but device 99 is in neither layout"),
])
def test_bad_proxies_are_named(dead, proxies, message):
    m = PRESETS["gpt-tiny"]
    with pytest.raises(PlanError, match=message):
        plan_switch(m, parse_layout("dp=4"), parse_layout("dp=2").with_devices([0, 3]),
                    dead=dead, proxies=proxies)

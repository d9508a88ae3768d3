"""The two-tier time model, its lower bound, and the planner measured against both bounds.

Everything here is exact arithmetic on byte counts and the model's seconds, never a timing."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynatrain.vps.layout import parse_layout
from dynatrain.vps.planner import plan_for_device, plan_switch
from dynatrain.vps.presets import PRESETS
from dynatrain.vps.stats import plan_stats
from dynatrain.vps.timemodel import (Links, _send_seconds, lower_bound_bytes,
                                     lower_bound_seconds, makespan, port_bytes)
from dynatrain.vps.verify import verify_plan

from harness.strategies import held_out_transitions, recoveries, transitions

GB = 10 ** 9
LINKS = Links(intra=9 * GB, inter=1 * GB)  # round numbers: NVLink 9x the NIC


def test_ports_are_independent_and_the_slowest_port_sets_the_time():
    ports = port_bytes([(0, 1, 9 * GB), (0, 8, 2 * GB), (8, 0, 1 * GB)], devices_per_node=8)
    assert ports == {0: [9 * GB, 0, 2 * GB, 1 * GB], 1: [0, 9 * GB, 0, 0],
                     8: [0, 0, 1 * GB, 2 * GB]}
    assert makespan(ports, LINKS) == 2.0  # device 0's inter-send; its NVLink takes 1 s


def test_receive_side_bound():
    # Receiver 1 needs 4 GB held only on node 1 (far) and 9 GB held only on its own node.
    demand = {(8,): {1: 4 * GB}, (0,): {1: 9 * GB}}
    assert lower_bound_seconds(demand, 8, LINKS) == 4.0
    # 20 GB held on both nodes: it can come over both ports at once, 10 GB/s in all.
    assert lower_bound_seconds({(0, 8): {1: 20 * GB}}, 8, LINKS) == 2.0


def test_send_side_bound_walks_the_breakpoints():
    # G = {0, 8}: one member per node. Two receivers on node 0 want 18 GB of data both hold,
    # two on node 2 (no member) want 6 GB. Node 0's demand goes over device 0's NVLink
    # (9 GB/s) and both members' NICs (1 GB/s each) share the rest: at T = 3, NVLink carries
    # 27 >= 18 and the NICs 6 = 6.
    loads = {0: [0, 18 * GB, {1, 2}], 2: [6 * GB, 0, {16, 17}]}
    assert _send_seconds(loads, {0: 1, 1: 1}, 2, LINKS) == 3.0
    # More on node 0 than NVLink takes at that T: 36 GB. Solve 36 - 9T + 6 = 2T -> T = 42/11.
    loads = {0: [0, 36 * GB, {1, 2}], 2: [6 * GB, 0, {16, 17}]}
    assert _send_seconds(loads, {0: 1, 1: 1}, 2, LINKS) == pytest.approx(42 / 11)
    # Node 0's receivers served by two members on another node: S = {n}, 2 NICs.
    assert _send_seconds({0: [4 * GB, 0, {1, 2}]}, {1: 2}, 2, LINKS) == 2.0
    # ... but one receiver takes only one NIC's worth.
    assert _send_seconds({0: [4 * GB, 0, {1}]}, {1: 2}, 2, LINKS) == 4.0


def test_bytes_bound_includes_smaller_holder_sets():
    demand = {(0, 1): {5: 10}, (0,): {6: 7}, (1,): {7: 1}}
    # {0,1} must send 10 + 7 + 1 between two: 9 each; device 0 alone sends 7.
    assert lower_bound_bytes(demand) == 10


@settings(max_examples=40, deadline=None)
@given(transitions(), st.sampled_from([(9, 1), (1, 1), (1, 4)]), st.sampled_from([1, 2, 4]))
def test_the_bounds_hold_for_every_plan(case, speeds, devices_per_node):
    """Whatever the link speeds (also NVLink slower than the NIC) and node size, the plan's
    modelled time and bytes are at least the bounds, and it still verifies."""
    model, old, new = case
    links = Links(intra=speeds[0] * GB, inter=speeds[1] * GB)
    plan = plan_switch(model, old, new, devices_per_node=devices_per_node, links=links)
    verify_plan(plan)
    stats = plan_stats(plan)
    assert stats.lower_bound_seconds <= stats.modelled_seconds * (1 + 1e-12)
    assert stats.lower_bound_max_rank_bytes <= stats.max_rank_bytes
    assert stats.lower_bound_joint_ratio <= \
        max(stats.time_ratio_to_bound, stats.ratio_to_bound) * (1 + 1e-12)


def test_a_busier_nvlink_sender_beats_an_idle_remote_one():
    """Replicas on devices 0, 1 (node 0) and 8 (node 1); receivers 2..7 on node 0. Byte
    balance alone has device 8 send 2 replicas over its NIC: 2R / inter. In time, the NVLink
    senders should do most of it. Time and bytes conflict here: with device 8 sending x over
    the NIC, the pause is x / inter and devices 0 and 1 send (6R - x) / 2 each. The planner
    minimises the larger of (pause / time bound, bytes / byte bound), and the best split makes
    both equal: rho = 6 / (4 + 6 inter / (intra + inter)) (the time bound is 6R / (2 intra +
    inter) for this holder set, the byte bound 2R)."""
    m = PRESETS["gpt-tiny"]
    old = parse_layout("dp=3").with_devices([0, 1, 8])
    new = parse_layout("dp=9").with_devices([0, 1, 8, 2, 3, 4, 5, 6, 7])
    links = Links.from_gbps(3600, 400)
    plan = plan_switch(m, old, new, devices_per_node=8, links=links)
    verify_plan(plan)
    stats = plan_stats(plan)
    R = stats.state_bytes
    assert stats.lower_bound_seconds == pytest.approx(6 * R / (2 * links.intra + links.inter))
    assert stats.lower_bound_max_rank_bytes == 2 * R
    rho = 6 / (4 + 6 * links.inter / (2 * links.intra + links.inter))
    assert stats.time_ratio_to_bound <= rho * 1.001
    assert stats.ratio_to_bound <= rho * 1.001
    assert stats.modelled_seconds < (2 * R / links.inter) / 4  # byte balance: 4.5x slower


@pytest.mark.parametrize("kind", ["grow", "shrink", "lost"])
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_held_out_transitions_are_within_10_percent_of_both_bounds(kind, data):
    """Random switches outside the benchmark suite: 16-512 devices on nodes of 8, growth,
    shrink and lost devices (with mirrors on buddies), dense and MoE shapes. The busiest
    device's bytes and the modelled pause are both within 10% of their lower bounds, and
    every plan delivers every element once from a holder. (benchmarks/plan_held_out.py runs
    more and larger ones without the verifier.)

    Where the two bounds provably cannot both be met (``lower_bound_joint_ratio`` > 1: a
    node's receivers need more than the NVLink holders on their node can send within their
    byte share, e.g. llama-7b dp=10,tp=2,pp=2 -> dp=16,tp=1,pp=2, joint bound 1.179, and the
    exact optimum of the fractional plan is 1.179 too), both are held to 10% of that."""
    _, model, old, new, dead, proxies = data.draw(
        held_out_transitions(num_layers=8, max_dp=16, kinds=(kind,)))
    plan = plan_switch(model, old, new, dead=dead, proxies=proxies)
    verify_plan(plan, dead, proxies)
    stats = plan_stats(plan)
    target = 1.10 * stats.lower_bound_joint_ratio
    assert stats.lower_bound_joint_ratio <= max(stats.time_ratio_to_bound,
                                                stats.ratio_to_bound) * (1 + 1e-12)
    assert stats.time_ratio_to_bound <= target, (old.to_text(), new.to_text())
    assert stats.ratio_to_bound <= target, (old.to_text(), new.to_text())


def test_when_both_bounds_cannot_be_met_the_joint_bound_says_so():
    """Node 2's receivers need 79 GB that only 4 holders on node 2 have (2 per replica set):
    within their byte share (the byte bound) NVLink cannot carry it in the time bound, and the
    NICs into the node take the rest at most. The exact optimum of the fractional plan (a
    linear program) is max ratio 1.1786; the joint bound finds 1.1786, the planner 1.19."""
    from dataclasses import replace

    from dynatrain.vps.placement import place_devices

    m = replace(PRESETS["llama-7b"], num_layers=8)
    old = parse_layout("dp=10,tp=2,pp=2").with_devices(range(40))
    new = place_devices(m, old, parse_layout("dp=16,tp=1,pp=2"), range(32))
    stats = plan_stats(plan_switch(m, old, new))
    assert stats.lower_bound_joint_ratio == pytest.approx(1.1786, abs=1e-4)
    assert max(stats.time_ratio_to_bound, stats.ratio_to_bound) <= \
        1.10 * stats.lower_bound_joint_ratio


def test_a_holder_set_with_one_nvlink_holder_for_a_needy_node_bounds_the_pair():
    """llama-7b (8 layers) dp=9,pp=8 -> dp=8,tp=4,pp=3: a stage's 9 replicas sit 8 on node 0
    and 1 (device 8) on node 1, where 7 of the stage's 23 receivers are. The time bound has
    device 8 serve node 1 over NVLink; the byte bound gives it 1/9 of the stage's bytes. With
    device 8 sending s of the stage's D bytes, the 8 on node 0 send (D - s) / 8 each over
    their NICs, so the best plan balances 9 s / D (bytes) against the NICs' time, and the
    bound counted over all holder sets at once (1.0) missed it. Counted per holder set, the
    joint bound is within 0.5% of what the planner finds. (Draws of the held-out property
    found this case, and dp=9,pp=8 -> dp=7,tp=4,pp=4 under ZeRO-1 at 1.217x the time bound,
    over the 10% that test allows, while the old joint bound said 1.0 for both.)"""
    from dataclasses import replace

    from dynatrain.vps.placement import place_devices

    m = replace(PRESETS["llama-7b"], num_layers=8)
    old = parse_layout("dp=9,tp=1,pp=8").with_devices(range(72))
    new = place_devices(m, old, parse_layout("dp=8,tp=4,pp=3"), range(96))
    plan = plan_switch(m, old, new)
    verify_plan(plan)
    stats = plan_stats(plan)
    got = max(stats.time_ratio_to_bound, stats.ratio_to_bound)
    assert 1.13 < stats.lower_bound_joint_ratio <= got * (1 + 1e-12)
    assert got <= 1.005 * stats.lower_bound_joint_ratio
    # By hand, from the stage held by devices 0-8 (D bytes to send): device 8 sends at most
    # rho B (B: the byte bound), the 8 on node 0 at most rho min(T inter, B) each over their
    # NICs (T: the time bound), so rho (8 min(T inter, B) + B) >= D.
    d = sum(plan.demand[tuple(range(9))].values())
    b, t = stats.lower_bound_max_rank_bytes, stats.lower_bound_seconds
    assert stats.lower_bound_joint_ratio == pytest.approx(
        d / (8 * min(t * plan.links.inter, b) + b), rel=1e-4)


@settings(max_examples=10, deadline=None)
@given(recoveries(), st.data())
def test_a_devices_part_is_the_full_plan_filtered(case, data):
    model, old, new, dead, proxies = case
    full = plan_switch(model, old, new, devices_per_node=2, dead=dead, proxies=proxies)
    live = sorted((set(old.device_of) | set(new.device_of)) - dead)
    d = data.draw(st.sampled_from(live))
    part = plan_for_device(model, old, new, d, devices_per_node=2, dead=dead, proxies=proxies)
    assert part.copies + part.transfers == [m for m in full.copies + full.transfers
                                            if m.src == d or m.dst == d]
    assert part.demand == full.demand

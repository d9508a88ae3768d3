"""The node map (:mod:`dynatrain.vps.topology`): the planner's link costs read each device's
real node, not the guess ``device // devices_per_node``.

Byte counts are exact: gpt-tiny's whole state is its parameters in fp32 plus Adam's two fp32
moments, 12 bytes per parameter, and a switch from one replica to two sends all of it to the
new device from the only holder.
"""

from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given, settings

from dynatrain.vps.layout import parse_layout
from dynatrain.vps.planner import PlanError, plan_switch
from dynatrain.vps.presets import PRESETS
from dynatrain.vps.stats import plan_stats
from dynatrain.vps.timemodel import Links, lower_bound_seconds, port_bytes
from dynatrain.vps.topology import node_of
from dynatrain.vps.verify import verify_plan

from harness.strategies import recoveries, transitions

MODEL = PRESETS["gpt-tiny"]
R = MODEL.num_params * (4 + 4 + 4)  # param, exp_avg, exp_avg_sq: fp32 each
LINKS = Links(intra=9 * 10 ** 9, inter=1 * 10 ** 9)


def _ports(plan):
    """The plan's bytes per device on [intra-send, intra-recv, inter-send, inter-recv], read
    from its own node map."""
    sizes = [len(g.names) for g in plan.groups]
    return port_bytes(((m.src, m.dst, m.nbytes * sizes[m.group]) for m in plan.transfers),
                      plan.devices_per_node)


def _grow(devices):
    """dp=1 on ``devices[0]`` -> dp=2 on ``devices``: the new replica gets all R bytes."""
    return (parse_layout("dp=1").with_devices(devices[:1]),
            parse_layout("dp=2").with_devices(devices))


def test_a_map_names_the_real_node_of_every_device():
    assert R == 44_599_296
    # Devices 0 and 1: the guess puts them on one node (NVLink), the map on two (a NIC).
    old, new = _grow([0, 1])
    guess = plan_switch(MODEL, old, new, devices_per_node=8, links=LINKS)
    real = plan_switch(MODEL, old, new, devices_per_node={0: "node-a", 1: "node-b"}, links=LINKS)
    assert _ports(guess) == {0: [R, 0, 0, 0], 1: [0, R, 0, 0]}
    assert _ports(real) == {0: [0, 0, R, 0], 1: [0, 0, 0, R]}
    assert plan_stats(guess).modelled_seconds == R / LINKS.intra
    assert plan_stats(real).modelled_seconds == R / LINKS.inter
    assert plan_stats(real).lower_bound_seconds == R / LINKS.inter
    # Devices 0 and 9: the guess puts them on nodes 0 and 1, the map on one.
    old, new = _grow([0, 9])
    guess = plan_switch(MODEL, old, new, devices_per_node=8, links=LINKS)
    real = plan_switch(MODEL, old, new, devices_per_node={0: "node-a", 9: "node-a"}, links=LINKS)
    assert _ports(guess) == {0: [0, 0, R, 0], 9: [0, 0, 0, R]}
    assert _ports(real) == {0: [R, 0, 0, 0], 9: [0, R, 0, 0]}
    assert plan_stats(real).modelled_seconds == R / LINKS.intra
    # Its only holder is on its node: all of it must come over NVLink.
    assert plan_stats(real).lower_bound_seconds == R / LINKS.intra


def test_the_source_on_the_receivers_real_node_sends_over_nvlink():
    """Replicas on 0 and 8, a new one on 1. The guess puts 1 beside 0; the map beside 8. The
    plan is the same with the roles of 0 and 8 swapped: the holder on 1's node sends most of
    it over NVLink, the other the rest over its NIC, at the same time."""
    old = parse_layout("dp=2").with_devices([0, 8])
    new = parse_layout("dp=3").with_devices([0, 8, 1])
    guess = _ports(plan_switch(MODEL, old, new, devices_per_node=8))
    real = _ports(plan_switch(MODEL, old, new,
                              devices_per_node={0: "node-a", 8: "node-b", 1: "node-b"}))
    near, far = guess[0][0], guess[8][2]
    assert near + far == R and near > far > 0
    assert guess == {0: [near, 0, 0, 0], 8: [0, 0, far, 0], 1: [0, near, 0, far]}
    assert real == {8: [near, 0, 0, 0], 0: [0, 0, far, 0], 1: [0, near, 0, far]}


def test_a_device_missing_from_the_map_is_a_node_of_its_own():
    old, new = _grow([0, 1])
    for nodes in ({0: "node-a"}, {1: "node-a"}, {5: "node-a"}):
        plan = plan_switch(MODEL, old, new, devices_per_node=nodes, links=LINKS)
        assert _ports(plan) == {0: [0, 0, R, 0], 1: [0, 0, 0, R]}, nodes
    # Two missing devices do not share a node either (the guess would put 2 and 3 together).
    assert port_bytes([(2, 3, 7)], {0: "node-a"}) == {2: [0, 0, 7, 0], 3: [0, 0, 0, 7]}
    assert port_bytes([(2, 3, 7)], 8) == {2: [7, 0, 0, 0], 3: [0, 7, 0, 0]}
    assert node_of({0: "node-a"}, 3) != node_of({0: "node-a"}, 2)


def test_the_bounds_read_the_map():
    # Receiver 1 needs 9 GB held only by device 0: over NVLink by the guess, a NIC by the map.
    demand = {(0,): {1: 9 * 10 ** 9}}
    assert lower_bound_seconds(demand, 8, LINKS) == 1.0
    assert lower_bound_seconds(demand, {0: "a", 1: "b"}, LINKS) == 9.0


@settings(max_examples=25, deadline=None)
@given(transitions())
def test_a_map_of_the_guessed_nodes_plans_exactly_as_the_number(case):
    """``{d: d // n}`` named any way is the same topology as ``n``: the same plan, move for
    move, and the same modelled time and bounds (node ids are only ever compared)."""
    model, old, new = case
    devices = set(old.device_of) | set(new.device_of)
    for n in (1, 2, 3):
        by_number = plan_switch(model, old, new, devices_per_node=n, links=LINKS)
        by_name = plan_switch(model, old, new, links=LINKS,
                              devices_per_node={d: f"rack{9 - d // n}" for d in devices})
        assert by_name.copies == by_number.copies
        assert by_name.transfers == by_number.transfers
        assert by_name.demand == by_number.demand
        a, b = plan_stats(by_name), plan_stats(by_number)
        assert replace(a, plan_seconds=0) == replace(b, plan_seconds=0)


@settings(max_examples=15, deadline=None)
@given(recoveries())
def test_a_recovery_plans_on_real_nodes(case):
    """Dead devices and their proxies, on nodes that are not contiguous in device order."""
    model, old, new, dead, proxies = case
    devices = sorted(set(old.device_of) | set(new.device_of))
    nodes = {d: f"node-{d % 3}" for d in devices}
    plan = plan_switch(model, old, new, devices_per_node=nodes, dead=dead, proxies=proxies)
    verify_plan(plan, dead, proxies)
    for d, ports in _ports(plan).items():
        assert ports[0] == sum(m.nbytes * len(plan.groups[m.group].names)
                               for m in plan.transfers
                               if m.src == d and nodes[m.dst] == nodes[d])


def test_the_plan_keeps_a_copy_of_its_map():
    nodes = {0: "node-a", 1: "node-b"}
    plan = plan_switch(MODEL, *_grow([0, 1]), devices_per_node=nodes)
    nodes[1] = "node-a"
    assert plan.devices_per_node == {0: "node-a", 1: "node-b"}


@pytest.mark.parametrize("bad, says", [
    (0, "devices_per_node=0 must be >= 1"),
    (-1, "devices_per_node=-1 must be >= 1"),
    ("8", "devices_per_node='8' must be a number of devices per node"),
    (True, "devices_per_node=True must be a number of devices per node"),
    (2.0, "devices_per_node=2.0 must be a number of devices per node"),
    (None, "devices_per_node=None must be"),
    ({0: 1}, "devices_per_node maps 0 to 1"),
    ({"0": "node-a"}, "devices_per_node maps '0' to 'node-a'"),
    ({0: ""}, "devices_per_node maps 0 to ''"),
])
def test_a_bad_node_map_is_refused_by_name(bad, says):
    with pytest.raises(PlanError) as e:
        plan_switch(MODEL, *_grow([0, 1]), devices_per_node=bad)
    assert says in str(e.value)
    with pytest.raises(ValueError) as e:
        port_bytes([(0, 1, 1)], bad)
    assert says in str(e.value)


def test_the_mirrors_and_the_planner_share_one_node_map():
    from dynatrain.trainer import redundancy
    from dynatrain.vps import topology

    assert redundancy.node_of is topology.node_of and redundancy.Nodes is topology.Nodes


def test_the_controller_plans_on_real_nodes_only_when_it_knows_them_all():
    from dynatrain.controller.core import JobController

    old = parse_layout("dp=2").with_devices([0, 1])
    new = parse_layout("dp=3").with_devices([0, 1, 9])
    ctl = SimpleNamespace(devices_per_node=4, device_nodes={0: "a", 1: "b", 9: "a", 5: "c"})
    assert JobController._nodes_for(ctl, old, new) == {0: "a", 1: "b", 9: "a"}
    ctl.device_nodes.pop(9)
    assert JobController._nodes_for(ctl, old, new) == 4
    assert JobController._nodes_for(ctl, old) == {0: "a", 1: "b"}


@pytest.mark.parametrize("given_nodes, planned_on", [
    ({0: "node-a"}, {0: "node-a"}),
    ({}, 8),                          # unknown nodes: the default guess, as before
    (2, 2),
])
def test_a_prepared_switch_plans_on_the_node_map_it_is_given(given_nodes, planned_on):
    """The device manager hands the node map to the planner (a one-device switch: its
    transition group needs no other process)."""
    from datetime import timedelta

    import torch.distributed as dist

    from dynatrain.vps.generations import DeviceManager

    layout = parse_layout("dp=1").with_devices([0])
    mgr = DeviceManager(dist.HashStore(), 0, timeout=timedelta(seconds=20))
    prepared = mgr.prepare(1, MODEL, layout, layout, staging_bytes=1 << 20,
                           devices_per_node=given_nodes, direct_bytes=None).result(timeout=30)
    assert prepared.plan.devices_per_node == planned_on

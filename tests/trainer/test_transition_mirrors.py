"""Recovery from mirrors, for real: a dead device's state, held by a live proxy, arrives bit-exact.

Worker processes (one per device) talk over gloo groups built straight from a TCPStore, as the
device manager builds them. Each case starts from random full tensors cut into every old
device's local tensors with the mapping's pieces; the dead device takes no part, and its proxy
holds its old local tensors as a mirror. The survivors run :func:`execute_transition` and every
new local tensor must equal the matching region of the full tensors, bit for bit. The cases are
chosen so that the dead device's state is unique (the plan fails without the proxy), and the
proxy copies from the mirror locally, sends from it, and sends from its own tensors too.
"""

import queue
import time
import traceback
from datetime import timedelta
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from dynatrain.trainer import processes
from dynatrain.vps.layout import bind, parse_layout
from dynatrain.vps.mapping import rank_shards
from dynatrain.vps.planner import PlanError, plan_switch
from dynatrain.vps.presets import PRESETS
from dynatrain.vps.regions import piece_view
from dynatrain.vps.rounds import schedule_rounds
from dynatrain.vps.transition import (TransitionConfig, TransitionError, TransitionInputs,
                                      execute_transition)
from dynatrain.vps.verify import verify_plan
from engine_state import box_of, cut, full_state

DEVICES = 4  # one worker process per device id used by any case


class Case(NamedTuple):
    model: str
    old: str
    old_devices: list[int]
    new: str
    new_devices: list[int]
    proxies: dict[int, int]
    """Dead device -> the live device holding its mirror."""
    adopts: int | None = None
    """A proxy expected to keep its own old tensors as new ones (instead of copying from the
    mirror, which then only travels to others)."""


CASES = [
    # Every device's state is unique; the proxy copies from the mirror, sends from it, and
    # sends its own state to the same receivers (one queue per pair, mixed).
    Case("gpt-tiny", "tp=2,pp=2", [0, 1, 2, 3], "dp=3,zero=1", [0, 1, 2], {3: 1}),
    # A spare replaces the dead device: the proxy keeps its own tensors (adopted, no copy)
    # and sends the mirror to the spare.
    Case("gpt-tiny", "pp=3", [0, 1, 2], "pp=3", [0, 1, 3], {2: 1}, adopts=1),
    # EP x PP to PP; the proxy lives on the other stage.
    Case("moe-tiny", "dp=2,ep=2,pp=2", [0, 1, 2, 3], "pp=3", [2, 0, 1], {3: 0}),
    # A joiner holds the mirror; ZeRO-1 flat ranges to ZeRO-3 with EP.
    Case("moe-tiny", "tp=2,zero=1", [0, 1], "dp=2,ep=2,zero=3", [0, 3], {1: 3}),
    # Two dead devices (a whole stage), both mirrored on one proxy.
    Case("gpt-tiny", "tp=2,pp=2", [0, 1, 2, 3], "dp=2", [0, 1], {2: 1, 3: 1}),
]
STAGING = 4 << 20  # small, so that several rounds interleave own and mirrored regions


def _layouts(case: Case):
    """(model, old layout, new layout, dead devices): each case's dead devices are exactly
    those with a proxy."""
    model = PRESETS[case.model]
    old = parse_layout(case.old).with_devices(case.old_devices)
    new = parse_layout(case.new).with_devices(case.new_devices)
    return model, old, new, frozenset(case.proxies)


def _run_case(index: int, case: Case, device: int, store) -> tuple:
    model, old, new, dead = _layouts(case)
    proxies = case.proxies
    members = sorted((set(old.device_of) | set(new.device_of)) - dead)
    if device not in members:
        return (index, device, "absent", {})
    plan = plan_switch(model, old, new, devices_per_node=2, dead=dead, proxies=proxies)
    rounds = schedule_rounds(plan, STAGING)
    full = full_state(model, seed=index)
    ob, nb = bind(old, model), bind(new, model)
    old_local, old_pieces = cut(ob, device, full) if device in ob.rank_of_device else ({}, {})
    mirrored = {d: cut(ob, d, full)[0] for d, p in proxies.items() if p == device}
    mirror_before = {d: {k: t.clone() for k, t in m.items()} for d, m in mirrored.items()}
    new_shapes, new_pieces = {}, {}
    if device in nb.rank_of_device:
        for rs in rank_shards(nb, nb.rank_of_device[device]):
            key = (rs.tensor.name, rs.state)
            new_shapes[key] = (rs.local_shape, full[key].dtype)
            new_pieces[key] = rs.pieces
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"case{index}", store),
                                  members.index(device), len(members), timedelta(seconds=30))
    new_local, stats = execute_transition(
        TransitionInputs(plan=plan, device=device, old=old_local, new_shapes=new_shapes,
                         group=group, group_rank={d: i for i, d in enumerate(members)},
                         rounds=rounds, old_pieces=old_pieces, new_pieces=new_pieces,
                         mirrored=mirrored),
        TransitionConfig(staging_bytes=STAGING, checksums=True, timeout=timedelta(seconds=30)))
    wrong = [f"{key} piece {piece.box}" for key, pieces in new_pieces.items() for piece in pieces
             if not torch.equal(piece_view(new_local[key], piece), box_of(full[key], piece.box))]
    wrong += [f"mirror of {d} changed: {k}" for d, m in mirrored.items() for k, t in m.items()
              if not torch.equal(t, mirror_before[d][k])]
    return (index, device, "; ".join(wrong[:5]) or "ok",
            {"sent": stats.bytes_sent, "copied": stats.bytes_copied,
             "adopted": stats.bytes_adopted})


def _worker(device: int, port: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, DEVICES + 1, is_master=False,
                          timeout=timedelta(seconds=60))
    for index, case in enumerate(CASES):
        try:
            results.put(_run_case(index, case, device, store))
        except Exception as e:  # noqa: BLE001 - any failure is reported; the parent fails on it
            results.put((index, device, f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
                         {}))
    results.close()
    results.join_thread()


def test_a_proxy_that_takes_over_copies_from_the_mirror_without_network():
    """Old tp=2 on devices 0 and 1, device 1 dead, device 0 alone afterwards: every move is a
    local copy on 0, half of them from the mirror; no process group is needed."""
    case = Case("gpt-tiny", "tp=2", [0, 1], "dp=1", [0], {1: 0})
    model, old, new, dead = _layouts(case)
    plan = plan_switch(model, old, new, dead=dead, proxies=case.proxies)
    assert not plan.transfers and {m.owner for m in plan.copies} == {0, 1}
    full = full_state(model, seed=7)
    ob, nb = bind(old, model), bind(new, model)
    shapes = {(rs.tensor.name, rs.state): (rs.local_shape, full[(rs.tensor.name, rs.state)].dtype)
              for rs in rank_shards(nb, 0)}
    def local(**kw):
        return TransitionInputs(plan=plan, device=0, old=cut(ob, 0, full)[0], new_shapes=shapes,
                                group=None, group_rank={}, rounds=[], **kw)

    new_local, stats = execute_transition(local(mirrored={1: cut(ob, 1, full)[0]}))
    assert stats.bytes_sent == stats.bytes_received == 0 and new_local.keys() == full.keys()
    for key, t in new_local.items():
        assert torch.equal(t, full[key]), key
    with pytest.raises(TransitionError,
                       match=r"holds no mirror of device 1 .* mirrored=\{1: \.\.\.\}"):
        execute_transition(local())


@pytest.mark.parametrize("index", range(len(CASES)))
def test_the_plan_reads_the_mirror(index):
    """The cases mean what they say: state is lost without the proxy, and the proxy both
    copies and sends from the mirror where it is a receiver."""
    case = CASES[index]
    model, old, new, dead = _layouts(case)
    with pytest.raises(PlanError, match="no surviving copy"):
        plan_switch(model, old, new, devices_per_node=2, dead=dead)
    plan = plan_switch(model, old, new, devices_per_node=2, dead=dead, proxies=case.proxies)
    verify_plan(plan, dead, case.proxies)
    for d, p in case.proxies.items():
        mirrored = [m for m in plan.copies + plan.transfers if m.owner == d]
        assert mirrored and all(m.src == p for m in mirrored)
        assert any(m.dst != p for m in mirrored)                         # sent from the mirror
        if p in new.device_of and case.adopts is None:
            assert any(m.dst == p for m in mirrored)                     # copied from it
    if index == 0:  # own and mirrored regions share the proxy's queues to the same receivers
        own = {m.dst for m in plan.transfers if m.src == 1 and m.owner == 1}
        assert own & {m.dst for m in plan.transfers if m.src == 1 and m.owner == 3}


def test_survivors_rebuild_the_new_layout_bit_exact_from_mirrors():
    start = time.monotonic()
    store = dist.TCPStore("127.0.0.1", 0, DEVICES + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    results = processes.context().Queue()
    procs = processes.start_ranks(_worker, args=(store.port, results), nprocs=DEVICES)
    reports, deadline = [], time.monotonic() + 120
    try:
        while len(reports) < DEVICES * len(CASES):
            try:
                reports.append(results.get(timeout=1.0))
            except queue.Empty:
                died = [p.exitcode for p in procs.processes if p.exitcode not in (None, 0)]
                assert not died and time.monotonic() < deadline, (
                    f"workers died (exit codes {died}) or timed out; reports so far: {reports}")
    finally:
        for p in procs.processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failures = [r for r in reports if r[2] not in ("ok", "absent")]
    assert not failures, failures
    for index, case in enumerate(CASES):
        _, old, new, dead = _layouts(case)
        ran = sorted(r[1] for r in reports if r[0] == index and r[2] == "ok")
        assert ran == sorted((set(old.device_of) | set(new.device_of)) - dead), (index, ran)
        by_device = {r[1]: r[3] for r in reports if r[0] == index}
        for p in set(case.proxies.values()):
            assert by_device[p]["sent"] > 0, (index, p, by_device[p])
        if case.adopts is not None:
            assert by_device[case.adopts]["adopted"] > 0, (index, by_device)
    assert time.monotonic() - start < 60

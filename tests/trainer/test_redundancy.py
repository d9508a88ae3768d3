"""In-memory redundancy: who mirrors whom, what is unique, which step survives, and real runs.

The pure tests check the metadata every rank derives on its own (buddies, unique shards,
recovery needs, the restore-step rule). The multi-process tests train gpt-tiny over gloo with a
Redundancy per rank and check bit for bit that snapshots, mirrors and a trainer rebuilt from a
snapshot reproduce what the original run held and did.
"""

import time
from datetime import timedelta

import pytest
import torch

from dynatrain.trainer import processes
from dynatrain.trainer.config import make_config
from dynatrain.trainer.redundancy import (Redundancy, buddy_map, recovery_needs, restore_step,
                                          source_map, unique_shards)
from dynatrain.vps.layout import bind, parse_layout
from dynatrain.vps.mapping import rank_shards

KW = dict(global_batch_size=8, seq_len=16)


def bound_of(model, layout):
    cfg = make_config(model, layout, **KW)
    return bind(cfg.layout, cfg.model)


def unique_keys(bound, rank):
    return {(rs.tensor.name, rs.state) for rs in unique_shards(bound, rank)}


def brute_force_unique(bound, rank):
    """Unique by definition: no other rank holds the identical pieces of that state."""
    others = {(rs.tensor.name, rs.state, rs.pieces)
              for r in range(bound.world) if r != rank for rs in rank_shards(bound, r)}
    return {(rs.tensor.name, rs.state) for rs in rank_shards(bound, rank)
            if rs.pieces and (rs.tensor.name, rs.state, rs.pieces) not in others}


# -- buddies -----------------------------------------------------------------------------------
@pytest.mark.parametrize("world,per_node", [(2, 1), (4, 1), (4, 2), (8, 4), (16, 8), (24, 8),
                                            (8, 8), (3, 1), (6, 4)])
def test_buddies_are_a_permutation_and_avoid_the_node_when_possible(world, per_node):
    lay = parse_layout(f"dp={world}")
    buddy, source = buddy_map(lay, per_node), source_map(lay, per_node)
    assert sorted(buddy) == list(range(world))
    assert all(buddy[r] != r for r in range(world))
    assert all(source[buddy[r]] == r for r in range(world))
    nodes = [d // per_node for d in lay.device_of]
    largest = max(nodes.count(n) for n in set(nodes))
    if largest <= world // 2:                      # another node for everyone is possible
        assert all(nodes[buddy[r]] != nodes[r] for r in range(world)), buddy


def test_buddies_follow_devices_not_rank_numbers():
    # A layout after a failure: device 7 gone, so node 0 has 7 ranks and node 1 has 8.
    lay = parse_layout("dp=2,tp=7").with_devices([8, 0, 9, 1, 10, 2, 11, 3, 12, 4, 13, 5, 14, 6])
    buddy = buddy_map(lay, 8)
    nodes = [d // 8 for d in lay.device_of]
    assert sorted(buddy) == list(range(14))
    assert all(nodes[buddy[r]] != nodes[r] for r in range(14))


@pytest.mark.parametrize("placement", [
    # device -> node as a scheduler placed them: device ids say nothing about nodes
    {0: "a", 1: "a", 2: "b", 3: "b"},
    {0: "a", 1: "b", 2: "a", 3: "b"},
    {5: "x", 9: "x", 2: "y", 7: "z"},
    {0: "a", 1: "b", 2: "b", 3: "c", 4: "c", 5: "a"},
])
def test_buddies_follow_the_real_nodes_of_the_devices(placement):
    devices = sorted(placement)
    lay = parse_layout(f"dp={len(devices)}").with_devices(devices)
    buddy = buddy_map(lay, placement)
    assert sorted(buddy) == list(range(len(devices)))
    nodes = [placement[d] for d in lay.device_of]
    assert all(nodes[buddy[r]] != nodes[r] for r in range(len(devices))), (buddy, nodes)
    # What the old guess (device // 8: all on one node) made of the first placement: device 0
    # mirrored on device 1, the same real node, so losing node "a" lost both copies.
    if placement == {0: "a", 1: "a", 2: "b", 3: "b"}:
        guessed = buddy_map(lay, 8)
        assert nodes[guessed[0]] == nodes[0]
    # ZeRO-1: every rank holds a unique optimizer shard. A whole node lost is recoverable.
    cfg = make_config("gpt-tiny", f"dp={len(devices)},zero=1", global_batch_size=12, seq_len=16)
    bound = bind(cfg.layout.with_devices(devices), cfg.model)
    lost = [d for d in devices if placement[d] == placement[devices[0]]]
    needs = recovery_needs(bound, lost, placement)
    assert set(needs) == set(lost) and None not in needs.values(), needs


def test_bad_ranks_per_node_is_named():
    with pytest.raises(ValueError, match="devices_per_node=0"):
        buddy_map(parse_layout("dp=2"), 0)


# -- unique state ------------------------------------------------------------------------------
def test_plain_data_parallel_has_nothing_unique():
    b = bound_of("gpt-tiny", "dp=2")
    assert unique_keys(b, 0) == unique_keys(b, 1) == set()


def test_zero1_makes_exactly_the_optimizer_shards_unique():
    b = bound_of("gpt-tiny", "dp=2,zero=1")           # fp32: the param is its own master
    names = {t.name for t in b.model.tensors}
    for r in range(2):
        assert unique_keys(b, r) == {(n, s) for n in names for s in ("exp_avg", "exp_avg_sq")}
    b = bind(parse_layout("dp=2,zero=1"), make_config("llama-7b", "dp=2").model)  # bf16
    assert {s for _, s in unique_keys(b, 0)} == {"master", "exp_avg", "exp_avg_sq"}


def test_tensor_parallel_leaves_replicated_norms_and_biases_out():
    b = bound_of("gpt-tiny", "dp=1,tp=2")
    split = {t.name for t in b.model.tensors if t.tp_dim is not None}
    assert split and split != {t.name for t in b.model.tensors}
    for r in range(2):
        assert {n for n, _ in unique_keys(b, r)} == split


def test_pipeline_stages_are_unique_but_the_tied_embedding_is_not():
    b = bound_of("gpt-tiny", "pp=2")
    tied = {("embed.tokens", s) for s in ("param", "exp_avg", "exp_avg_sq")}
    for r in range(2):
        keys = {(rs.tensor.name, rs.state) for rs in rank_shards(b, r)}
        assert tied <= keys and unique_keys(b, r) == keys - tied
    single = bound_of("gpt-tiny", "dp=1")
    assert unique_keys(single, 0) == {(rs.tensor.name, rs.state) for rs in rank_shards(single, 0)}


@pytest.mark.parametrize("model,layout", [
    ("gpt-tiny", "dp=1"), ("gpt-tiny", "dp=2"), ("gpt-tiny", "dp=2,zero=1"),
    ("gpt-tiny", "tp=2"), ("gpt-tiny", "pp=2"), ("gpt-tiny", "dp=2,pp=2,zero=1"),
    ("gpt-tiny", "dp=2,tp=2,zero=3"), ("gpt-tiny", "pp=2,stages=3+1,zero=1"),
    ("moe-tiny", "dp=4,ep=2,zero=1"), ("moe-tiny", "tp=4"), ("moe-tiny", "dp=2,ep=2"),
])
def test_unique_matches_the_definition(model, layout):
    b = bound_of(model, layout)
    for r in range(b.world):
        assert unique_keys(b, r) == brute_force_unique(b, r), (layout, r)


# -- which step survives -----------------------------------------------------------------------
def test_restore_step_takes_the_latest_step_everyone_has():
    own = {0: [4, 5], 2: [4, 5], 3: [4, 5]}
    assert restore_step(own, {0: [4, 5], 2: [4], 3: [4, 5]}, {}) == 5
    assert restore_step(own, {0: [4, 5], 2: [4], 3: [4, 5]}, {1: 2}) == 4  # mirror of 5 late
    assert restore_step({0: [4, 5], 2: [5, 6]}, {}, {}) == 5                # one ran ahead
    assert restore_step({0: [4, 5], 2: [6, 7]}, {}, {}) is None             # nothing in common
    assert restore_step(own, {}, {1: None}) is None                         # buddy died too
    assert restore_step(own, {0: [4, 5]}, {1: 7}) is None                   # 7 is not a survivor
    assert restore_step({}, {}, {}) is None


def test_recovery_needs_names_the_buddy_or_none():
    b = bound_of("gpt-tiny", "dp=2")                  # replicas only
    assert recovery_needs(b, [1]) == {}
    assert recovery_needs(b, [0, 1]) == {0: None, 1: None}   # no replica left of anything
    b = bound_of("gpt-tiny", "dp=2,zero=1")
    assert recovery_needs(b, [1]) == {1: 0}
    b = bound_of("gpt-tiny", "dp=2,pp=2,zero=1")
    assert recovery_needs(b, [1], devices_per_node=2) == {1: 3}
    assert recovery_needs(b, [0, 3], devices_per_node=2) == {0: 2, 3: 1}
    assert recovery_needs(b, [1, 3], devices_per_node=2) == {1: None, 3: None}  # buddies
    # Node 0 (ranks 0, 1) holds both replicas of stage 0's parameters: mirrors cover only
    # unique state, so losing that node loses them.
    assert recovery_needs(b, [0, 1], devices_per_node=2) == {0: None, 1: None}
    # The rule end to end: survivors' reports -> the step to restore.
    needs = recovery_needs(b, [0, 3], devices_per_node=2)
    assert restore_step({1: [6, 7], 2: [6, 7]}, {1: [6, 7], 2: [6]}, needs) == 6
    assert restore_step({1: [6, 7], 2: [6, 7]}, {1: [6, 7], 2: [6, 7]}, needs) == 7
    with pytest.raises(ValueError, match="dead device 9"):
        recovery_needs(b, [9])


# -- real runs ---------------------------------------------------------------------------------
# Every case runs in the same two worker processes, one after the other (each with its own
# groups): starting processes and importing torch costs more than the training itself.
CASES = [("dp=2,zero=1", 1), ("pp=2", 1), ("dp=2,zero=1", 1, "background")]
"""(layout, ranks per node[, "background": the exchange posted from a thread after the
copies, as on a GPU])."""
STUCK = len(CASES)
"""The index of the last phase of the same processes: a peer that stops taking part."""
WORLD = 2
STEPS = 3


def _run_case(rank, mgr, generation, layout, per_node, outdir, *flags):
    from dynatrain.trainer.groups import build_groups
    from dynatrain.trainer.trainer import Trainer

    cfg = make_config("gpt-tiny", layout, **KW)
    lay = cfg.layout.with_devices(range(WORLD))
    bound = bind(lay, cfg.model)
    groups = build_groups(bound, rank, mgr.group_factory(generation, lay))
    red = Redundancy(bound, rank, mgr.build_group(generation, "redundancy", list(range(WORLD))),
                     devices_per_node=per_node, post_in_background="background" in flags)
    trainer = Trainer(cfg, groups)

    def record():
        st = trainer.local_state()
        return {k: t.detach().clone() for k, (t, _) in st.tensors.items()}

    recorded, losses = {0: record()}, {}
    red.snapshot(trainer.local_state())
    for _ in range(STEPS):
        red.wait_mirror()                      # where the worker calls it: before the step
        loss = trainer.train_step().loss
        losses[trainer.step] = loss
        recorded[trainer.step] = record()
        red.snapshot(trainer.local_state())
    in_flight = red.holdings()
    red.wait_mirror()
    holdings = red.holdings()

    checks = {"in_flight": in_flight, "holdings": holdings, "unique": red.unique,
              "buddy": red.buddy, "source": red.source}
    for s in holdings[0]:
        st = red.restore(s)
        checks[f"restore_{s}"] = (st.step == s and st.tensors.keys() == recorded[s].keys()
                                  and all(torch.equal(st.tensors[k][0], recorded[s][k])
                                          for k in recorded[s]))
    for s in holdings[0]:
        torch.save(recorded[s], f"{outdir}/own_{rank}_{s}.pt")
        if red.source is not None:
            torch.save(red.restore_mirror(s), f"{outdir}/mirror_{rank}_{s}.pt")

    # A trainer rebuilt from the older snapshot redoes the last step exactly.
    again = Trainer(cfg, groups, state=red.restore(STEPS - 1))
    loss = again.train_step().loss
    checks["rebuilt_loss"] = (loss, losses[STEPS])
    checks["rebuilt_state"] = all(torch.equal(t, recorded[STEPS][k])
                                  for k, (t, _) in again.local_state().tensors.items())
    red.close()
    checks["closed_memory"] = red.memory_bytes()
    return checks


def _run_stuck_peer(rank, mgr, generation, store):
    """Rank 1 is alive but never takes part (a stuck peer); rank 0 snapshots, so its mirror
    send to rank 1 and its receive from rank 1 stay in flight, and then ends the generation
    as an agent does after a recovery (``drop``). Rank 1 is released once rank 0 reported."""
    from dynatrain.trainer.trainer import LocalState
    from dynatrain.trainer.weights import TORCH_DTYPES

    cfg = make_config("gpt-tiny", "pp=2", **KW)
    bound = bind(cfg.layout.with_devices(range(WORLD)), cfg.model)
    group = mgr.build_group(generation, "redundancy", list(range(WORLD)))
    if rank == 1:
        store.wait(["stuck-peer-reported"], timedelta(seconds=60))
        return {}
    red = Redundancy(bound, rank, group, devices_per_node=1)
    tensors = {(rs.tensor.name, rs.state): (
        torch.zeros(rs.local_shape, dtype=TORCH_DTYPES[rs.tensor.dtype]
                    if rs.state == "param" else torch.float32), rs.pieces)
        for rs in rank_shards(bound, rank)}
    red.snapshot(LocalState(tensors, step=1, data_position=0))
    in_flight = red.drop()
    return {"in_flight": len(in_flight),
            "completed": [bool(work.is_completed()) for work, _ in in_flight],
            "buffers_kept": all(buf.numel() > 0 for _, buf in in_flight),
            "memory_after_drop": red.memory_bytes()}


def _worker(rank, port, outdir, results):
    import faulthandler
    import os
    import traceback

    import torch.distributed as dist

    from dynatrain.vps.generations import DeviceManager

    # A hang must not stall the suite: dump every thread's stack and exit instead.
    faulthandler.dump_traceback_later(60, exit=True)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=False,
                          timeout=timedelta(seconds=60))
    mgr = DeviceManager(store, rank, timeout=timedelta(seconds=60))
    for i, (layout, per_node, *flags) in enumerate(CASES):
        os.makedirs(f"{outdir}/{i}", exist_ok=True)
        try:
            results.put(("ok", i, rank, _run_case(rank, mgr, i, layout, per_node,
                                                  f"{outdir}/{i}", *flags)))
        except BaseException as e:  # report by name; the peer may be stuck, so stop here
            message = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            results.put(("error", i, rank, message))
            break
    else:
        try:
            results.put(("ok", STUCK, rank, _run_stuck_peer(rank, mgr, STUCK, store)))
        except BaseException as e:  # noqa: BLE001 - reported by name
            results.put(("error", STUCK, rank, f"{type(e).__name__}: {e}\n"
                                               f"{traceback.format_exc()}"))
        if rank == 0:
            store.set("stuck-peer-reported", "1")
    results.close()
    results.join_thread()                      # flush the reports before the abrupt exit
    os._exit(0)                                # no teardown of gloo groups: it only costs time


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case index: {rank: checks} or an error message}, from one pair of processes."""
    import queue

    import torch.distributed as dist

    outdir = tmp_path_factory.mktemp("redundancy")
    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    results = processes.context().Queue()
    procs = processes.start_ranks(_worker, args=(store.port, str(outdir), results), nprocs=WORLD)
    out: dict = {i: {} for i in range(len(CASES) + 1)}
    pending = (len(CASES) + 1) * WORLD
    deadline = time.monotonic() + 75
    while pending and time.monotonic() < deadline:
        try:
            kind, i, rank, payload = results.get(timeout=1)
        except queue.Empty:
            if any(p.exitcode is not None for p in procs.processes):
                break                          # a worker died (its watchdog names where)
            continue
        if kind == "error":
            out[i] = f"rank {rank}: {payload}"
            break
        out[i][rank] = payload
        pending -= 1
    for p in procs.processes:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs.processes]
    for i, got in out.items():
        if isinstance(got, dict) and len(got) < WORLD:
            name = CASES[i][0] if i < len(CASES) else "stuck peer"
            out[i] = (f"case {name}: reports from ranks {sorted(got)} only (worker exit "
                      f"codes {codes}); a hung worker's stacks are in the captured stderr")
    return outdir, out


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_snapshots_and_mirrors_are_bit_exact_in_a_real_run(runs, case):
    outdir, out = runs
    layout, per_node, *_ = CASES[case]
    reports = out[case]
    assert isinstance(reports, dict) and len(reports) == WORLD, reports
    path = outdir / str(case)
    bound = bound_of("gpt-tiny", layout)
    buddy = buddy_map(bound.layout, per_node)
    last = [STEPS - 1, STEPS]
    for r, c in reports.items():
        # While step 3's exchange is in flight, its older mirror slot is being overwritten.
        assert set(last) >= set(c["in_flight"][1]) >= {STEPS - 1}, c["in_flight"]
        assert c["holdings"][0] == last
        assert set(c["unique"]) == unique_keys(bound, r)
        assert c["buddy"] == (buddy[r] if c["unique"] else None)
        if c["unique"]:
            assert reports[buddy[r]]["source"] == r
            assert reports[buddy[r]]["holdings"][1] == last
        for s in last:
            assert c[f"restore_{s}"], (r, s)
        loss, want = c["rebuilt_loss"]
        assert loss == want and c["rebuilt_state"], (r, loss, want)
        assert c["closed_memory"] == 0

    # Mirrors are the sources' unique state, bit for bit.
    own = {(r, s): torch.load(path / f"own_{r}_{s}.pt") for r in range(WORLD) for s in last}
    mirrored = 0
    for r, c in reports.items():
        if c["source"] is None:
            continue
        for s in last:
            mirror = torch.load(path / f"mirror_{r}_{s}.pt")
            src = own[(c["source"], s)]
            assert set(mirror) == set(reports[c["source"]]["unique"])
            for key, t in mirror.items():
                assert torch.equal(t, src[key]), (r, s, key)
                mirrored += 1
    assert mirrored

    # Mirroring only unique state is enough because replicas really are identical.
    holders: dict = {}
    for r in range(WORLD):
        for rs in rank_shards(bound, r):
            holders.setdefault((rs.tensor.name, rs.state, rs.pieces), []).append(r)
    for s in last:
        for (name, state, _), ranks in holders.items():
            for r in ranks[1:]:
                assert torch.equal(own[(r, s)][(name, state)], own[(ranks[0], s)][(name, state)])


def test_an_abandoned_generation_is_dropped_without_waiting_on_a_stuck_peer(runs):
    # After a recovery the agent drops the old generation's redundancy. Its buddy may be
    # alive but stuck, with the mirror exchange in flight: waiting (close) would last the
    # group's timeout and stall the new generation's first step on every peer.
    _, out = runs
    reports = out[STUCK]
    assert isinstance(reports, dict) and len(reports) == WORLD, reports
    r = reports[0]
    assert r["in_flight"] == 2                      # the send to rank 1 and the receive
    assert r["completed"] == [False, False] or r["completed"] == [True, False], r
    assert r["buffers_kept"] and r["memory_after_drop"] == 0


def test_memory_is_two_snapshots_without_mirrors():
    b = bound_of("gpt-tiny", "dp=2,zero=1")
    red = Redundancy(b, 0, None, mirror=False)
    state_bytes = sum(_numel(rs.local_shape) * 4 for rs in rank_shards(b, 0))   # all fp32
    assert red.buddy is None and red.source is None
    assert 2 * state_bytes <= red.memory_bytes() < 2 * state_bytes * 1.01
    assert red.holdings() == ([], [])
    with pytest.raises(KeyError, match="no snapshot of step 3"):
        red.restore(3)
    with pytest.raises(ValueError, match="rank=2"):
        Redundancy(b, 2, None, mirror=False)
    with pytest.raises(ValueError, match="needs a process group"):
        Redundancy(b, 0, None)
    plain = Redundancy(bound_of("gpt-tiny", "dp=2"), 1, None)   # nothing unique: no exchange
    assert plain.buddy is None and plain.source is None and plain.unique == ()


def _numel(shape):
    n = 1
    for x in shape:
        n *= x
    return n


def test_single_rank_keeps_the_last_two_steps_in_process():
    """dp=1 needs no process group: snapshots rotate, restores are clones, gaps are fine."""
    from dynatrain.trainer.groups import build_groups
    from dynatrain.trainer.trainer import Trainer

    cfg = make_config("gpt-tiny", "dp=1", **KW)
    bound = bind(cfg.layout, cfg.model)
    trainer = Trainer(cfg, build_groups(bound, 0, lambda kind, ranks: None))
    red = Redundancy(bound, 0, None)
    assert red.buddy is None and red.source is None      # world 1: nobody to mirror to
    assert len(red.unique) == len(rank_shards(bound, 0))
    want = {}
    for _ in range(3):
        trainer.train_step()
        st = trainer.local_state()
        want[st.step] = {k: t.clone() for k, (t, _) in st.tensors.items()}
        red.snapshot(st)
    assert red.holdings() == ([2, 3], [])
    got = red.restore(2)
    assert got.data_position == 2 * KW["global_batch_size"] and torch.equal(
        got.rng["cpu"], want and got.rng["cpu"])
    assert all(torch.equal(got.tensors[k][0], want[2][k]) for k in want[2])
    got.tensors[("embed.tokens", "param")][0].zero_()    # a restore is the caller's to mutate
    assert torch.equal(red.restore(2).tensors[("embed.tokens", "param")][0],
                       want[2][("embed.tokens", "param")])
    red.snapshot(trainer.local_state())                  # the same step again: replaces it
    assert red.holdings() == ([2, 3], [])
    trainer.step += 2                                    # a gap: the older slot goes
    red.snapshot(trainer.local_state())
    assert red.holdings() == ([3, 5], [])
    bad = trainer.local_state()
    bad.tensors.pop(("embed.tokens", "param"))
    with pytest.raises(KeyError, match="embed.tokens"):
        red.snapshot(bad)
    assert red.holdings() == ([3, 5], [])                # a bad state evicts nothing
    bad = trainer.local_state()
    bad.tensors[("embed.tokens", "param")] = (torch.zeros(3), ())
    with pytest.raises(ValueError, match=r"embed.tokens \(param\) at step 5 is \(3,\)"):
        red.snapshot(bad)
    red.close()
    with pytest.raises(RuntimeError, match="after close"):
        red.snapshot(trainer.local_state())

"""The multi-process CUDA checks of ``make gpu-check``: several processes sharing the one
device (a switch, a recovery from a killed rank) and one-rank groups of the device's backend.
The single-process checks and the shared helpers are in :mod:`dynatrain.bench.gpu`; like them,
every check here takes the torch device, raises :class:`~dynatrain.bench.gpu.CheckFailed` on a
difference and returns its figures, and runs on ``cpu`` too (tests/gpu does that everywhere).
"""

from __future__ import annotations

import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dynatrain.trainer.checkpoint import load_state, save_checkpoint
from dynatrain.trainer.config import make_config
from dynatrain.trainer.groups import build_groups
from dynatrain.trainer.redundancy import Redundancy
from dynatrain.trainer.switch import switch
from dynatrain.trainer.trainer import Trainer
from dynatrain.vps.generations import DeviceManager
from dynatrain.vps.layout import bind
from dynatrain.vps.transition import TransitionConfig

from .gpu import (NEW, OLD, CheckFailed, _World, _canonical, _close, _config, _on, _same, _sync,
                  backend_of)

# -- several processes on one device ---------------------------------------------------------
# Four ranks share the one device: every rank's tensors live on it, and their groups are gloo's
# (NCCL refuses two ranks of one communicator on one GPU). Gloo carries CUDA tensors in its
# collectives (all-reduce, broadcast: staged through pinned host memory on its own streams,
# which the caller's stream waits for), not in send/recv, which take host memory only (torch's
# backend table). So the trainer's layouts here are those whose steps only all-reduce (no
# pipeline stages), and the switches those whose moves all stay on their device (placement
# keeps every new shard where a copy of it already is): the engine's local copies, adoption
# and the commit all-reduce run on the device; nothing goes through send/recv. A plan that
# would send CUDA tensors through gloo is refused by name (:func:`_no_gloo_cuda_sends`).

WORLD4 = 4
SWITCH4 = ("dp=4", "dp=2,tp=2,zero=1")
"""The 4-rank switch: the tensor-parallel shards and ZeRO-1's flat optimizer shards are new
tensors (local copies), the replicated norms are adopted; training after it all-reduces over
``tp`` and ``dp`` (no pipeline: its activations would travel by send/recv)."""
RECOVERY4 = ("dp=4", "dp=3,zero=1")
"""The 4-rank recovery: one rank is killed, the three survivors restore their snapshots (no
unique state: nothing mirrored) and switch to three ranks; the parameters are adopted from the
restored snapshots, ZeRO-1's flat optimizer shards copied out of them, all on the device."""
RECOVERY4_MIRRORED = ("dp=4,zero=1", "dp=3,zero=1")
"""A recovery that needs the dead rank's mirror (its ZeRO shard is unique): its buddy sends it
on to the ranks whose new ranges cover it. Network moves: CPU only (see above)."""
BATCH4 = 12
"""Global batch size of the 4-rank checks: divisible by every data-parallel degree above."""


def _config_batch(model: str, layout: str, seq_len: int, batch: int = BATCH4):
    return make_config(model, layout, seq_len=seq_len, global_batch_size=batch)


def _no_gloo_cuda_sends(prepared, rank: int, dev: torch.device, what: str) -> int:
    """The network bytes this rank's part of ``prepared`` would move; raises on a device whose
    gloo group would have to send or receive CUDA tensors (gloo cannot: host memory only)."""
    mine = [m for msgs in prepared.rounds for m in msgs if rank in (m.src, m.dst)]
    nbytes = sum(m.nbytes for m in mine)
    if mine and dev.type == "cuda":
        raise CheckFailed(f"{what}: device {rank}'s part of the plan has {len(mine)} network "
                          f"messages ({nbytes} bytes), which gloo cannot carry from CUDA "
                          "memory (its send/recv take host tensors only); choose layouts "
                          "whose switch keeps every shard on its device")
    return nbytes


def _same_rng(a, b, what: str) -> None:
    if not torch.equal(a.rng["cpu"], b.rng["cpu"]):
        raise CheckFailed(f"{what}: the CPU RNG state differs")


def _losses_match(got: list, want: list, dev: torch.device, what: str) -> None:
    """The first loss is a forward of the same parameters (exact); later ones follow the
    optimizer and, on CUDA, backward kernels with atomics."""
    for i, (a, b) in enumerate(zip(got, want)):
        _close(a, b, 1e-6 if i == 0 else 1e-4, f"{what}: loss {i + 1}")


def _rank_entry(rank: int, world: int, port: int, results, body, dev_s: str,
                timeout_s: float, kw: dict) -> None:
    """One process of a multi-process check: ``body(rank, world, store, results, dev,
    timeout_s, **kw)``'s figures (or its error) go to ``results``; then the process ends at
    once (no teardown of groups whose members may be gone)."""
    import faulthandler
    import os
    import traceback

    # A hang must not outlive the parent's patience: dump every thread's stack and exit.
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dev = torch.device(dev_s)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        results.put(("ok", rank, body(rank, world, store, results, dev, timeout_s, **kw)))
    except BaseException as e:  # noqa: BLE001 - reported by name; the parent fails the check
        results.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    results.close()
    results.join_thread()                      # the report is out before the abrupt exit
    os._exit(0)


def _run_ranks(body, world: int, dev: torch.device, kw: dict, *, what: str,
               timeout_s: float, on_poll=None) -> dict[int, dict]:
    """Run ``body`` in ``world`` processes (:func:`dynatrain.trainer.processes.start_ranks`)
    sharing ``dev``; {rank: figures}. A rank's error, a rank that dies before it reports, or
    the deadline fails the check (every process is ended). ``on_poll(store, processes)`` is
    called about twice a second (the parent's part in a recovery: it sees a death)."""
    import queue as queue_mod

    from dynatrain.trainer import processes

    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    results = processes.context().Queue()
    # The ranks give up (faulthandler) a little before the parent does, and say where.
    procs = processes.start_ranks(_rank_entry, args=(world, store.port, results, body,
                                                     str(dev), timeout_s * 0.9, kw),
                                  nprocs=world)
    reports: dict[int, dict] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < world and not errors:
            if on_poll is not None:
                on_poll(store, procs.processes)
            try:
                kind, rank, payload = results.get(timeout=0.5)
            except queue_mod.Empty:
                died = {i: p.exitcode for i, p in enumerate(procs.processes)
                        if i not in reports and p.exitcode not in (None, 0)}
                if died:
                    errors.append(f"rank(s) {sorted(died)} died without a report (exit codes "
                                  f"{list(died.values())}; their stacks are in stderr)")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout_s:.0f} s waiting for ranks "
                                  f"{sorted(set(range(world)) - set(reports))}")
                continue
            if kind == "error":
                errors.append(f"rank {rank}: {payload}")
            else:
                reports[rank] = payload
    finally:
        for p in procs.processes:
            p.join(timeout=1.0 if errors else 15.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    if errors:
        raise CheckFailed(f"{what}: " + "\n".join(errors))
    return reports


def _as_dcp_then_a_restart(res, prepared, new_cfg, new_bound, checkpoint: str,
                           dev: torch.device, steps_after: int, what: str, who: str
                           ) -> tuple[list, list]:
    """The switched (or recovered) trainer's state equals DCP's load of ``checkpoint`` under
    the new layout, RNG included; training goes on from it as from a restart of that
    checkpoint (same new groups, one trainer after the other), on the device. Returns the
    losses (switched, restarted)."""
    ref = load_state(new_bound, prepared.new_rank, checkpoint, device=dev)
    after = res.trainer.local_state()
    _same(ref, after, what)
    _same_rng(ref, after, what)
    got = [res.trainer.train_step().loss for _ in range(steps_after)]
    _on(res.trainer.local_state(), dev, f"{who}: the trainer after {steps_after} steps")
    restart = Trainer(new_cfg, prepared.extra, device=dev, state=ref)
    want = [restart.train_step().loss for _ in range(steps_after)]
    _losses_match(got, want, dev, f"{who} vs a restart")
    return got, want


def _switch4_rank(rank, world, store, results, dev, timeout_s, *, model, old, new, seq_len,
                  steps_before, steps_after, root):
    """One of the ranks of :func:`check_switch4`."""
    from dynatrain.vps.placement import place_devices

    timeout = timedelta(seconds=timeout_s)
    mgr = DeviceManager(store, rank, backend="gloo", timeout=timeout)
    old_cfg, new_cfg = _config_batch(model, old, seq_len), _config_batch(model, new, seq_len)
    spec = old_cfg.model
    old_layout = old_cfg.layout.with_devices(range(world))
    new_layout = place_devices(spec, old_layout, new_cfg.layout, range(new_cfg.layout.world))
    t = Trainer(old_cfg, build_groups(bind(old_layout, spec), rank,
                                      mgr.group_factory(0, old_layout)), device=dev)
    new_bound = bind(new_layout, spec)
    future = mgr.prepare(1, spec, old_layout, new_layout, staging_bytes=16 << 20,
                         build_extra=lambda r: build_groups(new_bound, r,
                                                            mgr.group_factory(1, new_layout)))
    losses_before = [t.train_step().loss for _ in range(steps_before)]
    _on(t.local_state(), dev, f"rank {rank} after {steps_before} steps of {old}")
    prepared = future.result(timeout=timeout_s)
    network = _no_gloo_cuda_sends(prepared, rank, dev, f"{old} -> {new_layout.to_text()}")
    # The reference: the state before the switch, saved with DCP, loaded under the new layout.
    saved = save_checkpoint(t.local_state(), spec, root,
                            group=mgr.build_group(0, "save", list(range(world))))
    _sync(dev)
    res = switch([t], prepared, new_cfg, rank,
                 config=TransitionConfig(carve=False, staging_bytes=16 << 20, timeout=timeout),
                 torch_device=dev)
    del t
    if res.trainer is None:
        return {"left": True}
    after = res.trainer.local_state()
    _on(after, dev, f"rank {rank}'s switched trainer")
    got, want = _as_dcp_then_a_restart(
        res, prepared, new_cfg, new_bound, saved.path, dev, steps_after,
        f"rank {rank}'s state across {old} -> {new_layout.to_text()} vs "
        "DCP's resharding", f"rank {rank} after the switch")
    s = res.transfer
    return {"device": str(dev), "new_rank": prepared.new_rank, "pause": res.pause_seconds,
            "copied": s.bytes_copied, "adopted": s.bytes_adopted, "sent": s.bytes_sent,
            "received": s.bytes_received, "allocated": s.bytes_allocated,
            "network_planned": network, "losses_before": losses_before,
            "losses_after": got, "losses_restart": want,
            "cuda_bytes": torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None}


def check_switch4(dev: torch.device, *, model: str = "gpt-tiny", old: str = SWITCH4[0],
                  new: str = SWITCH4[1], seq_len: int = 32, steps_before: int = 2,
                  steps_after: int = 2, timeout_s: float = 180.0) -> dict:
    """Four processes on ``dev`` over gloo switch ``old -> new`` live: every rank's state
    before and after lives on the device, and the switched state is bit-identical to DCP's
    resharding of the state saved just before; training continues as a restart would."""
    dev = _canonical(dev)
    with tempfile.TemporaryDirectory(prefix="dynatrain-gpu-switch4-") as root:
        reports = _run_ranks(_switch4_rank, WORLD4, dev,
                             dict(model=model, old=old, new=new, seq_len=seq_len,
                                  steps_before=steps_before, steps_after=steps_after,
                                  root=root),
                             what=f"the {WORLD4}-process switch {old} -> {new} on {dev}",
                             timeout_s=timeout_s)
    new_ranks = {r: m for r, m in reports.items() if not m.get("left")}
    first = next(m for m in new_ranks.values() if m["new_rank"] == 0)
    figures = {
        "processes": WORLD4, "backend": "gloo", "device": str(dev), "switch": f"{old} -> {new}",
        "devices": sorted({m["device"] for m in new_ranks.values()}),
        "pause_seconds": max(m["pause"] for m in new_ranks.values()),
        "bytes_copied": sum(m["copied"] for m in new_ranks.values()),
        "bytes_adopted": sum(m["adopted"] for m in new_ranks.values()),
        "bytes_sent": sum(m["sent"] for m in new_ranks.values()),
        "bytes_allocated": sum(m["allocated"] for m in new_ranks.values()),
        "losses_before": first["losses_before"], "losses_after": first["losses_after"],
        "losses_restart": first["losses_restart"],
    }
    if dev.type == "cuda":
        figures["cuda_bytes_per_rank"] = [new_ranks[r]["cuda_bytes"] for r in sorted(new_ranks)]
    if not figures["bytes_copied"]:
        raise CheckFailed(f"{old} -> {new} copied nothing: the check would not exercise the "
                          "engine's local copies")
    return figures


def _recovery4_rank(rank, world, store, results, dev, timeout_s, *, model, old, new, seq_len,
                    steps, steps_after, victim, root):
    """One of the ranks of :func:`check_recovery4`; ``victim`` kills itself."""
    import json
    import os
    import signal

    from dynatrain.trainer.redundancy import recovery_needs, restore_step
    from dynatrain.vps.placement import place_devices

    timeout = timedelta(seconds=timeout_s)
    mgr = DeviceManager(store, rank, backend="gloo", timeout=timeout)
    old_cfg, new_cfg = _config_batch(model, old, seq_len), _config_batch(model, new, seq_len)
    spec = old_cfg.model
    old_layout = old_cfg.layout.with_devices(range(world))
    old_bound = bind(old_layout, spec)
    t = Trainer(old_cfg, build_groups(old_bound, rank, mgr.group_factory(0, old_layout)),
                device=dev)
    # As the worker keeps it: own snapshots every step, mirrors of the source's unique state;
    # on a GPU a snapshot's copies run on a side stream, which the next optimizer update (the
    # trainer's before_update hook) waits for, and the mirrors are waited for before the
    # step's report all-reduce.
    red = Redundancy(old_bound, rank, mgr.build_group(0, "redundancy", list(range(world))),
                     devices_per_node=1, calls_before_update=True)
    red.snapshot(t.local_state())
    for _ in range(steps):
        t.train_step(before_report=red.wait_mirror, before_update=red.before_update)
        red.snapshot(t.local_state())
    red.wait_mirror()                      # step `steps`'s mirrors are whole everywhere
    held_bytes = red.memory_bytes()
    _on(t.local_state(), dev, f"rank {rank} after {steps} steps of {old}")
    # The unfailed run's state at the last step, the reference: saved with DCP by all ranks.
    saved = save_checkpoint(t.local_state(), spec, root,
                            group=mgr.build_group(0, "save", list(range(world))))
    if rank == victim:
        results.put(("ok", rank, {"victim": True, "device": str(dev)}))
        results.close()
        results.join_thread()
        os.kill(os.getpid(), signal.SIGKILL)   # no goodbye: its peers learn it from outside
    # Survivors: the controller (the parent here) declares the death; the live trainer is
    # dropped as an interrupted worker's is (its groups have a dead member).
    store.wait(["dead"], timeout)
    if int(store.get("dead")) != victim:
        raise CheckFailed(f"rank {rank}: the parent declared device {store.get('dead')} dead, "
                          f"not {victim}")
    t0 = time.perf_counter()
    graveyard = [t.g]
    del t
    survivors = [d for d in range(world) if d != victim]
    own, mirrors = red.holdings()
    store.set(f"holdings/{rank}", json.dumps([own, mirrors]))
    held = {d: json.loads(store.get(f"holdings/{d}")) for d in survivors}
    needs = recovery_needs(old_bound, [victim], devices_per_node=1)
    step = restore_step({d: h[0] for d, h in held.items()}, {d: h[1] for d, h in held.items()},
                        needs)
    if step != saved.step:
        raise CheckFailed(f"rank {rank}: survivors' holdings {held} restore step {step}, not "
                          f"the last step {saved.step} (whose mirrors were complete)")
    new_layout = place_devices(spec, old_layout, new_cfg.layout, survivors)
    new_bound = bind(new_layout, spec)
    prepared = mgr.prepare(1, spec, old_layout, new_layout, staging_bytes=16 << 20,
                           build_extra=lambda r: build_groups(new_bound, r,
                                                              mgr.group_factory(1, new_layout)),
                           dead=frozenset({victim}), proxies=needs).result(timeout=timeout_s)
    what = f"the recovery {old} -> {new_layout.to_text()} without device {victim}"
    network = _no_gloo_cuda_sends(prepared, rank, dev, what)
    restored = red.restore(step, dev)      # straight from the slot onto the device
    _on(restored, dev, f"rank {rank}'s snapshot of step {step} restored")
    mirrored = {d: red.restore_mirror(step, dev) for d, p in needs.items() if p == rank}
    mirror_bytes = sum(x.numel() * x.element_size() for m in mirrored.values()
                       for x in m.values())
    res = switch([], prepared, new_cfg, rank,
                 config=TransitionConfig(carve=False, staging_bytes=16 << 20, timeout=timeout),
                 torch_device=dev, restored=restored, mirrored=mirrored or None)
    del restored, mirrored
    recovery_s = time.perf_counter() - t0
    graveyard.append(red.drop())           # the failed generation's redundancy, not waited on
    if res.trainer is None:
        return {"left": True, "device": str(dev)}
    after = res.trainer.local_state()
    _on(after, dev, f"rank {rank}'s recovered trainer")
    got, want = _as_dcp_then_a_restart(
        res, prepared, new_cfg, new_bound, saved.path, dev, steps_after,
        f"rank {rank}'s state after {what} vs the unfailed run's (DCP) at "
        f"step {step}", f"rank {rank} after the recovery")
    s = res.transfer
    return {"device": str(dev), "new_rank": prepared.new_rank, "restore_step": step,
            "needs": {str(k): v for k, v in needs.items()}, "holdings": held[rank],
            "pause": res.pause_seconds, "recovery": recovery_s, "copied": s.bytes_copied,
            "adopted": s.bytes_adopted, "sent": s.bytes_sent, "received": s.bytes_received,
            "network_planned": network, "mirror_bytes": mirror_bytes,
            "snapshot_bytes": held_bytes,
            "losses_after": got, "losses_restart": want}


def check_recovery4(dev: torch.device, *, model: str = "gpt-tiny", old: str = RECOVERY4[0],
                    new: str = RECOVERY4[1], victim: int = 1, seq_len: int = 32,
                    steps: int = 3, steps_after: int = 2, timeout_s: float = 180.0) -> dict:
    """Four processes on ``dev`` over gloo train ``old`` with the in-memory redundancy; one is
    killed (SIGKILL) after step ``steps``; the survivors agree on the step to restore from
    their holdings (:func:`~dynatrain.trainer.redundancy.restore_step`), restore their
    snapshots (and, as proxies, the dead rank's mirror) onto the device and switch to ``new``
    on themselves. The recovered state is on the device and bit-identical to DCP's resharding
    of the unfailed run's state at that step; training continues as a restart would."""
    import signal

    dev = _canonical(dev)
    declared = []

    def on_poll(store, procs):
        code = procs[victim].exitcode
        if code is None or declared:
            return
        if code != -signal.SIGKILL:
            raise CheckFailed(f"the victim (rank {victim}) ended with exit code {code}, not "
                              "killed (its stack is in stderr)")
        store.set("dead", str(victim))     # what the controller learns from the agent
        declared.append(time.monotonic())

    with tempfile.TemporaryDirectory(prefix="dynatrain-gpu-recovery4-") as root:
        reports = _run_ranks(_recovery4_rank, WORLD4, dev,
                             dict(model=model, old=old, new=new, seq_len=seq_len, steps=steps,
                                  steps_after=steps_after, victim=victim, root=root),
                             what=f"the {WORLD4}-process recovery {old} -> {new} on {dev}",
                             timeout_s=timeout_s, on_poll=on_poll)
    survivors = {r: m for r, m in reports.items() if not m.get("victim") and not m.get("left")}
    first = next(m for m in survivors.values() if m["new_rank"] == 0)
    return {
        "processes": WORLD4, "backend": "gloo", "device": str(dev), "killed": victim,
        "recovery": f"{old} -> {new}", "restore_step": first["restore_step"],
        "proxies": first["needs"],
        "devices": sorted({m["device"] for m in survivors.values()}),
        # From the death declared to the recovered trainer built (holdings agreed, the
        # generation prepared, snapshots restored onto the device, the switch).
        "recovery_seconds": max(m["recovery"] for m in survivors.values()),
        "redundancy_bytes_per_rank": [survivors[r]["snapshot_bytes"] for r in sorted(survivors)],
        "pause_seconds": max(m["pause"] for m in survivors.values()),
        "bytes_copied": sum(m["copied"] for m in survivors.values()),
        "bytes_adopted": sum(m["adopted"] for m in survivors.values()),
        "bytes_sent": sum(m["sent"] for m in survivors.values()),
        "bytes_from_mirrors": sum(m["mirror_bytes"] for m in survivors.values()),
        "losses_after": first["losses_after"], "losses_restart": first["losses_restart"],
    }


# -- one-rank groups -------------------------------------------------------------------------
def _collectives(group, dev: torch.device, numel: int) -> dict:
    """All-reduce (sum of float32, max of int64), broadcast and all-gather on a one-rank
    ``group`` (a ``torch.distributed`` group): each leaves its tensor as it was, on ``dev``.
    Seconds of the first all-reduce (a lazily made communicator would be made there)."""
    x = torch.arange(numel, dtype=torch.float32, device=dev) / 7
    y = x.clone()
    _sync(dev)
    t0 = time.perf_counter()
    dist.all_reduce(y, group=group)
    _sync(dev)
    first = time.perf_counter() - t0
    n = torch.arange(numel, dtype=torch.int64, device=dev) - numel // 2
    m = n.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    b = x.clone()
    dist.broadcast(b, group_src=0, group=group)
    g = torch.empty_like(x)
    dist.all_gather_into_tensor(g, x, group=group)
    for name, got, want in (("all_reduce(sum)", y, x), ("all_reduce(max)", m, n),
                            ("broadcast", b, x), ("all_gather_into_tensor", g, x)):
        if got.device != dev:
            raise CheckFailed(f"{name} on a one-rank group left its output on {got.device}, "
                              f"not {dev}")
        if not torch.equal(got, want):
            raise CheckFailed(f"{name} on a one-rank group changed its tensor")
    return {"first_all_reduce_seconds": first}


def _single_rank(rank, world, store, results, dev, timeout_s, *, numel):
    """The one process of :func:`check_single_rank_groups`."""
    from dynatrain.vps import abandon

    backend = backend_of(dev)
    timeout = timedelta(seconds=timeout_s)
    cuda = dev.type == "cuda"
    out: dict = {"backend": backend, "device": str(dev)}
    # 1. The default group of a world of one, bound to the device (NCCL: its communicator is
    #    made here, eagerly, not at the first collective).
    t0 = time.perf_counter()
    dist.init_process_group(backend, store=dist.PrefixStore("default", store), rank=0,
                            world_size=1, timeout=timeout, device_id=dev if cuda else None)
    _sync(dev)
    out["init_seconds"] = time.perf_counter() - t0
    world_group = dist.group.WORLD
    bound = world_group.bound_device_id
    out["bound_device_id"] = None if bound is None else str(bound)
    if cuda and bound != dev:
        raise CheckFailed(f"init_process_group(device_id={dev}) bound the group to {bound}")
    out["default_backend"] = dist.get_backend(world_group)
    if out["default_backend"] != backend:
        raise CheckFailed(f"the default group's backend is {out['default_backend']}, "
                          f"not {backend}")
    out["default"] = _collectives(world_group, dev, numel)
    # 2. A one-rank subgroup, bound to the device (NCCL may split it off the default one).
    t0 = time.perf_counter()
    sub = dist.new_group([0], timeout=timeout, device_id=dev if cuda else None)
    out["new_group_seconds"] = time.perf_counter() - t0
    out["new_group"] = _collectives(sub, dev, numel)
    # 3. The engine's own: a generation's transition group, as DeviceManager makes it (a
    #    ProcessGroupNCCL of one rank on CUDA, its communicator made in the background by
    #    prepare), and the commit's all-reduce on it, as the switch posts it.
    world1 = _World(dev, timeout_s)
    cfg = _config("gpt-tiny", OLD, 32)
    prepared = world1.prepare(cfg, _config("gpt-tiny", NEW, 32))
    g = prepared.transition_group
    out["engine_group"] = f"{type(g).__name__} of {g.size()} rank(s)"
    if g.size() != 1 or (cuda and not isinstance(g, dist.ProcessGroupNCCL)):
        raise CheckFailed(f"the engine's one-device transition group is {out['engine_group']}, "
                          f"not a one-rank {backend} group")
    buf = torch.zeros(3 + torch.get_rng_state().numel(), dtype=torch.int64, device=dev)
    buf[0], buf[1] = 1, 42
    _sync(dev)
    t0 = time.perf_counter()
    if abandon.wait(g.allreduce([buf]), timeout) is False:
        raise CheckFailed("the engine's one-rank all-reduce timed out")
    _sync(dev)
    out["engine_all_reduce_seconds"] = time.perf_counter() - t0
    if buf.device != dev or int(buf[0]) != 1 or int(buf[1]) != 42:
        raise CheckFailed(f"the engine's one-rank all-reduce gave {buf[:2].tolist()} on "
                          f"{buf.device}, not [1, 42] on {dev}")
    dist.destroy_process_group()
    return out


def check_single_rank_groups(dev: torch.device, *, numel: int = 1 << 20,
                             timeout_s: float = 120.0) -> dict:
    """One-rank groups of the device's backend (NCCL on CUDA, gloo on the CPU), in a process of
    their own (the default group is process-global): the default group of a world of one made
    with ``device_id`` (bound to the device; NCCL's communicator made eagerly), a one-rank
    ``new_group`` with ``device_id``, and the engine's transition group as
    :class:`~dynatrain.vps.generations.DeviceManager` makes it for a one-device switch, each
    running collectives on tensors of the device (and the commit's all-reduce on the last)."""
    dev = _canonical(dev)
    return _run_ranks(_single_rank, 1, dev, dict(numel=numel),
                      what=f"one-rank {backend_of(dev)} groups on {dev}", timeout_s=timeout_s)[0]

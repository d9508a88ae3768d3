"""A live switch measured and verified against checkpoint-and-restart, with its floors: the
benchmark behind ``dynatrain bench switch``, ``benchmarks/switch_speed.py`` and the switch tests.

One run, on this machine:

1. ``max(N_old, N_new)`` worker processes start (devices 0..W-1); the old layout trains a few
   steps while each device's :class:`DeviceManager` prepares the switch in the background
   (plan, rounds, the transition group, the new layout's groups).
2. The pre-switch state is saved with PyTorch Distributed Checkpoint; a point-to-point
   bandwidth probe runs between devices 0 and 1.
3. The live switch (timed: the pause), then every new rank loads the checkpoint through DCP
   under the new layout (DCP reshards) and compares it with what the switch delivered, bit
   for bit; the new layout trains a few steps.
4. Unless ``--no-baseline``: checkpoint-and-restart. Fresh processes for the new layout load
   the checkpoint (timed from process start to the state being ready; the save time is added)
   and train the same steps: their losses must equal the switched run's (``loss_match``).
"""

from __future__ import annotations

import os
import queue as queue_mod
import shutil
import tempfile
import time
from datetime import timedelta

from dynatrain.bench.switch_worker import live_worker, restart_worker
from dynatrain.vps.rounds import DEFAULT_STAGING_BYTES

STEPS_BEFORE = 3
STEPS_AFTER = 3


def _collect(procs, results, expected: int, deadline: float, what: str) -> list:
    out = []
    while len(out) < expected:
        try:
            out.append(results.get(timeout=1.0))
        except queue_mod.Empty:
            failed = [p.exitcode for p in procs.processes if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs.processes:
                    if p.is_alive():
                        p.terminate()
                why = f"a worker died (exit codes {failed})" if failed else "timed out"
                raise RuntimeError(f"{what}: {why}; worker tracebacks are printed above")
    procs.join(timeout=max(1.0, deadline - time.monotonic()))
    return out


def bench_switch(old_cfg, new_cfg, *, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 checksums: bool = False, direct_bytes: int | None = None, carve: bool = True,
                 baseline: bool = True, dump: str | None = None, timeout_s: float = 600.0,
                 steps_before: int = STEPS_BEFORE, steps_after: int = STEPS_AFTER,
                 progress=None, restart_fresh: bool = True, backend: str = "gloo") -> dict:
    """``backend``: gloo (every rank on the CPU), nccl (rank i on ``cuda:i``; the CLI's
    ``--backend`` resolves auto and checks that CUDA is there) or nccl-sim (the live run's
    groups with ProcessGroupNCCL's semantics on the CPU, :mod:`dynatrain.vps.ncclsim`; the
    restart baseline on gloo). Under NCCL the memory figures are torch's CUDA allocations
    (``memory: "cuda"``), not the host's RSS."""

    import torch.distributed as dist

    from dynatrain.trainer import processes
    from dynatrain.ports import free_port
    from dynatrain.vps.placement import place_devices
    from dynatrain.vps.planner import plan_switch
    from dynatrain.vps.stats import device_traffic, plan_stats

    say = progress or (lambda *_: None)
    model = old_cfg.model
    n_old, n_new = old_cfg.layout.world, new_cfg.layout.world
    world = max(n_old, n_new)
    threads = max(1, (os.cpu_count() or 1) // world)
    old_layout = old_cfg.layout.with_devices(range(n_old))
    new_layout = place_devices(model, old_layout, new_cfg.layout, range(n_new))
    plan = plan_switch(model, old_layout, new_layout)
    stats = plan_stats(plan)
    ckpt = tempfile.mkdtemp(prefix="dynatrain-ckpt-")
    deadline = time.monotonic() + timeout_s
    try:
        say(f"live: {world} processes ({backend}), {old_cfg.layout.to_text()} -> "
            f"{new_layout.to_text()}")
        store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        ctx = processes.context()
        results = ctx.Queue()
        procs = processes.start_ranks(
            live_worker, args=(world, store.port, old_cfg, new_cfg, new_layout,
                                dict(staging_bytes=staging_bytes, checksums=checksums,
                                     carve=carve,
                                     **({} if direct_bytes is None
                                        else {"direct_bytes": direct_bytes})),
                                ckpt, dump, threads, results, timeout_s,
                                (steps_before, steps_after), backend),
            nprocs=world)
        expected = world + ((n_old + n_new) if dump else 0)
        messages = _collect(procs, results, expected, deadline, "live switch")
        devices = [m for tag, m in messages if tag == "device"]
        if dump:
            _write_dump(dump, model, messages)
        first_new = next(d for d in devices if d["device"] == new_layout.device_of[0])
        first_old = next(d for d in devices if d["device"] == 0)
        bw = max(d["bandwidth"] for d in devices)
        send, recv, _ = device_traffic(plan)
        busiest = max([max(send.get(d, 0), recv.get(d, 0)) for d in range(world)] + [0])
        out = {
            "model": model.name, "from": old_layout.to_text(), "to": new_layout.to_text(),
            "backend": backend, "memory": "cuda" if backend == "nccl" else "rss",
            "ranks_from": n_old, "ranks_to": n_new, "devices_to": list(new_layout.device_of),
            "switch_seconds": max(d["pause"] for d in devices),
            "transfer_seconds": max(d["transfer"] for d in devices),
            "prepare_seconds": max(d["prepare"] for d in devices),
            "save_seconds": max(d["save"] for d in devices),
            "p2p_bytes_per_second": bw,
            # The floor: the busiest device's network bytes at the bandwidth of one
            # pair measured alone. It is 0 when placement keeps every new shard local.
            "floor_seconds": busiest / bw if bw else None,
            # What this machine allows: every device moving the same bytes at once by the
            # simplest means (one memcpy, one message per peer); the best of 3 tries' slowest
            # device. See switch_worker._probe_floor.
            "floor_concurrent_seconds": min(max(d["floor_tries"][i] for d in devices)
                                            for i in range(3)),
            "bytes_network": stats.bytes_network, "bytes_local": stats.bytes_local,
            "bytes_adopted": sum(d["adopted"] for d in devices),
            "bytes_copied": sum(d["copied"] for d in devices),
            "bytes_carved": sum(d["carved"] for d in devices),
            # New tensors and staging allocated inside the pause (0 on CPU when every new
            # tensor was adopted, carved or preallocated).
            "bytes_allocated_in_pause": sum(d["allocated"] for d in devices),
            "max_rank_bytes": busiest,
            "peak_rss_bytes": [d["peak_rss"] for d in sorted(devices, key=lambda d: d["device"])],
            # New tensors allocated before the pause (preallocate) count as growth: they are
            # already in the RSS measured just before it.
            "rss_growth_bytes": [d["peak_rss"] - d["rss_before"] + d["preallocated"]
                                 for d in devices],
            "bytes_preallocated": sum(d["preallocated"] for d in devices),
            # The bound is peak <= old + new + staging, +10%. RSS before the switch
            # already holds the old state, so growth may be new + staging + 10% of the sum.
            "rss_growth_bound_bytes": [
                d["new_bytes"] + min(staging_bytes, d["staging_peak"])
                + int(0.1 * (d["old_bytes"] + d["new_bytes"]
                             + min(staging_bytes, d["staging_peak"])))
                for d in devices],
            "staging_bytes": staging_bytes, "rounds": max(d["rounds"] for d in devices),
            "bitwise_equal": all(d["bitwise"] for d in devices),
            "pause_phases": {d["device"]: {k: round(v, 4) for k, v in d["phases"].items()}
                             for d in devices},
            # Network messages each device posted in the pause: [sent, received].
            "messages": {d["device"]: d["messages"] for d in devices},
            "losses_before": first_old["losses_before"],
            "losses_after": first_new["losses_after"],
            "restart_seconds": None, "speedup": None, "loss_match": None,
        }
        # Nothing to move (every new tensor adopted in place): no floor to compare with.
        moved = out["bytes_network"] + out["bytes_copied"] + out["bytes_carved"]
        floor = max(out["floor_seconds"] or 0.0, out["floor_concurrent_seconds"])
        out["pause_over_floor"] = out["switch_seconds"] / floor if moved and floor else None
        out["rss_within_bound"] = all(
            g <= b for g, b in zip(out["rss_growth_bytes"], out["rss_growth_bound_bytes"]))
        if baseline:
            say(f"baseline: checkpoint-and-restart into {n_new} fresh processes")
            # A restart starts fresh interpreters (that is part of what it costs), unless the
            # caller only wants its losses (restart_fresh=False: forked, torch preloaded).
            method = "spawn" if restart_fresh else None
            results = processes.context(method).Queue()
            started = time.time()
            procs = processes.start_ranks(
                restart_worker, args=(n_new, free_port(), new_cfg, new_layout, ckpt, threads,
                                       results, timeout_s, steps_after, backend),
                nprocs=n_new, method=method)
            restarted = [m for _, m in _collect(procs, results, n_new, deadline, "restart")]
            ready = max(m["ready"] for m in restarted)
            out["restart_seconds"] = out["save_seconds"] + (ready - started)
            out["speedup"] = out["restart_seconds"] / out["switch_seconds"]
            ref = next(m for m in restarted if m["rank"] == 0)["losses"]
            out["losses_restart"] = ref
            out["loss_match"] = all(abs(a - b) <= 1e-6 * abs(b)
                                    for a, b in zip(out["losses_after"], ref))
        return out
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


def _write_dump(path: str, model, messages) -> None:
    import torch

    from dynatrain.trainer.state import assemble_full
    from dynatrain.trainer.state_io import state_from_bytes

    os.makedirs(path, exist_ok=True)
    for tag in ("before", "after"):
        states = [state_from_bytes(m, source=f"a worker's {tag} state")[0]
                  for t, m in messages if t == tag]
        full = assemble_full(model, states)
        torch.save({f"{n}/{s}": t for (n, s), t in full.tensors.items()},
                   os.path.join(path, f"{tag}.pt"))

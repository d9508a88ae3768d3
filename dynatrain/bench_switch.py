"""``dynatrain bench switch``: a live switch measured and verified against checkpoint-and-restart.

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

import argparse
import json
import os
import queue as queue_mod
import shutil
import tempfile
import time
from datetime import timedelta

from dynatrain.vps.presets import PRESETS

STEPS_BEFORE = 3
STEPS_AFTER = 3


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks of the live system",
                           description="Benchmarks that run the real system on this machine.")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    p = bsub.add_parser(
        "switch", help="live switch vs checkpoint-and-restart, verified bit for bit",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: dynatrain bench switch --model gpt-tiny --from dp=2,tp=2 --to pp=2,tp=2")
    p.add_argument("--model", required=True, metavar="M", help=f"preset ({', '.join(PRESETS)})")
    p.add_argument("--from", dest="old", required=True, metavar="L")
    p.add_argument("--to", dest="new", required=True, metavar="L")
    p.add_argument("--seq-len", type=int, default=0)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--staging-mib", type=int, default=256, help="staging budget (default 256)")
    p.add_argument("--checksums", action="store_true",
                   help="verify every message's bytes (everything is packed then)")
    p.add_argument("--direct-kib", type=int, default=1024, metavar="K",
                   help="regions of at least K KiB travel unpacked, each as its own message "
                        "(default 1024)")
    p.add_argument("--no-carve", action="store_true",
                   help="copy new tensors that are one block of an old one instead of making "
                        "them views of it (CPU; for comparison)")
    p.add_argument("--no-baseline", action="store_true", help="skip checkpoint-and-restart")
    p.add_argument("--dump", metavar="DIR", help="write DIR/before.pt and DIR/after.pt")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_bench_switch)
    from dynatrain import bench_chaos

    bench_chaos.register(bsub)


def run_bench_switch(args) -> int:
    from dynatrain.cli import UsageError
    from dynatrain.trainer.config import make_config

    if args.staging_mib < 1:
        raise UsageError(f"--staging-mib={args.staging_mib} must be >= 1")
    if args.direct_kib < 1:
        raise UsageError(f"--direct-kib={args.direct_kib} must be >= 1")
    old_cfg = make_config(args.model, args.old, seq_len=args.seq_len,
                          global_batch_size=args.global_batch_size)
    new_cfg = make_config(args.model, args.new, seq_len=args.seq_len,
                          global_batch_size=args.global_batch_size)
    result = bench_switch(old_cfg, new_cfg, staging_bytes=args.staging_mib << 20,
                          checksums=args.checksums, direct_bytes=args.direct_kib << 10,
                          carve=not args.no_carve,
                          baseline=not args.no_baseline,
                          dump=args.dump, timeout_s=args.timeout,
                          progress=None if args.json else print)
    if args.json:
        print(json.dumps(result))
    else:
        _print_summary(result)
    ok = result["bitwise_equal"] and result["loss_match"] is not False
    return 0 if ok else 1


def _print_summary(r: dict) -> None:
    print(f"switch {r['from']} ({r['ranks_from']} ranks) -> {r['to']} ({r['ranks_to']} ranks), "
          f"{r['model']}")
    print(f"  pause (switch_seconds)     {r['switch_seconds']:.4f} s   "
          f"(transfer {r['transfer_seconds']:.4f} s; prepare {r['prepare_seconds']:.3f} s "
          "overlapped with training)")
    print(f"  transfer floor             {r['floor_seconds']:.4f} s   "
          f"({r['bytes_network'] / 2**20:.1f} MiB on the network, busiest device "
          f"{r['max_rank_bytes'] / 2**20:.1f} MiB at {r['p2p_bytes_per_second'] / 2**30:.2f} GiB/s)")
    print(f"  floor, all devices at once {r['floor_concurrent_seconds']:.4f} s   "
          f"(the same bytes, {(r['bytes_copied'] + r['bytes_carved']) / 2**20:.1f} MiB of "
          "them local, moved by one memcpy and one message per peer)")
    if r["bytes_carved"]:
        print(f"  carved, not copied         {r['bytes_carved'] / 2**20:.1f} MiB   (new tensors "
              "that are views of a block of an old one)")
    if r.get("pause_over_floor") is not None:
        print(f"  pause / floor              {r['pause_over_floor']:.2f}")
    else:
        print("  pause / floor              -   (nothing to move: every new tensor was "
              "adopted in place)")
    if r.get("restart_seconds") is not None:
        print(f"  checkpoint-and-restart     {r['restart_seconds']:.3f} s   "
              f"(speedup {r['speedup']:.1f}x)")
    print(f"  bitwise_equal (vs DCP)     {r['bitwise_equal']}")
    print(f"  loss_match                 {r['loss_match']}   losses after: "
          f"{[round(x, 6) for x in r['losses_after']]}")
    worst = max(zip(r["rss_growth_bytes"], r["rss_growth_bound_bytes"]),
                key=lambda gb: gb[0] / max(gb[1], 1))
    print(f"  peak RSS during switch     {max(r['peak_rss_bytes']) / 2**20:.0f} MiB "
          f"(max over ranks; closest to its bound: growth {worst[0] / 2**20:.1f} MiB of "
          f"{worst[1] / 2**20:.1f} MiB; within bound on every rank: {r['rss_within_bound']})")


def _rss() -> tuple[int, int]:
    """(current, peak) resident set size of this process, in bytes."""
    cur = peak = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return cur, peak


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def _probe_bandwidth(group, group_rank, device: int, nbytes: int = 64 << 20) -> float:
    """Bytes/s from device 0 to device 1 over ``group`` (best of 3); 0 on other devices."""
    import torch

    if device not in (0, 1):
        return 0.0
    buf = torch.ones(nbytes, dtype=torch.uint8)
    best = float("inf")
    for i in range(3):
        t0 = time.perf_counter()
        if device == 0:
            group.send([buf], group_rank[1], 100 + i).wait()
            group.recv([buf[:1]], group_rank[1], 200 + i).wait()
        else:
            group.recv([buf], group_rank[0], 100 + i).wait()
            group.send([buf[:1]], group_rank[0], 200 + i).wait()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _probe_floor(group, group_rank, device: int, copied: int, sends: dict, recvs: dict
                 ) -> list[float]:
    """Seconds this device takes to move its switch's bytes by the simplest means, with every
    device doing the same at the same moment, for each of 3 tries (a barrier before each).

    The same bytes as its part of the switch: ``copied`` bytes by one memcpy, then one message
    per peer (``sends``/``recvs``: peer device -> bytes) straight from and into ready buffers:
    no rounds, no packing, no page faults. On one machine the devices share its cores and
    memory, so a copy or a pair measured alone would overstate what each device gets; the
    floor is the best try's slowest device (:func:`bench_switch`)."""
    import torch
    import torch.distributed as dist

    src = torch.ones(copied, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    out = {d: torch.ones(n, dtype=torch.uint8) for d, n in sorted(sends.items())}
    into = {d: torch.zeros(n, dtype=torch.uint8) for d, n in sorted(recvs.items())}
    tries = []
    for i in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        if copied:
            dst.copy_(src)
        works = [group.send([buf], group_rank[d], 300 + i) for d, buf in out.items()]
        works += [group.recv([buf], group_rank[d], 300 + i) for d, buf in into.items()]
        for w in works:
            w.wait()
        tries.append(time.perf_counter() - t0)
    return tries


def _state_bytes(local_state) -> int:
    return sum(t.numel() * t.element_size() for t, _ in local_state.tensors.values())


def _live_worker(device, world, port, old_cfg, new_cfg, new_layout, engine, ckpt,
                 dump, threads, results, timeout_s, steps):

    import torch
    import torch.distributed as dist

    from dynatrain.trainer.checkpoint import load_state, save_state
    from dynatrain.trainer.groups import build_groups
    from dynatrain.trainer.switch import preallocate, switch
    from dynatrain.trainer.trainer import Trainer, warm_up
    from dynatrain.vps.generations import DeviceManager
    from dynatrain.vps.layout import bind
    from dynatrain.vps.transition import TransitionConfig

    torch.set_num_threads(threads)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("default", store), rank=device,
                            world_size=world, timeout=timeout)
    model = old_cfg.model
    n_old = old_cfg.layout.world
    old_layout = old_cfg.layout.with_devices(range(n_old))
    save_group = dist.new_group(list(range(n_old)))        # DCP needs a registered group
    mgr = DeviceManager(store, device, timeout=timeout)
    holder = []
    if device < n_old:
        groups = build_groups(bind(old_layout, model), device, mgr.group_factory(0, old_layout))
        holder.append(Trainer(old_cfg, groups))
    else:
        warm_up()                                           # a joiner in standby
    new_bound = bind(new_layout, model)
    config = TransitionConfig(**engine, timeout=timeout)
    future = mgr.prepare(1, model, old_layout, new_layout, staging_bytes=config.staging_bytes,
                         build_extra=lambda r: build_groups(new_bound, r,
                                                            mgr.group_factory(1, new_layout)),
                         preallocate=lambda p: preallocate(p, device, config))
    losses_before = [holder[0].train_step().loss for _ in range(steps[0])] if holder else []
    prepared = future.result(timeout=timeout_s)
    bandwidth = _probe_bandwidth(prepared.transition_group, prepared.group_rank, device)

    old_bytes = 0
    save_s = 0.0
    if holder:
        st = holder[0].local_state()
        old_bytes = _state_bytes(st)
        t0 = time.perf_counter()
        save_state(st, model, ckpt, save_group)
        save_s = time.perf_counter() - t0
        if dump:
            _put_state(results, "before", st)
        del st
    # The reference checkpoint just written sits in the page cache as dirty pages; the kernel
    # writing them back during the pause would slow the switch's copies by up to a third.
    os.sync()
    dist.barrier()
    _reset_peak_rss()
    rss_before, _ = _rss()
    dist.barrier()                                          # everyone starts the pause together
    res = switch(holder, prepared, new_cfg, device, config=config)
    _, peak = _rss()
    if res.freeing is not None:
        res.freeing.join()                                  # the probe needs a quiet machine
    sends, recvs = {}, {}
    for msg in (m for msgs in prepared.rounds for m in msgs):
        if msg.src == device:
            sends[msg.dst] = sends.get(msg.dst, 0) + msg.nbytes
        if msg.dst == device:
            recvs[msg.src] = recvs.get(msg.src, 0) + msg.nbytes
    # Carved bytes count as copied: the floor is of the plan's data movement, which carving
    # avoids rather than does faster.
    floor_tries = _probe_floor(prepared.transition_group, prepared.group_rank, device,
                               res.transfer.bytes_local, sends, recvs)
    bitwise, losses_after, new_bytes = True, [], 0
    if res.trainer is not None:
        got = res.trainer.local_state()
        new_bytes = _state_bytes(got)
        ref = load_state(new_bound, prepared.new_rank, ckpt)
        bitwise = (got.step == ref.step and got.data_position == ref.data_position
                   and all(torch.equal(got.tensors[k][0], ref.tensors[k][0]) for k in ref.tensors))
        if dump:
            _put_state(results, "after", got)
        del got, ref
        losses_after = [res.trainer.train_step().loss for _ in range(steps[1])]
    results.put(("device", {
        "device": device, "pause": res.pause_seconds, "transfer": res.transfer.seconds,
        "prepare": prepared.seconds, "save": save_s, "bandwidth": bandwidth,
        "floor_tries": floor_tries,
        "copied": res.transfer.bytes_copied, "adopted": res.transfer.bytes_adopted,
        "preallocated": res.transfer.bytes_preallocated, "carved": res.transfer.bytes_carved,
        "allocated": res.transfer.bytes_allocated,
        "bitwise": bitwise, "losses_before": losses_before, "losses_after": losses_after,
        "rss_before": rss_before, "peak_rss": peak, "old_bytes": old_bytes,
        "new_bytes": new_bytes, "sent": res.transfer.bytes_sent,
        "received": res.transfer.bytes_received, "staging_peak": res.transfer.peak_staging_bytes,
        "rounds": res.transfer.rounds, "phases": res.phases}))
    dist.barrier()
    dist.destroy_process_group()


def _put_state(results, tag, st) -> None:
    import io

    import torch

    from dynatrain.vps.transition import owned

    buf = io.BytesIO()
    torch.save({k: (owned(t.detach().cpu()), p) for k, (t, p) in st.tensors.items()}, buf)
    results.put((tag, buf.getvalue()))


def _restart_worker(rank, world, port, new_cfg, new_layout, ckpt, threads, results, timeout_s,
                    steps):
    import torch
    import torch.distributed as dist

    from dynatrain.trainer.checkpoint import load_state
    from dynatrain.trainer.groups import build_groups
    from dynatrain.trainer.trainer import Trainer
    from dynatrain.vps.layout import bind

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    bound = bind(new_layout, new_cfg.model)
    groups = build_groups(bound, rank)
    state = load_state(bound, rank, ckpt)
    trainer = Trainer(new_cfg, groups, state=state)
    dist.barrier()
    ready = time.time()
    losses = [trainer.train_step().loss for _ in range(steps)]
    results.put(("restart", {"rank": rank, "ready": ready, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()


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


def bench_switch(old_cfg, new_cfg, *, staging_bytes: int = 256 << 20, checksums: bool = False,
                 direct_bytes: int | None = None, carve: bool = True,
                 baseline: bool = True, dump: str | None = None, timeout_s: float = 600.0,
                 steps_before: int = STEPS_BEFORE, steps_after: int = STEPS_AFTER,
                 progress=None) -> dict:

    import torch.distributed as dist
    import torch.multiprocessing as mp

    from dynatrain.trainer.launch import free_port
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
        say(f"live: {world} processes, {old_cfg.layout.to_text()} -> {new_layout.to_text()}")
        store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = mp.start_processes(
            _live_worker, args=(world, store.port, old_cfg, new_cfg, new_layout,
                                dict(staging_bytes=staging_bytes, checksums=checksums,
                                     carve=carve,
                                     **({} if direct_bytes is None
                                        else {"direct_bytes": direct_bytes})),
                                ckpt, dump, threads, results, timeout_s,
                                (steps_before, steps_after)),
            nprocs=world, join=False, start_method="spawn")
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
            # device. See _probe_floor.
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
            results = ctx.Queue()
            started = time.time()
            procs = mp.start_processes(
                _restart_worker, args=(n_new, free_port(), new_cfg, new_layout, ckpt, threads,
                                       results, timeout_s, steps_after),
                nprocs=n_new, join=False, start_method="spawn")
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
    import io

    import torch

    from dynatrain.trainer.state import assemble_full
    from dynatrain.trainer.trainer import LocalState

    os.makedirs(path, exist_ok=True)
    for tag in ("before", "after"):
        states = [LocalState(torch.load(io.BytesIO(m), weights_only=False), 0, 0)
                  for t, m in messages if t == tag]
        full = assemble_full(model, states)
        torch.save({f"{n}/{s}": t for (n, s), t in full.tensors.items()},
                   os.path.join(path, f"{tag}.pt"))

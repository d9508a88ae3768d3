"""What in-memory redundancy costs a training step: time and host memory, measured, not asserted.

One process per rank trains the layout in alternating blocks of steps: plain ``train_step()``,
then with a :class:`~dynatrain.trainer.redundancy.Redundancy` as the agent's worker runs it:
``wait_mirror()`` just before the step's final all-reduce (``train_step(before_report=...)``)
and ``snapshot(local_state())`` after the step, so the mirror exchange overlaps the next step.
Alternating in the same processes keeps machine noise (other jobs, thermal state) from landing
on one side only. Prints one JSON object: median step time without and with, the overhead in
percent, the snapshot's own time, and each rank's held bytes against its state bytes. Run:

    .venv/bin/python benchmarks/redundancy_cost.py --model gpt-tiny --layout dp=2,zero=1 --steps 20

``--snapshot-every K`` snapshots every K-th step, as ``spec.recovery.snapshotEverySteps`` does.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dynatrain.trainer.config import make_config
from dynatrain.trainer.groups import build_groups
from dynatrain.trainer.redundancy import Redundancy
from dynatrain.trainer.trainer import Trainer
from dynatrain.vps.generations import DeviceManager
from dynatrain.vps.layout import bind


def _worker(rank, world, port, cfg, steps, block, per_node, results, watchdog_s, every):
    # A hang (a lost peer, a deadlock) dumps every thread's stack and exits, never stalls.
    faulthandler.dump_traceback_later(watchdog_s, exit=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False,
                          timeout=timedelta(seconds=120))
    mgr = DeviceManager(store, rank, timeout=timedelta(seconds=120))
    lay = cfg.layout.with_devices(range(world))
    bound = bind(lay, cfg.model)
    trainer = Trainer(cfg, build_groups(bound, rank, mgr.group_factory(0, lay)))
    red = Redundancy(bound, rank, mgr.build_group(0, "redundancy", list(range(world))),
                     devices_per_node=per_node)
    state_bytes = sum(t.numel() * t.element_size()
                      for t, _ in trainer.local_state().tensors.values())
    # Warm-up, not timed: first steps pay lazy allocation, first snapshot touches its pages.
    for _ in range(2):
        trainer.train_step()
        red.wait_mirror()
        red.snapshot(trainer.local_state())
    red.wait_mirror()

    plain, mirrored, snap, waits = [], [], [], []
    taken = 0
    while len(plain) < steps or len(mirrored) < steps:
        for _ in range(block):                     # without
            t0 = time.perf_counter()
            trainer.train_step()
            plain.append(time.perf_counter() - t0)
        for _ in range(block):                     # with, as the worker does it
            waited = []

            def before_report():
                t = time.perf_counter()
                red.wait_mirror()
                waited.append(time.perf_counter() - t)

            t0 = time.perf_counter()
            trainer.train_step(before_report=before_report)
            t1 = time.perf_counter()
            if taken % every == 0:                 # spec.recovery.snapshotEverySteps
                red.snapshot(trainer.local_state())
            taken += 1
            t2 = time.perf_counter()
            mirrored.append(t2 - t0)
            waits.append(waited[0])
            snap.append(t2 - t1)
        red.wait_mirror()                          # nothing in flight across a plain block
    results.put({"rank": rank, "plain": plain[:steps], "mirrored": mirrored[:steps],
                 "snapshot": snap[:steps], "wait": waits[:steps], "state_bytes": state_bytes,
                 "memory_bytes": red.memory_bytes(), "unique": len(red.unique),
                 "buddy": red.buddy, "source": red.source})
    red.close()
    results.close()
    results.join_thread()
    os._exit(0)                                    # skip gloo teardown: it only costs time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--layout", default="dp=2,zero=1")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--block", type=int, default=5, help="steps per alternating block")
    parser.add_argument("--seq-len", type=int, default=0, help="0: the config's default")
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--snapshot-every", type=int, default=1,
                        help="snapshot every K steps (spec.recovery.snapshotEverySteps)")
    parser.add_argument("--watchdog", type=float, default=300,
                        help="seconds after which a worker dumps its stacks and exits")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.block < 1 or args.snapshot_every < 1:
        parser.error(f"--steps={args.steps}, --block={args.block} and --snapshot-every="
                     f"{args.snapshot_every} must be positive")
    cfg = make_config(args.model, args.layout, seq_len=args.seq_len,
                      global_batch_size=args.global_batch_size)
    world = cfg.layout.world
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    results = mp.get_context("spawn").Queue()
    t0 = time.perf_counter()
    procs = mp.start_processes(_worker, args=(world, store.port, cfg, args.steps, args.block,
                                              args.devices_per_node, results, args.watchdog,
                                              args.snapshot_every),
                               nprocs=world, join=False, start_method="spawn")
    reports = sorted((results.get(timeout=args.watchdog + 60) for _ in range(world)),
                     key=lambda r: r["rank"])
    for p in procs.processes:
        p.join(timeout=30)

    def ms(xs):
        return round(1e3 * statistics.median(xs), 2)

    plain = [x for r in reports for x in r["plain"]]
    mirrored = [x for r in reports for x in r["mirrored"]]
    out = {
        "model": args.model, "layout": cfg.layout.to_text(), "world": world,
        "steps_per_mode": args.steps, "seq_len": cfg.seq_len,
        "snapshot_every": args.snapshot_every,
        "threads_per_rank": max(1, (os.cpu_count() or 1) // world),
        "step_ms_without": ms(plain), "step_ms_with": ms(mirrored),
        "overhead_percent": round(100 * (statistics.median(mirrored)
                                         / statistics.median(plain) - 1), 2),
        "snapshot_ms": ms([x for r in reports for x in r["snapshot"]]),
        "snapshot_ms_mean": round(1e3 * statistics.mean(
            [x for r in reports for x in r["snapshot"]]), 2),
        # The synchronous part alone, relative to a plain step: less noisy than the overhead
        # when other jobs share the machine (the exchange itself runs on gloo's threads).
        "snapshot_percent_of_step": round(100 * statistics.median(
            [x for r in reports for x in r["snapshot"]]) / statistics.median(plain), 2),
        "wait_mirror_ms": ms([x for r in reports for x in r["wait"]]),
        "ranks": [{"rank": r["rank"], "buddy": r["buddy"], "source": r["source"],
                   "unique_tensors": r["unique"], "state_bytes": r["state_bytes"],
                   "memory_bytes": r["memory_bytes"],
                   "memory_over_state": round(r["memory_bytes"] / r["state_bytes"], 3)}
                  for r in reports],
        "wall_seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What abandonable waits cost a training step: the same processes alternate blocks of steps
with every trainer wait going through ``dynatrain.vps.abandon.wait`` and with the plain
``work.wait()`` (which a failure notice cannot interrupt).

    .venv/bin/python benchmarks/abandon_overhead.py [--layout pp=2] [--blocks 6] [--steps 5]

Prints one JSON object: median step seconds of each kind and the overhead in percent.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _plain(work, timeout=None):
    return work.wait() if timeout is None else work.wait(timeout)


def _worker(rank, world, port, layout, blocks, steps, out):
    from dynatrain.trainer import moe, optim, tp
    from dynatrain.trainer import trainer as trainer_mod
    from dynatrain.trainer.config import make_config
    from dynatrain.trainer.groups import build_groups
    from dynatrain.vps import abandon
    from dynatrain.vps.layout import bind

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    cfg = make_config("gpt-tiny", layout, global_batch_size=8, seq_len=64)
    lay = cfg.layout.with_devices(range(world))

    def make_group(kind, ranks):
        if rank not in ranks:
            return None
        return dist.ProcessGroupGloo(dist.PrefixStore(f"{kind}/{ranks}", store),
                                     ranks.index(rank), len(ranks), timedelta(seconds=60))

    trainer = trainer_mod.Trainer(cfg, build_groups(bind(lay, cfg.model), rank, make_group))
    modules = (trainer_mod, optim, tp, moe)
    trainer.train_step()                                            # warm-up
    times = {"abandonable": [], "plain": []}
    for b in range(blocks * 2):
        kind = "abandonable" if b % 2 == 0 else "plain"
        for m in modules:
            m.wait = abandon.wait if kind == "abandonable" else _plain
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.train_step()
            times[kind].append(time.perf_counter() - t0)
    if rank == 0:
        out.put(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="pp=2")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    from dynatrain.vps.layout import parse_layout

    world = parse_layout(args.layout).world
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args.layout, args.blocks,
                                               args.steps, out)) for r in range(world)]
    for p in procs:
        p.start()
    times = out.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    a, b = statistics.median(times["abandonable"]), statistics.median(times["plain"])
    print(json.dumps({"layout": args.layout, "steps_each": len(times["plain"]),
                      "step_seconds_abandonable": a, "step_seconds_plain": b,
                      "overhead_percent": 100 * (a / b - 1)}))


if __name__ == "__main__":
    main()

"""What the controller's gRPC rendezvous store costs against torch's TCPStore, in one run.

Each generation's groups are built through the job's store (gloo's and NCCL's rendezvous), in
the switch's Prepare, off the pause. This builds the same groups as a generation of a
``dp=2,pp=2`` layout on 4 ranks (the world, two DP pairs, two PP pairs, a transition group)
``--generations`` times over each store and prints the median seconds per generation, side by
side, and their ratio. Both stores are served from this process, as the controller serves its
own; the ranks are worker processes.

    .venv/bin/python benchmarks/rendezvous_store.py [--world 4] [--generations 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from datetime import timedelta

import torch.distributed as dist

from dynatrain.agent.store import RendezvousStore
from dynatrain.controller.rendezvous import RendezvousServer

TIMEOUT = timedelta(seconds=60)


def _groups(world: int) -> list[list[int]]:
    half = world // 2
    dp = [[r, r + half] for r in range(half)]
    pp = [list(range(i * half, (i + 1) * half)) for i in range(2)]
    return [list(range(world))] + dp + pp + [list(range(world))]


def _rank(kind: str, port: int, rank: int, world: int, generations: int, out) -> None:
    if kind == "tcp":
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    else:
        store = RendezvousStore("127.0.0.1", port, timeout=TIMEOUT)
    times, keep = [], []          # a group dropped at once would break its peers' rendezvous
    for g in range(generations):
        t0 = time.perf_counter()
        for i, members in enumerate(_groups(world)):
            if rank in members:
                prefix = dist.PrefixStore(f"gen{g}/group{i}", store)
                keep.append(dist.ProcessGroupGloo(prefix, members.index(rank), len(members),
                                                  TIMEOUT))
        times.append(time.perf_counter() - t0)
    out.put((rank, times))


def measure(kind: str, world: int, generations: int) -> float:
    if kind == "tcp":
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=TIMEOUT)
    else:
        server = RendezvousServer("127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(kind, server.port, r, world, generations, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=300) for _ in range(world))
    for p in procs:
        p.join(30)
    if kind == "grpc":
        server.close()
    # a generation is ready when its slowest rank is; the first includes connecting
    per_gen = [max(results[r][g] for r in range(world)) for g in range(1, generations)]
    return statistics.median(per_gen)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--generations", type=int, default=6)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    tcp = measure("tcp", a.world, a.generations)
    grpc_s = measure("grpc", a.world, a.generations)
    result = {"world": a.world, "groups_per_generation": len(_groups(a.world)),
              "tcpstore_s": round(tcp, 4), "grpc_store_s": round(grpc_s, 4),
              "ratio": round(grpc_s / tcp, 2)}
    if a.json:
        print(json.dumps(result))
        return
    print(f"building a generation's {result['groups_per_generation']} gloo groups on "
          f"{a.world} ranks (median of {a.generations - 1}):")
    print(f"  torch TCPStore          {tcp * 1e3:8.1f} ms")
    print(f"  controller gRPC store   {grpc_s * 1e3:8.1f} ms   ({result['ratio']}x)")


if __name__ == "__main__":
    main()

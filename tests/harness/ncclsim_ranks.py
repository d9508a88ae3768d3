"""One rank of a tests/vps/test_ncclsim.py scenario: ``python ncclsim_ranks.py NAME RANK WORLD PORT``.

Prints one JSON line of results (the test reads the last line); the exit code is part of the
result (the watchdog's abort is a SIGABRT)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dynatrain.vps import ncclsim


def group(rank, world, port, timeout_s=30.0, **kw):
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=30))
    return ncclsim.SimProcessGroup(dist.PrefixStore("g", store), rank, world,
                                   timedelta(seconds=timeout_s), name="test", **kw)


def wait_does_not_block(rank, world, port):
    pg = group(rank, world, port)
    if rank == 1:
        time.sleep(1.0)
    t = torch.full((4,), float(rank + 1))
    t0 = time.monotonic()
    work = dist.all_reduce(t, group=pg, async_op=True)
    work.wait()
    waited = time.monotonic() - t0
    completed = work.is_completed()
    ncclsim.synchronize()
    return {"waited": waited, "completed_after_wait": completed,
            "synced": time.monotonic() - t0, "value": t.tolist()}


def dead_peer(rank, world, port):
    pg = group(rank, world, port, timeout_s=2.0)
    if rank == 1:
        os._exit(0)                         # a peer dies: no error reaches NCCL's ranks
    t = torch.ones(4)
    t0 = time.monotonic()
    dist.all_reduce(t, group=pg, async_op=True).wait()
    try:
        ncclsim.synchronize()
        return {"raised": None}
    except ncclsim.SimNcclError as e:
        return {"raised": str(e), "after": time.monotonic() - t0}


def abort_frees_the_sync(rank, world, port):
    pg = group(rank, world, port, timeout_s=60.0)
    if rank == 1:
        os._exit(0)
    dist.all_reduce(torch.ones(4), group=pg, async_op=True).wait()
    threading.Timer(0.5, pg.abort).start()
    t0 = time.monotonic()
    try:
        ncclsim.synchronize()
    except ncclsim.SimNcclError as e:
        return {"raised": str(e), "after": time.monotonic() - t0}
    return {"raised": None}


def lazy_setup(rank, world, port):
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=30))

    def make(name, eager):
        return ncclsim.SimProcessGroup(dist.PrefixStore(name, store), rank, world,
                                       timedelta(seconds=30), setup_seconds=0.3, eager=eager)

    def allreduce(pg):
        t = time.monotonic()
        dist.all_reduce(torch.ones(2), group=pg, async_op=True).wait()
        return time.monotonic() - t

    lazy = make("lazy", False)
    made_lazy = ncclsim.SETUP["count"]
    first, second = allreduce(lazy), allreduce(lazy)
    after_first = ncclsim.SETUP["count"]
    t = time.monotonic()
    eager = make("eager", True)
    eager_made = time.monotonic() - t
    setups_when_eager_made = ncclsim.SETUP["count"]
    allreduce(eager)
    ncclsim.synchronize()
    return {"setups_when_made": made_lazy, "first": first, "second": second,
            "setups_after_first": after_first, "eager_made": eager_made,
            "setups_when_eager_made": setups_when_eager_made,
            "setups": ncclsim.SETUP["count"], "setup_seconds": ncclsim.SETUP["seconds"]}


def order(rank, world, port, mismatched: bool):
    pg = group(rank, world, port)
    a, b = torch.ones(4), torch.ones(8)
    if rank == 0:
        works = [pg.send([a], 1, 1), pg.send([b], 1, 2)]
    else:
        first, second = ((b, 2), (a, 1)) if mismatched else ((a, 1), (b, 2))
        works = [pg.recv([first[0]], 0, first[1]), pg.recv([second[0]], 0, second[1])]
    try:
        for w in works:
            w.wait()
        ncclsim.synchronize()
    except ncclsim.OrderMismatch as e:
        return {"mismatch": str(e)}
    return {"mismatch": None}


def warm_up_mesh(rank, world, port):
    """Every pair of a 4-rank group warmed up at once, as Prepare does (ops run to the end
    when posted, as the workers' groups do): no deadlock, no order mismatch, and a message
    after it finds its pair made."""
    from dynatrain.vps.generations import warm_up_pairs

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=30))
    pg = ncclsim.SimProcessGroup(dist.PrefixStore("g", store), rank, world,
                                 timedelta(seconds=30), name="test", ordered=True)
    t0 = time.monotonic()
    try:
        warm_up_pairs(pg, [p for p in range(world) if p != rank])
        ncclsim.synchronize()
    except ncclsim.OrderMismatch as e:
        return {"mismatch": str(e)}
    seconds = time.monotonic() - t0
    made = ncclsim.SETUP["count"]
    peer = rank ^ 1
    t = torch.full((2,), float(rank))
    (pg.send([t], peer, 7) if rank < peer else pg.recv([t], peer, 7)).wait()
    ncclsim.synchronize()
    store.set(f"done-{rank}", "1")
    if rank == 0:                           # the store's host leaves last
        store.wait([f"done-{r}" for r in range(world)])
    return {"mismatch": None, "seconds": seconds, "made": made,
            "made_after": ncclsim.SETUP["count"], "got": t.tolist()}


SCENARIOS = {
    "warm_up_mesh": warm_up_mesh,
    "wait_does_not_block": wait_does_not_block,
    "dead_peer": dead_peer,
    "abort_frees_the_sync": abort_frees_the_sync,
    "lazy_setup": lazy_setup,
    "order_matched": lambda r, w, p: order(r, w, p, False),
    "order_mismatched": lambda r, w, p: order(r, w, p, True),
}

if __name__ == "__main__":
    name, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    out = SCENARIOS[name](rank, world, port)
    print(json.dumps(out), flush=True)
    os._exit(0)      # not through the group's teardown (a dead peer's gloo pair may linger)

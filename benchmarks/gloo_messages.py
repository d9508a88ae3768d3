"""What one gloo message per region costs against one message per peer: the remaining gap
between a network switch's pause and the machine floor (README "Live switches").

The machine floor (``dynatrain/bench/switch.py``) moves a device's bytes to each peer as one
message. The engine sends one message per region of at least 1 MiB, straight from the old
tensor into the new one (no packing copy), because every (tensor, state) is an allocation of
its own: ``dp=2 -> dp=4`` of gpt-125m is about 520 messages of 2.7 MiB per peer. This script
isolates that difference: two sender/receiver pairs (4 processes, as in the switch) move the
same bytes at once, as one message, and as N equal messages posted together, in alternating
order, and print the slowest rank's median per mode. Run:

    .venv/bin/python benchmarks/gloo_messages.py [--mib 1425] [--messages 1,24,523] [--trials 6]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, port: int, nbytes: int, counts: list[int], trials: int, window: int,
            out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4)
    sender = rank < 2
    peer = rank + 2 if sender else rank - 2
    buf = (torch.ones if sender else torch.zeros)(nbytes, dtype=torch.uint8)
    times: dict[int, list[float]] = {n: [] for n in counts}
    tag = 0
    for trial in range(trials):
        # Alternate the order so that drift in the machine's speed hits every mode alike.
        for n in (counts if trial % 2 == 0 else counts[::-1]):
            chunks = list(buf.tensor_split(n))
            dist.barrier()
            t0 = time.perf_counter()
            op = dist.isend if sender else dist.irecv
            works = []
            for c in chunks:
                works.append(op(c, peer, tag=tag))
                tag += 1
                if window and len(works) >= window:
                    works.pop(0).wait()
            for w in works:
                w.wait()
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times[n].append(took.item())
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=1425.0,
                        help="bytes each sender moves, in MiB (default 1425: a gpt-125m "
                        "replica's state, as in dp=2 -> dp=4)")
    parser.add_argument("--messages", default="1,24,523",
                        help="message counts to compare, comma-separated (default 1,24,523)")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--window", type=int, default=0,
                        help="messages in flight per pair at most (default 0: all posted at "
                        "once, as the engine does)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        counts = [int(x) for x in args.messages.split(",")]
    except ValueError:
        parser.error(f"--messages={args.messages!r} is not a comma-separated list of integers")
    if not counts or min(counts) < 1:
        parser.error(f"--messages={args.messages!r}: every count must be >= 1")
    if args.trials < 1 or args.mib <= 0:
        parser.error("--trials must be >= 1 and --mib > 0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    nbytes = int(args.mib * 2**20)
    mp.start_processes(_worker, args=(port, nbytes, counts, args.trials, args.window, q), nprocs=4,
                       start_method="spawn")
    times = q.get()
    base = statistics.median(times[counts[0]])
    rows = [{"messages": n, "message_mib": round(args.mib / n, 2),
             "median_seconds": round(statistics.median(v), 4),
             "over_first": round(statistics.median(v) / base, 3),
             "seconds": [round(x, 4) for x in v]} for n, v in times.items()]
    if args.json:
        print(json.dumps({"mib": args.mib, "trials": args.trials, "rows": rows}))
        return 0
    print(f"two pairs at once, {args.mib:.0f} MiB per sender, slowest rank, median of "
          f"{args.trials}:")
    for r in rows:
        print(f"  {r['messages']:>5} message(s) of {r['message_mib']:>8.2f} MiB   "
              f"{r['median_seconds']:.3f} s   ({r['over_first']:.2f}x the first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

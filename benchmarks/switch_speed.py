"""Live switch vs checkpoint-and-restart on gpt-125m with 4 CPU ranks (the issue's three cases).

For each transition: the pause (``switch_seconds``), the network floor (busiest device's network
bytes / point-to-point bandwidth measured in the same run), the floor including local copies
(local bytes / memcpy bandwidth, measured in the same run), checkpoint-and-restart with
PyTorch Distributed Checkpoint (``restart_seconds``), their ratio, the bit-exactness checks and
the memory growth during the switch. Run:

    .venv/bin/python benchmarks/switch_speed.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from dynatrain.bench_switch import bench_switch
from dynatrain.trainer.config import make_config

CASES = [("dp=2,tp=2", "pp=2,tp=2"), ("dp=4", "tp=4"), ("dp=4", "dp=2")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-125m")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for old, new in CASES:
        kw = dict(seq_len=args.seq_len, global_batch_size=8)
        r = bench_switch(make_config(args.model, old, **kw), make_config(args.model, new, **kw),
                         steps_before=1, steps_after=1, timeout_s=1500)
        rows.append(r)
        if not args.json:
            print(f"{old:>12} -> {new:<12} pause {r['switch_seconds']:.3f} s  "
                  f"network floor {r['floor_seconds']:.3f} s  floor+copies "
                  f"{r['floor_with_copies_seconds']:.3f} s  restart {r['restart_seconds']:.2f} s"
                  f"  speedup {r['speedup']:.0f}x  bitwise {r['bitwise_equal']}  loss_match "
                  f"{r['loss_match']}  net {r['bytes_network'] / 2**20:.0f} MiB  local "
                  f"{r['bytes_local'] / 2**20:.0f} MiB  rss growth max "
                  f"{max(r['rss_growth_bytes']) / 2**20:.0f} MiB (bound "
                  f"{min(r['rss_growth_bound_bytes']) / 2**20:.0f})", flush=True)
    if args.json:
        print(json.dumps({"model": args.model, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Live switch vs checkpoint-and-restart on gpt-125m with 4 CPU ranks.

The issue's three cases (``dp=2,tp=2 -> pp=2,tp=2``, ``dp=4 -> tp=4``, 4 -> 2 ranks), whose
placement keeps every new shard on its device (no network bytes), and two that must use the
network: a scale-up whose joiners hold nothing, and a 4 -> 2 switch whose survivors need the
stages they did not hold. For each: the pause (``switch_seconds``); the issue's floor
(``floor_seconds``: the busiest device's network bytes at the bandwidth of one pair measured
alone); the floor of this machine (``floor_concurrent_seconds``: every device moving the same
bytes, local and network, by one memcpy and one message per peer, all at once, as they share
its cores; bytes that the engine carves rather than copies count as moved); the pause over
the larger of the two; checkpoint-and-restart with PyTorch
Distributed Checkpoint (``restart_seconds``) and the speedup; the bit-exactness checks; the
memory growth during the switch against the issue's bound; and the geometric mean of the
speedup over checkpoint-and-restart across the cases (``speedup_geomean``). Run:

    .venv/bin/python benchmarks/switch_speed.py [--json] [--no-baseline]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from dynatrain.bench.switch import bench_switch
from dynatrain.trainer.config import make_config

CASES = [("dp=2,tp=2", "pp=2,tp=2"), ("dp=4", "tp=4"), ("dp=4", "dp=2"),
         ("dp=2", "dp=4"), ("pp=4", "dp=2")]


def speedup_geomean(rows: list[dict]) -> float | None:
    """The geometric mean of the rows' speedups over checkpoint-and-restart (None without the
    baseline): the mean that a single outlier case cannot dominate."""
    speedups = [r["speedup"] for r in rows]
    if not speedups or any(s is None or s <= 0 for s in speedups):
        return None
    return math.exp(sum(math.log(s) for s in speedups) / len(speedups))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-125m")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-baseline", action="store_true", help="skip checkpoint-and-restart")
    args = parser.parse_args(argv)
    rows = []
    for old, new in CASES:
        kw = dict(seq_len=args.seq_len, global_batch_size=8)
        r = bench_switch(make_config(args.model, old, **kw), make_config(args.model, new, **kw),
                         steps_before=1, steps_after=1, timeout_s=1500,
                         baseline=not args.no_baseline)
        rows.append(r)
        if not args.json:
            ratio = ("-" if r["pause_over_floor"] is None
                     else f"{r['pause_over_floor']:.2f}")
            restart = ("" if r["restart_seconds"] is None else
                       f"  restart {r['restart_seconds']:.2f} s  speedup {r['speedup']:.0f}x"
                       f"  loss_match {r['loss_match']}")
            print(f"{old:>10} -> {new:<10} pause {r['switch_seconds']:.3f} s  floor "
                  f"{r['floor_seconds']:.3f} s  machine floor "
                  f"{r['floor_concurrent_seconds']:.3f} s  pause/floor {ratio}{restart}"
                  f"  bitwise {r['bitwise_equal']}  net {r['bytes_network'] / 2**20:.0f} MiB"
                  f"  copied {r['bytes_copied'] / 2**20:.0f} MiB  carved "
                  f"{r['bytes_carved'] / 2**20:.0f} MiB  adopted "
                  f"{r['bytes_adopted'] / 2**20:.0f} MiB  rss growth/bound worst "
                  f"{max(g / b for g, b in zip(r['rss_growth_bytes'], r['rss_growth_bound_bytes'])):.2f}",
                  flush=True)
    geomean = speedup_geomean(rows)
    if args.json:
        print(json.dumps({"model": args.model, "rows": rows, "speedup_geomean": geomean}))
    elif geomean is not None:
        print(f"speedup over checkpoint-and-restart, geometric mean of {len(rows)} cases: "
              f"{geomean:.0f}x", flush=True)
    # Timings are figures; a state that is not bit-exact, or losses that differ from the
    # restart's, are errors.
    bad = [f"{r['from']} -> {r['to']}" for r in rows
           if not r["bitwise_equal"] or r["loss_match"] is False]
    if bad:
        print(f"not bit-exact or losses differ: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

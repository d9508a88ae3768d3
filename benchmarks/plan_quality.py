"""Plan quality: busiest device's traffic and modelled pause against their provable lower bounds.

Prints one row per transition (dense and MoE; scale up and down; TP/PP/EP/ZeRO changes; uneven
stages; node loss) and the worst ratios: busiest device's bytes / byte bound, and modelled
pause / time bound on H100 nodes (8 GPUs, NVLink 3600 Gb/s, one 400 Gb/s NIC per GPU;
vps/timemodel.py). Target: every ratio <= 1.10. Run:

    .venv/bin/python benchmarks/plan_quality.py [--json]

The figures are byte counts, not timings, so they are exact and repeatable; tests/test_plan_
quality.py asserts the target on the same suite.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from dynatrain.vps.layout import parse_layout
from dynatrain.vps.presets import load_model
from dynatrain.vps.placement import place_devices
from dynatrain.vps.planner import plan_switch
from dynatrain.vps.stats import plan_stats

TARGET = 1.10


def _without(n: int, lost: range) -> list[int]:
    return [d for d in range(n) if d not in lost]


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    old: str
    new: str
    to_devices: tuple[int, ...] | None = None


SUITE = [
    Case("scale up 2x (DP)", "llama-7b", "tp=8,dp=1", "tp=8,dp=2"),
    Case("scale down 2x (DP)", "llama-7b", "tp=4,dp=4,zero=1", "tp=4,dp=2,zero=1"),
    Case("DP -> TP", "gpt-125m", "dp=8,zero=1", "tp=2,dp=4,zero=1"),
    Case("TP 4 -> 8", "llama-7b", "tp=4,pp=2,dp=4,zero=1", "tp=8,pp=2,dp=2,zero=1"),
    Case("PP -> DP", "llama-7b", "tp=2,pp=4,dp=2", "tp=2,pp=2,dp=4"),
    Case("ZeRO-3 -> TP x PP", "gpt-350m", "dp=8,zero=3", "tp=4,pp=2"),
    Case("TP x PP -> ZeRO-3", "gpt-350m", "tp=2,pp=2,dp=2", "dp=8,zero=3"),
    Case("uneven stages rebalance", "llama-13b", "tp=8,pp=4,stages=10+10+10+10",
         "tp=8,pp=4,stages=13+10+9+8"),
    Case("pp 2 -> 3, uneven", "llama-13b", "tp=8,pp=2,dp=2,zero=1", "tp=8,pp=3,zero=1"),
    Case("ZeRO-1 off", "llama-70b", "tp=8,pp=4,dp=4,zero=1", "tp=8,pp=4,dp=4"),
    Case("ZeRO-1 on, scale up", "llama-70b", "tp=8,pp=8,dp=2", "tp=8,pp=8,dp=4,zero=1"),
    Case("pp 10 -> 8 (lose 64 GPUs)", "llama-70b", "tp=8,pp=10,dp=4,zero=1",
         "tp=8,pp=8,dp=4,zero=1"),
    Case("node loss, re-layout", "llama-70b", "tp=8,pp=4,dp=4,zero=1", "tp=8,pp=5,dp=3,zero=1",
         tuple(_without(128, range(40, 48)))),
    Case("node loss, DP shrink", "llama-7b", "tp=4,dp=4,zero=1", "tp=4,dp=2,zero=1",
         tuple(range(8, 16))),
    Case("MoE scale down 2x", "mixtral-8x7b", "tp=2,pp=4,dp=8,ep=8,zero=1",
         "tp=2,pp=4,dp=4,ep=4,zero=1"),
    Case("MoE EP 8 -> 4", "mixtral-8x7b", "tp=4,dp=8,ep=8", "tp=4,dp=8,ep=4"),
    Case("MoE scale up 2x", "mixtral-8x7b", "tp=4,pp=2,dp=4,ep=4", "tp=4,pp=2,dp=8,ep=8"),
    Case("MoE EP -> TP", "moe-tiny", "dp=4,ep=4,zero=1", "tp=2,dp=2,ep=2"),
    Case("Qwen3 1024 -> 896 (pp 8 -> 7)", "qwen3-235b-a22b", "tp=4,pp=8,dp=32,ep=32,zero=1",
         "tp=4,pp=7,dp=32,ep=32,zero=1"),
    Case("Qwen3 512 -> 1024", "qwen3-235b-a22b", "tp=4,pp=8,dp=16,ep=16,zero=1",
         "tp=4,pp=8,dp=32,ep=32,zero=1"),
    Case("Qwen3 lose 4 nodes", "qwen3-235b-a22b", "tp=4,pp=8,dp=8,ep=8,zero=1",
         "tp=4,pp=7,dp=8,ep=8,zero=1", tuple(range(32, 256))),
    Case("tiny dense everything changes", "gpt-tiny", "tp=2,pp=2,dp=2,zero=1",
         "tp=4,pp=1,dp=2,zero=3"),
]


def run_case(case: Case) -> dict:
    model = load_model(case.model)
    old = parse_layout(case.old).with_devices(range(parse_layout(case.old).world))
    new = parse_layout(case.new)
    new = place_devices(model, old, new, case.to_devices or range(new.world))
    stats = plan_stats(plan_switch(model, old, new))
    return {"case": case.name, "model": case.model, "from": case.old, "to": case.new,
            "ranks_from": stats.ranks_from, "ranks_to": stats.ranks_to,
            "bytes_network": stats.bytes_network, "max_rank_bytes": stats.max_rank_bytes,
            "lower_bound_max_rank_bytes": stats.lower_bound_max_rank_bytes,
            "ratio": round(stats.ratio_to_bound, 4),
            "modelled_seconds": round(stats.modelled_seconds, 4),
            "lower_bound_seconds": round(stats.lower_bound_seconds, 4),
            "time_ratio": round(stats.time_ratio_to_bound, 4),
            "plan_seconds": stats.plan_seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    rows = [run_case(c) for c in SUITE]
    worst = max(r["ratio"] for r in rows)
    worst_time = max(r["time_ratio"] for r in rows)
    if args.json:
        print(json.dumps({"cases": rows, "worst_ratio": worst, "worst_time_ratio": worst_time,
                          "target": TARGET}))
    else:
        gib = 1024 ** 3
        print(f"{'transition':<32}{'model':<17}{'ranks':>11}{'network GiB':>13}"
              f"{'busiest GiB':>13}{'bound GiB':>11}{'ratio':>7}{'model s':>9}{'bound s':>9}"
              f"{'ratio':>7}{'plan s':>8}")
        for r in rows:
            print(f"{r['case']:<32}{r['model']:<17}{r['ranks_from']:>5} -> {r['ranks_to']:<4}"
                  f"{r['bytes_network'] / gib:>13.2f}{r['max_rank_bytes'] / gib:>13.3f}"
                  f"{r['lower_bound_max_rank_bytes'] / gib:>11.3f}{r['ratio']:>7.3f}"
                  f"{r['modelled_seconds']:>9.3f}{r['lower_bound_seconds']:>9.3f}"
                  f"{r['time_ratio']:>7.3f}{r['plan_seconds']:>8.2f}")
        print(f"\n{len(rows)} transitions; worst busiest/bound = {worst:.3f}, worst modelled/"
              f"bound = {worst_time:.3f} (target <= {TARGET:.2f})")
    return 0 if worst <= TARGET and worst_time <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())

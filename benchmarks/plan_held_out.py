"""Plan quality on random held-out switches: modelled pause and busiest device's bytes against
their lower bounds, outside the fixed suite of plan_quality.py.

Draws ``--examples`` switches from the property test's strategy (tests/harness/strategies.py,
``held_out_transitions``: 16-512 devices on nodes of 8; growth, shrink, and lost devices with
mirrors on buddies; Llama-2 7B/70B, Mixtral 8x7B and Qwen3-235B-A22B shapes with their depth
cut), deterministically, plans each on H100 links (vps/timemodel.py) and prints the worst
ratios per kind of switch. Target: both <= 1.10, or, where the two bounds provably cannot both
be met (joint bound > 1, vps/timemodel.py ``lower_bound_ratio``), both <= 1.10 x the joint
bound. ``--verify`` also checks every plan element by element (slow for the larger ones). Run:

    .venv/bin/python benchmarks/plan_held_out.py [--examples 100] [--layers 16] [--max-dp 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness.strategies import held_out_transitions  # noqa: E402

from dynatrain.vps.planner import plan_switch  # noqa: E402
from dynatrain.vps.stats import plan_stats  # noqa: E402
from dynatrain.vps.verify import verify_plan  # noqa: E402

TARGET = 1.10


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--layers", type=int, default=16, help="depth of the shapes (16)")
    parser.add_argument("--max-dp", type=int, default=64)
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = []

    @settings(max_examples=args.examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(held_out_transitions(args.layers, args.max_dp))
    def one(case):
        kind, model, old, new, dead, proxies = case
        plan = plan_switch(model, old, new, dead=dead, proxies=proxies)
        if args.verify:
            verify_plan(plan, dead, proxies)
        s = plan_stats(plan)
        rows.append({"kind": kind, "model": model.name, "from": old.to_text(),
                     "to": new.to_text(), "ranks_from": old.world, "ranks_to": new.world,
                     "dead": sorted(dead), "proxies": {str(k): v for k, v in proxies.items()},
                     "joint_bound": round(s.lower_bound_joint_ratio, 4),
                     "time_ratio": round(s.time_ratio_to_bound, 4),
                     "bytes_ratio": round(s.ratio_to_bound, 4),
                     "over_joint": round(max(s.time_ratio_to_bound, s.ratio_to_bound)
                                         / s.lower_bound_joint_ratio, 4)})

    one()
    worst_t = max(r["time_ratio"] for r in rows)
    worst_b = max(r["bytes_ratio"] for r in rows)
    worst_j = max(r["over_joint"] for r in rows)
    if args.json:
        print(json.dumps({"examples": rows, "worst_time_ratio": worst_t,
                          "worst_bytes_ratio": worst_b, "worst_over_joint_bound": worst_j,
                          "target": TARGET}))
    else:
        for kind in sorted({r["kind"] for r in rows}):
            rs = [r for r in rows if r["kind"] == kind]
            free = [r for r in rs if r["joint_bound"] <= 1.0]
            print(f"{kind:<7} {len(rs):>4} switches   worst modelled/bound "
                  f"{max(r['time_ratio'] for r in rs):.3f}   worst busiest/bound "
                  f"{max(r['bytes_ratio'] for r in rs):.3f}   (where both bounds can hold: "
                  f"{max((max(r['time_ratio'], r['bytes_ratio']) for r in free), default=1):.3f}"
                  f"; {len(rs) - len(free)} with joint bound > 1, worst max/joint "
                  f"{max(r['over_joint'] for r in rs):.3f})")
        top = max(rows, key=lambda r: r["over_joint"])
        print(f"\n{len(rows)} switches; worst modelled/bound = {worst_t:.3f}, worst busiest/"
              f"bound = {worst_b:.3f}, worst max of both / joint bound = {worst_j:.3f} (target "
              f"<= {TARGET:.2f}); hardest: {top['model']} {top['from']} -> {top['to']} "
              f"({top['ranks_from']} -> {top['ranks_to']} devices, {top['kind']})")
    return 0 if worst_j <= TARGET else 1

if __name__ == "__main__":
    sys.exit(main())

"""Giving workers back (``spec.elastic.minEfficiency``): a job on more workers than pay off,
its throughput before and after the live release, per worker and in total, side by side with
the bound the threshold sets.

One ``dynatrain run`` of the quickstart job (gpt-tiny) on 4 CPU workers with the cost model of
workers that share this machine's cores (``--device-profile shared``); at ``--at`` steps a
scenario event sets ``minEfficiency`` (as ``kubectl edit`` would), the policy releases the
workers that add less than that fraction of a worker's throughput, and the run goes on with
the others. Both figures are the run's own measurements (:mod:`dynatrain.controller.measured`:
smoothed, the slowest device's step) of the layout before the release and the last one.

The threshold's promise: a released worker added less than F of a worker's throughput, so
releasing k of n workers should cost at most about ``F * k / n`` of the total (by the cost
model that decided; the measured change is printed next to it). A figure, not a verdict (this machine is
shared): run it on an otherwise idle machine.

    .venv/bin/python benchmarks/efficiency.py --min-efficiency 0.5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from dynatrain.vps.layout import parse_layout

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--min-efficiency", type=float, default=0.5, metavar="F",
                    help="the spec.elastic.minEfficiency set mid-run (default %(default)s)")
    ap.add_argument("--workers", type=int, default=4, help="workers at the start (default 4)")
    ap.add_argument("--at", type=int, default=12, help="step of the setting (default 12)")
    ap.add_argument("--steps", type=int, default=60, help="steps in all (default 60)")
    args = ap.parse_args(argv)
    if not 0 < args.min_efficiency <= 1:
        ap.error(f"--min-efficiency {args.min_efficiency} must be in (0, 1]")
    if not 0 < args.at < args.steps - 10:
        ap.error(f"--at {args.at} must leave at least 10 of the {args.steps} steps after it")
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["training"]["steps"] = args.steps
    doc["spec"]["elastic"]["maxWorkers"] = max(args.workers, doc["spec"]["elastic"]["maxWorkers"])
    tokens = doc["spec"]["globalBatchSize"] * doc["spec"]["training"]["seqLen"]
    with tempfile.TemporaryDirectory(prefix="dynatrain-efficiency-") as tmp:
        work = Path(tmp)
        (work / "job.yaml").write_text(yaml.safe_dump(doc))
        (work / "scenario.yaml").write_text(yaml.safe_dump({
            "initialWorkers": args.workers,
            "events": [{"atStep": args.at, "minEfficiency": args.min_efficiency}]}))
        summary = work / "summary.json"
        print(f"dynatrain run: gpt-tiny on {args.workers} CPU workers, minEfficiency "
              f"{args.min_efficiency:g} at step {args.at} of {args.steps} ...", flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", "dynatrain", "run", str(work / "job.yaml"), "--scenario",
             str(work / "scenario.yaml"), "--run-dir", str(work / "run"), "--summary-json",
             str(summary), "--device-profile", "shared"],
            capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            sys.exit(f"dynatrain run exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                     f"{proc.stderr[-3000:]}")
        out = json.loads(summary.read_text())
    released = [s for s in out["switches"] if s["reason"] == "release"]
    if not released:
        sys.exit("no worker was released: the cost model says every worker pays at this "
                 "threshold; try a higher --min-efficiency")
    note = next((line for line in proc.stdout.splitlines() if "release: keeps" in line), "")
    before, after = out["measurements"][0], out["measurements"][-1]
    rows = []
    for name, m in (("before the release", before), ("after it", after)):
        n = parse_layout(m["layout"]).world
        total = tokens / m["step_seconds"]
        rows.append((name, m["layout"], n, total, total / n))
    n0, n1 = rows[0][2], rows[1][2]
    bound = args.min_efficiency * (n0 - n1) / n0
    drop = 1 - rows[1][3] / rows[0][3]
    print(f"\n{note.strip()}\n")
    print(f"{'':20} {'layout':18} {'workers':>7} {'tok/s':>9} {'tok/s per worker':>17}")
    for name, layout, n, total, per in rows:
        print(f"{name:20} {layout:18} {n:>7} {total:>9,.0f} {per:>17,.0f}")
    print(f"\nper worker: x{rows[1][4] / rows[0][4]:.2f}; total: {-drop:+.1%} "
          f"(the threshold allows a drop of up to {bound:.1%}: minEfficiency "
          f"{args.min_efficiency:g} x {n0 - n1} of {n0} workers released)")
    print(f"data read exactly once: {out['samples_exactly_once']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

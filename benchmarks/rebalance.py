"""A pipeline with one slowed worker: its step time before the live rebalance, after it, and
with every split of its layers tried as a fixed layout, side by side.

Every run is ``dynatrain run`` of one small job on 2 CPU workers whose only layout is
``dp=1,tp=1,pp=2`` (a global batch of 1, ``maxTP: 1``), with device 1 computing ``--factor``
times slower (``DYNATRAIN_SLOWDOWN``, the straggler a test can make). The step time is each
run's measured one (:mod:`dynatrain.controller.measured`: smoothed, its slowest device's):

- ``even``: the solver's even split, as the rebalancing run measured it before it acted;
- ``rebalanced``: the split the controller switched to live (reason ``rebalance``), measured
  after the switch;
- ``stages=a+b``: each split of the model's layers between the two stages, run from the start
  with that fixed layout: the best of them is what trying them all finds.

A figure, not a verdict (this machine is shared): run it on an otherwise idle machine.

    .venv/bin/python benchmarks/rebalance.py --factor 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from dynatrain.vps.presets import PRESETS


def job(model: str, steps: int, parallelism: dict) -> dict:
    return {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": "rebalance"},
            "spec": {"model": {"preset": model}, "resources": {"gpus": 0},
                     "elastic": {"minWorkers": 2, "maxWorkers": 2},
                     "parallelism": parallelism, "globalBatchSize": 1,
                     "training": {"steps": steps, "seqLen": 64}}}


def run(work: Path, name: str, doc: dict, factor: float, device: int = 1) -> dict:
    """One ``dynatrain run`` with ``device`` computing ``factor`` times slower; its summary."""
    manifest = work / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    summary = work / f"{name}.json"
    env = {**os.environ, "DYNATRAIN_SLOWDOWN": f"device:{device},factor:{factor}"}
    proc = subprocess.run([sys.executable, "-m", "dynatrain", "run", str(manifest),
                           "--run-dir", str(work / name), "--summary-json", str(summary)],
                          capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"{name}: dynatrain run exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-3000:]}")
    return json.loads(summary.read_text())


def try_splits(shape: str, layers: int, run_fixed, rows: list) -> tuple[str, float]:
    """Every split of ``layers`` between the two stages of ``shape``, tried by
    :func:`try_layouts`."""
    return try_layouts([f"{shape},stages={first}+{layers - first}" for first in range(1, layers)],
                       run_fixed, rows, "splits")


def try_layouts(layouts: list[str], run_fixed, rows: list, what: str) -> tuple[str, float]:
    """Each of ``layouts`` run as a fixed layout by ``run_fixed(name, layout)`` (-> its
    summary); each printed as it comes, the best added to ``rows`` (as the best of all
    ``what``). Returns the best (layout, step seconds)."""
    tried = []
    for n, layout in enumerate(layouts, 1):
        out = run_fixed(f"fixed-{n}", layout)
        tried.append((layout, out["measurements"][-1]["step_seconds"]))
        print(f"  tried {layout}: {tried[-1][1] * 1e3:.1f} ms/step", flush=True)
    best = min(tried, key=lambda t: t[1])
    rows.append((f"best of all {len(tried)} {what}: {best[0]}", best[1]))
    return best


def live_rows(live: dict, verb: str) -> tuple[list, str | None]:
    """The live run's rows (its step before its last ``rebalance`` switch, and after it, in
    ``verb``'s words) and the layout it switched to (None if it did not)."""
    switches = [s for s in live["switches"] if s["reason"] == "rebalance"]
    by_layout = {m["layout"]: m for m in live["measurements"]}
    rows = [(f"even (before the {verb})", live["measurements"][0]["step_seconds"])]
    if not switches:
        rows.append((f"{verb}d live: no rebalance happened", float("nan")))
        return rows, None
    chosen = switches[-1]["to"]
    rows.append((f"{verb}d live at step {switches[-1]['step']} to {chosen}",
                 by_layout[chosen]["step_seconds"]))
    return rows, chosen


def print_rows(rows: list, chosen: str | None = None, best: tuple | None = None,
               verb: str = "rebalance", what: str = "split") -> None:
    """(label, step seconds) rows as a table, then whether the live run (its ``verb``) chose
    the best ``what`` that trying them all found."""
    print()
    width = max(len(r[0]) for r in rows)
    for label, seconds in rows:
        print(f"  {label:<{width}}  {seconds * 1e3:8.1f} ms/step")
    if chosen is not None and best is not None:
        print(f"\nthe live {verb} chose {chosen}; trying every {what} found {best[0]} "
              f"({'the same' if chosen == best[0] else 'another'})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-tiny", choices=sorted(PRESETS),
                    help="the model preset (default gpt-tiny: 4 layers, 3 splits)")
    ap.add_argument("--factor", type=float, default=3.0,
                    help="how many times slower device 1 computes (default 3)")
    ap.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    args = ap.parse_args(argv)
    if args.factor < 1:
        ap.error(f"--factor {args.factor} must be >= 1")
    layers = PRESETS[args.model].num_layers
    work = Path(tempfile.mkdtemp(prefix="rebalance-"))
    print(f"{args.model} ({layers} layers) on 2 CPU workers, dp=1,tp=1,pp=2, device 1 "
          f"{args.factor:g}x slower; {args.steps} steps per run; runs in {work}", flush=True)

    live = run(work, "live", job(args.model, args.steps, {
        "mode": "auto", "limits": {"maxTP": 1}, "rebalance": {"enabled": True}}), args.factor)
    rows, chosen = live_rows(live, "rebalance")

    best = try_splits("dp=1,tp=1,pp=2", layers, lambda name, layout: run(
        work, name, job(args.model, args.steps, {"mode": "fixed", "layout": layout}),
        args.factor), rows)
    print_rows(rows, chosen, best)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Data parallelism with one slowed worker: its step time before the live reshare, after it,
and with every share the slow rank could keep (the others' dealt evenly) tried as a fixed
layout, and the job without it, side by side.

Every run is ``dynatrain run`` of gpt-tiny on 4 CPU workers, data parallel only (``maxTP: 1,
maxPP: 1``), a global batch of ``--batch`` micro-batches of one sequence, with device 3
computing ``--factor`` times slower (``DYNATRAIN_SLOWDOWN``). The step time is each run's
measured one (:mod:`dynatrain.controller.measured`: smoothed, its slowest device's):

- ``even``: the solver's ``dp=4`` with even shares, as the live run measured it before it acted;
- ``reshared``: the shares the controller switched to live (reason ``rebalance``,
  :mod:`dynatrain.controller.straggler`), measured after the switch;
- ``shares=a+b+c+k``: device 3 keeping ``k`` micro-batches, the others dealt the rest as
  evenly as they go, each run from the start as a fixed layout;
- ``dp=3``: the job without device 3 (when 3 divides the batch): what leaving it out gives.

A figure, not a verdict (this machine is shared): run it on an otherwise idle machine.

    .venv/bin/python benchmarks/shares.py --factor 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rebalance import live_rows, print_rows, run, try_layouts  # noqa: E402  (the sibling benchmark)

SLOW = 3


def job(steps: int, batch: int, workers: int, parallelism: dict) -> dict:
    return {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": "shares"},
            "spec": {"model": {"preset": "gpt-tiny"}, "resources": {"gpus": 0},
                     "elastic": {"minWorkers": 1, "maxWorkers": workers},
                     "parallelism": parallelism, "globalBatchSize": batch,
                     "training": {"steps": steps, "seqLen": 64}}}


def dealt(batch: int, keep: int) -> str:
    """``shares=...`` with rank 3 keeping ``keep`` and ranks 0-2 the rest, as even as it goes."""
    rest = batch - keep
    others = [rest // 3 + (1 if j < rest % 3 else 0) for j in range(3)]
    return "+".join(map(str, [*others, keep]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--factor", type=float, default=2.0,
                    help="how many times slower device 3 computes (default 2)")
    ap.add_argument("--batch", type=int, default=24,
                    help="global batch in sequences, a multiple of 4 (default 24)")
    ap.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    args = ap.parse_args(argv)
    if args.factor < 1:
        ap.error(f"--factor {args.factor} must be >= 1")
    if args.batch < 8 or args.batch % 4:
        ap.error(f"--batch {args.batch} must be a multiple of 4, at least 8")
    work = Path(tempfile.mkdtemp(prefix="shares-"))
    print(f"gpt-tiny on 4 CPU workers, dp=4, a global batch of {args.batch}, device {SLOW} "
          f"{args.factor:g}x slower; {args.steps} steps per run; runs in {work}", flush=True)

    def once(name: str, doc: dict) -> dict:
        return run(work, name, doc, args.factor, device=SLOW)

    live = once("live", job(args.steps, args.batch, 4, {
        "mode": "auto", "limits": {"maxTP": 1, "maxPP": 1}, "rebalance": {"enabled": True}}))
    rows, chosen = live_rows(live, "reshare")

    best = try_layouts([f"dp=4,tp=1,pp=1,shares={dealt(args.batch, keep)}"
                        for keep in range(1, args.batch // 4)],
                       lambda name, layout: once(name, job(args.steps, args.batch, 4, {
                           "mode": "fixed", "layout": layout})), rows, "uneven shares")
    if args.batch % 3 == 0:
        out = once("without", job(args.steps, args.batch, 3,
                                  {"mode": "fixed", "layout": "dp=3,tp=1,pp=1"}))
        rows.append((f"without device {SLOW}: dp=3,tp=1,pp=1",
                     out["measurements"][-1]["step_seconds"]))
    print_rows(rows, chosen, best, "reshare", "share")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""An MoE run whose measured routing skew triggers a live stage rebalance: the routing the
controller measured, the step time before and after, every split tried as a fixed layout, and
the losses against the same run without rebalancing, side by side.

The model is a tiny Mixtral checkpoint (:mod:`dynatrain.bench.moe_skew`: moe-tiny's shapes
unless ``--hidden``/``--ffn``/``--layers`` say otherwise) whose last stage's routers (the
second half of the layers) send every token to the experts of EP rank 0; the job runs on 4 CPU workers as ``dp=2,tp=1,pp=2,ep=2`` (the CPU cost model's
choice under ``maxTP: 1, maxPP: 2, maxEP: 2``), a global batch of 4: 2 micro-batches per
rank, so the pipeline's stages overlap and the slowest one sets half the step. (With one
micro-batch the stages run one after the other, no split saves time, and the controller does
not rebalance for routing.) Runs, each ``dynatrain run`` with ``--margin 100``
(no other voluntary switch):

- ``live``: ``spec.parallelism.rebalance.enabled``; the controller prices each stage by its
  measured tokens per expert (:mod:`dynatrain.controller.routing`) and re-splits the layers;
- ``off``: the same without rebalancing (its losses must be the live run's, bit for bit);
- ``stages=a+b``: each split as a fixed layout, from the start.

A figure, not a verdict (this machine is shared): run it on an otherwise idle machine.
Needs ``transformers`` (the ``hf``/``test`` extras) to make the checkpoint.

    .venv/bin/python benchmarks/moe_rebalance.py [--steps 60] [--layers 8 --hidden 256
        --ffn 1024 --seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from dynatrain.bench.moe_skew import write_skewed_moe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rebalance import print_rows, try_splits  # noqa: E402  (the sibling benchmark)

SHAPE = "dp=2,tp=1,pp=2,ep=2"


def job(ckpt: Path, steps: int, parallelism: dict, seq_len: int = 64) -> dict:
    return {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": "moe-rebalance"},
            "spec": {"model": {"hf": str(ckpt)}, "resources": {"gpus": 0},
                     "elastic": {"minWorkers": 4, "maxWorkers": 4},
                     "parallelism": parallelism, "globalBatchSize": 4,
                     "training": {"steps": steps, "seqLen": seq_len}}}


def run(work: Path, name: str, doc: dict) -> tuple[dict, str]:
    """One ``dynatrain run``: its summary and its log."""
    manifest = work / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    summary = work / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "dynatrain", "run", str(manifest),
                           "--run-dir", str(work / name), "--summary-json", str(summary),
                           "--margin", "100", "--cooldown", "0"],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"{name}: dynatrain run exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-3000:]}")
    return json.loads(summary.read_text()), proc.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    ap.add_argument("--layers", type=int, default=4,
                    help="layers (default 4); the second half's routers are skewed")
    ap.add_argument("--hidden", type=int, default=128, help="hidden width (default 128)")
    ap.add_argument("--ffn", type=int, default=256, help="each expert's width (default 256)")
    ap.add_argument("--seq-len", type=int, default=64, help="sequence length (default 64)")
    args = ap.parse_args(argv)
    if args.layers < 4 or args.layers % 2:
        ap.error(f"--layers {args.layers}: an even number >= 4 (one half per stage, and more "
                 "than one split to choose from)")
    if args.steps < 20:
        ap.error(f"--steps {args.steps}: at least 20, so a rebalanced layout is measured too")
    work = Path(tempfile.mkdtemp(prefix="moe-rebalance-"))
    skewed = tuple(range(args.layers // 2, args.layers))
    ckpt = write_skewed_moe(work / "skewed", skewed_layers=skewed, layers=args.layers,
                            hidden=args.hidden, ffn=args.ffn)
    print(f"Mixtral, {args.layers} layers, hidden {args.hidden}, 8 experts of width {args.ffn}, "
          f"top-2, layers {skewed[0]}-{skewed[-1]} routed to EP rank 0, on 4 CPU workers "
          f"({SHAPE}), sequence "
          f"{args.seq_len}; {args.steps} steps per run; runs in {work}", flush=True)
    auto = {"mode": "auto", "limits": {"maxTP": 1, "maxPP": 2, "maxEP": 2, "zeroStages": [0]}}
    live, log = run(work, "live", job(ckpt, args.steps, {**auto, "rebalance": {"enabled": True}},
                                       args.seq_len))
    off, _ = run(work, "off", job(ckpt, args.steps, auto, args.seq_len))
    if f"started {SHAPE} on devices" not in log:
        sys.exit(f"the solver did not start the job as {SHAPE}: the figure needs that shape")
    first = live["measurements"][0]
    print(f"\nmeasured on {first['layout']}: EP imbalance by stage "
          f"{'/'.join(f'{x:.2f}' for x in first.get('stage_ep_imbalance', []))}, stage compute "
          f"{'/'.join(f'{x * 1e3:.1f}' for x in first['stage_compute_seconds'])} ms")
    said = next((line.strip() for line in log.splitlines() if "] rebalance: " in line), "")
    print(said or "no rebalance was logged")
    rows = [("even split (live run, before)", first["step_seconds"]),
            ("even split (run without rebalancing, last)", off["measurements"][-1]["step_seconds"])]
    switches = [s for s in live["switches"] if s["reason"] == "rebalance"]
    chosen = switches[-1]["to"] if switches else None
    if chosen:
        after = [m for m in live["measurements"] if m["layout"] == chosen][-1]
        rows.append((f"rebalanced live at step {switches[-1]['step']} to {chosen}",
                     after["step_seconds"]))
    try_splits(SHAPE, args.layers, lambda name, layout: run(
        work, name, job(ckpt, args.steps, {"mode": "fixed", "layout": layout},
                        args.seq_len))[0], rows)
    print_rows(rows)
    same = live["losses"] == off["losses"]
    print(f"\nlosses with and without the rebalance: {'identical, bit for bit' if same else 'DIFFER'}"
          f" ({len(live['losses'])} steps); data read exactly once: "
          f"{live['samples_exactly_once']}")
    return 0 if same and chosen else 1


if __name__ == "__main__":
    sys.exit(main())

"""Peak activation memory and step time of GPipe and 1F1B, with and without checkpointing.

One job (default gpt-tiny, pp=2, global batch 8 of micro-batch 1: 8 micro-batches per step)
trains a few steps under each of GPipe, 1F1B, and both with activation checkpointing, in the
same worker processes, from the same seeded state. Per pipeline stage it prints the peak bytes
of tensors saved for backward (:class:`dynatrain.trainer.activations.ActivationMeter`, the
method CPU allows: torch's CPU allocator keeps no peak), the cost model's prediction of the
same figure, the median step time, and whether the losses equal GPipe's bit for bit. Run:

    .venv/bin/python benchmarks/pipeline_memory.py [--model gpt-tiny] [--pp 2]
        [--global-batch-size 8] [--seq-len 32] [--steps 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from dynatrain.controller.costmodel import estimate
from dynatrain.spec.hardware import PROFILES
from dynatrain.trainer.config import make_config
from dynatrain.trainer.groups import build_groups
from dynatrain.trainer.launch import run_ranks
from dynatrain.trainer.trainer import Trainer
from dynatrain.vps.layout import bind

RUNS = (("gpipe", False), ("1f1b", False), ("gpipe", True), ("1f1b", True))


def _layout(pp: int, schedule: str) -> str:
    return f"pp={pp},schedule={schedule}"


def _rank(rank, device, results, model, pp, kw, steps):
    base = make_config(model, _layout(pp, "gpipe"), **kw)
    groups = build_groups(bind(base.layout, base.model), rank)
    out = {}
    for schedule, ckpt in RUNS:
        cfg = make_config(model, _layout(pp, schedule), activation_checkpointing=ckpt, **kw)
        trainer = Trainer(cfg, groups, device=device)
        trainer.measure_activations = True
        steps_run = [trainer.train_step() for _ in range(steps)]
        out[(schedule, ckpt)] = ([r.loss for r in steps_run],
                                 max(r.activation_bytes for r in steps_run),
                                 statistics.median(r.seconds for r in steps_run[1:] or steps_run))
    results.put(("rank", (rank, out)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    kw = dict(global_batch_size=a.global_batch_size, micro_batch_size=1, seq_len=a.seq_len)
    by_rank = {}
    run_ranks(_rank, (a.model, a.pp, kw, a.steps), world=a.pp, backend="gloo", messages=a.pp,
              on_message=lambda kind, payload: by_rank.__setitem__(*payload),
              what="pipeline memory")
    model = make_config(a.model, _layout(a.pp, "gpipe"), **kw).model
    rows = []
    gpipe_losses = by_rank[0][("gpipe", False)][0]
    for schedule, ckpt in RUNS:
        est = estimate(model, bind(make_config(a.model, _layout(a.pp, schedule), **kw).layout,
                                   model).layout, PROFILES["h100"],
                       global_batch_size=a.global_batch_size, seq_len=a.seq_len,
                       activation_checkpointing=ckpt)
        for stage in range(a.pp):
            losses, peak, seconds = by_rank[stage][(schedule, ckpt)]
            rows.append(dict(schedule=schedule, checkpointing=ckpt, stage=stage,
                             measured_bytes=peak, predicted_bytes=est.stage_activations[stage],
                             step_seconds=seconds, losses_equal_gpipe=losses == gpipe_losses))
    if a.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print(f"{a.model}, pp={a.pp}, {a.global_batch_size} micro-batches of 1 x {a.seq_len} tokens"
          f" per step; peak bytes saved for backward per stage")
    print(f"{'schedule':9} {'ckpt':5} {'stage':>5} {'measured':>12} {'predicted':>12} "
          f"{'step ms':>8}  losses = GPipe's")
    for r in rows:
        print(f"{r['schedule']:9} {str(r['checkpointing']):5} {r['stage']:>5} "
              f"{r['measured_bytes']:>12,} {r['predicted_bytes']:>12,} "
              f"{r['step_seconds'] * 1e3:>8.1f}  {r['losses_equal_gpipe']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

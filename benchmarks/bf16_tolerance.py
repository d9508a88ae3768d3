"""How far bf16 training (bf16 working weights, fp32 masters and moments) strays from fp32.

The same job, same seed, same data is trained twice per model and seed, once with
``--precision fp32`` and once with ``bf16``, and the per-step losses are compared: the
relative difference ``|bf16 - fp32| / fp32`` per step and its maximum. The defaults are the
settings of tests/trainer/test_equivalence.py (global batch 8, sequence 32, lr 3e-3 with a
2-step warmup and cosine decay to lr/10, Adam eps 1e-6, clipping at norm 3), so the
tolerance asserted there (``BF16_REL``) can be checked against what this prints. Run:

    .venv/bin/python benchmarks/bf16_tolerance.py [--models gpt-tiny moe-tiny]
        [--layout dp=1] [--steps 10] [--seeds 0 1 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from dynatrain.trainer.config import make_config
from dynatrain.trainer.launch import run_local
from dynatrain.trainer.schedule import LRSchedule


def measure(model: str, layout: str, steps: int, seed: int, **kw) -> dict:
    runs = {}
    for precision in ("fp32", "bf16"):
        config = make_config(model, layout, precision=precision, seed=seed,
                             total_steps=steps, **kw)
        runs[precision] = run_local(config, steps)
    fp32, bf16 = runs["fp32"].losses, runs["bf16"].losses
    rel = [abs(b - a) / abs(a) for a, b in zip(fp32, bf16)]
    return {"model": model, "layout": layout, "seed": seed, "fp32": fp32, "bf16": bf16,
            "rel": rel, "max_rel": max(rel),
            "grad_norms_fp32": runs["fp32"].grad_norms, "grad_norms_bf16": runs["bf16"].grad_norms}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["gpt-tiny", "moe-tiny"])
    parser.add_argument("--layout", default="dp=1")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--grad-clip", type=float, default=3.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    kw = dict(global_batch_size=8, micro_batch_size=1, seq_len=args.seq_len, lr=args.lr,
              eps=1e-6, grad_clip=args.grad_clip,
              lr_schedule=LRSchedule(warmup_steps=args.warmup_steps, decay="cosine",
                                     min_lr=args.lr / 10))
    rows = []
    for model in args.models:
        for seed in args.seeds:
            r = measure(model, args.layout, args.steps, seed, **kw)
            rows.append(r)
            if not args.json:
                print(f"{model:<10} {args.layout:<8} seed {seed}: max relative loss difference "
                      f"bf16 vs fp32 {r['max_rel']:.2e}", flush=True)
                for i, (a, b, d) in enumerate(zip(r["fp32"], r["bf16"], r["rel"]), 1):
                    print(f"    step {i:>3}  fp32 {a:.5f}  bf16 {b:.5f}  rel {d:.2e}")
    worst = {m: max(r["max_rel"] for r in rows if r["model"] == m) for m in args.models}
    if args.json:
        print(json.dumps({"rows": rows, "max_rel": worst}))
    else:
        print("max over seeds: " + ", ".join(f"{m} {v:.2e}" for m, v in worst.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training throughput of the reference trainer: tokens/s of gpt-125m under several layouts.

On CPU: 4 ranks (gloo) on this machine for each layout. With --gpu (or when a GPU is present
and --layouts is not given): one rank on the GPU (NCCL). Each figure is the median step time
of steps 2..N in one run (step 1 pays one-off allocation costs). Run:

    .venv/bin/python benchmarks/train_throughput.py [--steps 4] [--seq-len 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dynatrain.trainer.config import make_config
from dynatrain.trainer.launch import run_local

CPU_LAYOUTS = ["dp=4", "dp=4,zero=1", "tp=4", "pp=4", "dp=2,tp=2", "tp=2,pp=2",
               "dp=2,pp=2,zero=1"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-125m")
    parser.add_argument("--layouts", nargs="*", default=None,
                        help=f"layouts to run (default on CPU: {' '.join(CPU_LAYOUTS)})")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--gpu", action="store_true", help="one rank on the GPU (NCCL)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    gpu = args.gpu or (args.layouts is None and torch.cuda.is_available())
    layouts = args.layouts or (["dp=1"] if gpu else CPU_LAYOUTS)
    backend = "nccl" if gpu else "gloo"
    rows = []
    for text in layouts:
        config = make_config(args.model, text, seq_len=args.seq_len,
                             global_batch_size=args.global_batch_size)
        r = run_local(config, args.steps, backend=backend)
        rows.append({"layout": r.layout, "ranks": r.world, "backend": r.backend,
                     "tokens_per_second": round(r.tokens_per_second, 1),
                     "step_seconds": [round(s, 3) for s in r.step_seconds],
                     "final_loss": round(r.losses[-1], 4)})
        if not args.json:
            print(f"  {r.layout:<28}{r.world:>3} ranks  {r.backend:<5}"
                  f"{r.tokens_per_second:>12,.0f} tok/s   steps {rows[-1]['step_seconds']}",
                  flush=True)
    if args.json:
        print(json.dumps({"model": args.model, "seq_len": args.seq_len,
                          "global_batch_size": args.global_batch_size, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``dynatrain train``: train a model under one layout with processes on this machine.

The configuration is validated before any process starts, so a layout that does not fit the
model fails at once with a message naming the problem.
"""

from __future__ import annotations

import json

from dynatrain.cli.errors import UsageError
from dynatrain.trainer.config import make_config
from dynatrain.vps.presets import PRESETS


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model under one layout on this machine",
        description="Train a model with one process per rank on this machine (gloo on CPU, "
        "NCCL when there is a GPU per rank) and print per-step loss and tokens/s.",
        epilog="example: dynatrain train --model gpt-tiny --layout dp=2,tp=2 --steps 10")
    p.add_argument("--model", required=True, metavar="M",
                   help=f"preset ({', '.join(PRESETS)}) or a .yaml/.json model spec file")
    p.add_argument("--layout", required=True, metavar="L",
                   help="e.g. dp=2,tp=2,pp=1,ep=1,zero=1 (dp*tp*pp processes)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    p.add_argument("--global-batch-size", type=int, default=8, metavar="B",
                   help="sequences per step, whatever the layout (default 8)")
    p.add_argument("--micro-batch-size", type=int, default=1, metavar="MB",
                   help="sequences per micro-batch on one DP rank (default 1)")
    p.add_argument("--seq-len", type=int, default=0,
                   help="tokens per sequence (default min(model max, 128))")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--data", default="synthetic",
                   help="'synthetic' (seeded stream) or a flat uint16 token file")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (losses, tokens_per_second, ...)")
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    if args.steps < 1:
        raise UsageError(f"--steps={args.steps} must be >= 1")
    config = make_config(args.model, args.layout, seed=args.seed,
                         global_batch_size=args.global_batch_size,
                         micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                         lr=args.lr, data=args.data)
    from dynatrain.trainer.launch import run_local  # torch is imported only from here on

    if not args.json:
        print(f"training {config.model.name} ({config.model.num_params:,} params) under "
              f"{config.layout.to_text()}: {config.layout.world} processes, global batch "
              f"{config.global_batch_size} x {config.seq_len} tokens")

    def progress(step, steps, loss, seconds, tps):
        if not args.json:
            print(f"  step {step:>4}/{steps}  loss {loss:.6f}  {tps:>10,.0f} tok/s  "
                  f"({seconds:.2f} s)", flush=True)

    result = run_local(config, args.steps, backend=args.backend, progress=progress)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(f"done: final loss {result.losses[-1]:.6f}, {result.tokens_per_second:,.0f} "
              f"tokens/s (median of steps 2..{args.steps}, backend {result.backend})")
    return 0

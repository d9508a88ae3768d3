"""``dynatrain train``: train a model under one layout with processes on this machine.

The configuration is validated before any process starts, so a layout that does not fit the
model fails at once with a message naming the problem.
"""

from __future__ import annotations

import json
from pathlib import Path

from dynatrain.cli.errors import UsageError
from dynatrain.trainer.config import PRECISIONS, TOKEN_DTYPES, make_config
from dynatrain.trainer.schedule import DECAYS, LRSchedule
from dynatrain.vps.presets import PRESETS


def add_training_options(p) -> None:
    """The optimizer, schedule, precision and data options that `train` and `eval` share."""
    p.add_argument("--precision", choices=list(PRECISIONS), default=None,
                   help="working-weight dtype: fp32, or bf16 with fp32 master weights "
                   "(default: the model's own dtype)")
    p.add_argument("--data", default="synthetic",
                   help="'synthetic' (seeded stream), a flat token file (--data-dtype), or "
                   "a .jsonl/.txt text file tokenised once with --tokenizer")
    p.add_argument("--data-dtype", choices=list(TOKEN_DTYPES), default="uint16",
                   help="dtype of a flat token file (uint32 for vocabularies over 65,536)")
    p.add_argument("--tokenizer", default="", metavar="DIR",
                   help="Hugging Face tokenizer directory for text --data")


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model under one layout on this machine",
        description="Train a model with one process per rank on this machine (gloo on CPU, "
        "NCCL when there is a GPU per rank) and print per-step loss and tokens/s.",
        epilog="example: dynatrain train --model gpt-tiny --layout dp=2,tp=2 --steps 10")
    p.add_argument("--model", required=True, metavar="M",
                   help=f"preset ({', '.join(PRESETS)}), a .yaml/.json model spec file, or "
                   "hf:DIR (a Hugging Face Llama/Qwen2/Qwen3/Mixtral/Qwen3-MoE checkpoint, "
                   "whose weights start the run)")
    p.add_argument("--layout", required=True, metavar="L",
                   help="e.g. dp=2,tp=2,pp=1,ep=1,zero=1 (dp*tp*pp processes)")
    p.add_argument("--steps", type=int, default=10,
                   help="optimizer steps (default 10; 0 with --save-hf exports the initial "
                   "weights, e.g. to check an hf: import round trip)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    p.add_argument("--global-batch-size", type=int, default=8, metavar="B",
                   help="sequences per step, whatever the layout (default 8)")
    p.add_argument("--micro-batch-size", type=int, default=1, metavar="MB",
                   help="sequences per micro-batch on one DP rank (default 1)")
    p.add_argument("--seq-len", type=int, default=0,
                   help="tokens per sequence (default min(model max, 128))")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="AdamW learning rate (the peak, with a schedule)")
    p.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                   help="linear warmup over the first N steps (default 0)")
    p.add_argument("--lr-decay", choices=list(DECAYS), default="constant",
                   help="after warmup: constant, or cosine/linear decay to --min-lr")
    p.add_argument("--decay-steps", type=int, default=0, metavar="N",
                   help="the step where decay reaches --min-lr (default: --steps)")
    p.add_argument("--min-lr", type=float, default=0.0, help="the decay's floor (default 0)")
    p.add_argument("--grad-clip", type=float, default=0.0, metavar="NORM",
                   help="clip gradients to this global L2 norm (default 0: off)")
    add_training_options(p)
    p.add_argument("--save-hf", default="", metavar="OUT",
                   help="after training, write a Hugging Face checkpoint (config.json + "
                   "safetensors) to OUT, a new or empty directory; the ranks save a DCP "
                   "checkpoint next to OUT first, which is exported and removed")
    p.add_argument("--max-shard-size", default="2GB", metavar="SIZE",
                   help="with --save-hf: the largest safetensors file (default 2GB)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (losses, tokens_per_second, ...)")
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    if args.steps < 0 or (args.steps == 0 and not args.save_hf):
        raise UsageError(f"--steps={args.steps} must be >= 1 (0 only with --save-hf, which then "
                         "exports the initial weights)")
    if args.save_hf:
        _check_new_dir(args.save_hf)            # before training, not after it
    schedule = LRSchedule(warmup_steps=args.warmup_steps, decay=args.lr_decay,
                          decay_steps=args.decay_steps, min_lr=args.min_lr)
    config = make_config(args.model, args.layout, seed=args.seed, precision=args.precision,
                         global_batch_size=args.global_batch_size,
                         micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                         lr=args.lr, data=args.data, data_dtype=args.data_dtype,
                         tokenizer=args.tokenizer, lr_schedule=schedule,
                         total_steps=args.steps, grad_clip=args.grad_clip)
    from dynatrain.trainer.sources import prepare_and_check

    prepare_and_check(config, config.model.vocab_size, say=None if args.json else print)
    from dynatrain.trainer.launch import run_local  # torch is imported only from here on

    if not args.json:
        print(f"training {config.model.name} ({config.model.num_params:,} params) under "
              f"{config.layout.to_text()}: {config.layout.world} processes, global batch "
              f"{config.global_batch_size} x {config.seq_len} tokens")

    def progress(step, steps, loss, seconds, tps):
        if not args.json:
            print(f"  step {step:>4}/{steps}  loss {loss:.6f}  {tps:>10,.0f} tok/s  "
                  f"({seconds:.2f} s)", flush=True)

    if not args.save_hf:
        result = run_local(config, args.steps, backend=args.backend, progress=progress)
        exported = None
    else:
        result, exported = _train_and_export(args, config, progress)
    if args.json:
        out = result.to_json()
        if exported is not None:
            out["save_hf"] = {"out": exported.out, "files": list(exported.files),
                              "tensors": exported.tensors, "bytes": exported.bytes}
        print(json.dumps(out))
    elif result.losses:
        print(f"done: final loss {result.losses[-1]:.6f}, {result.tokens_per_second:,.0f} "
              f"tokens/s (median of steps 2..{args.steps}, backend {result.backend})")
    return 0


def _check_new_dir(path: str) -> None:
    p = Path(path)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise UsageError(f"--save-hf {path!r} exists and is not an empty directory; "
                         "choose a new one")


def _train_and_export(args, config, progress):
    """Train, have the ranks save a DCP checkpoint beside OUT, export it, remove it."""
    import shutil
    import tempfile

    from dynatrain.trainer.hf_export import ExportError, export_hf, parse_size
    from dynatrain.trainer.launch import run_local
    from dynatrain.vps.hf import read_hf_config

    try:
        parse_size(args.max_shard_size)
    except ExportError as e:
        raise UsageError(f"--max-shard-size: {e}") from None
    out = Path(args.save_hf).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Beside OUT: same filesystem, and room for the model is needed there anyway.
    tmp = tempfile.mkdtemp(prefix=f".{out.name}.dcp-", dir=out.parent)
    try:
        result = run_local(config, args.steps, backend=args.backend, progress=progress,
                           save_to=tmp)
        base = read_hf_config(config.init_hf) if config.init_hf else None
        say = None if args.json else (lambda line: print(line, flush=True))
        exported = export_hf(tmp, out, model=config.model, base_config=base,
                             copy_from=config.init_hf, max_shard_size=args.max_shard_size,
                             progress=say)
    except ExportError as e:
        raise UsageError(f"--save-hf: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result, exported

"""``dynatrain eval``: a model's mean next-token loss on a data file, under any layout.

The same processes as ``dynatrain train`` (one per rank on this machine), the same model
sources (preset, spec file, ``hf:DIR``) and the same data windows, forward only. Everything
that can be checked without starting a process (model, layout, seq_len, data file, sequence
count) is checked first, so a bad value fails at once with a message naming it.
"""

from __future__ import annotations

import json
import math

from dynatrain.cli.errors import UsageError
from dynatrain.cli.train import add_training_options
from dynatrain.vps.presets import PRESETS


def register(sub) -> None:
    p = sub.add_parser(
        "eval", help="mean next-token loss of a model on a data file, under one layout",
        description="Evaluate a model's mean next-token cross-entropy over the first N "
        "samples of a data source, with one process per rank on this machine (gloo on CPU, "
        "NCCL when there is a GPU per rank). Sample i is tokens [i*S, i*S+S+1) of the data, "
        "the window training reads, and the mean is over all N*S predicted tokens whatever "
        "the layout.",
        epilog="example: dynatrain eval --model hf:./tiny-llama --layout tp=2,pp=2 "
        "--data val.bin --seq-len 512 --sequences 64")
    p.add_argument("--model", required=True, metavar="M",
                   help=f"preset ({', '.join(PRESETS)}; seeded random weights, as `train` "
                   "starts them, with --seed), a .yaml/.json model spec file, or hf:DIR (a "
                   "Hugging Face Llama/Qwen2/Qwen3/Mixtral/Qwen3-MoE checkpoint, whose weights "
                   "are evaluated)")
    p.add_argument("--layout", default="dp=1", metavar="L",
                   help="e.g. tp=2,pp=2 or dp=2,ep=2 (dp*tp*pp processes; default dp=1); "
                   "any layout gives the same loss up to rounding")
    p.add_argument("--sequences", type=int, required=True, metavar="N",
                   help="evaluate samples 0..N-1 (a flat token file holds "
                   "(tokens-1) // seq_len of them)")
    p.add_argument("--seq-len", type=int, default=0, metavar="S",
                   help="tokens per sample (default min(model max, 128))")
    p.add_argument("--micro-batch-size", type=int, default=1, metavar="MB",
                   help="sequences per forward pass on one DP rank (default 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="initialisation seed of preset/spec models and the synthetic stream")
    add_training_options(p)
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--json", action="store_true",
                   help='print one JSON object: {"loss": ..., "sequences": N}')
    p.set_defaults(func=run_eval_command)


def run_eval_command(args) -> int:
    if args.sequences < 1:
        raise UsageError(f"--sequences={args.sequences} must be >= 1")
    if args.micro_batch_size < 1:
        raise UsageError(f"--micro-batch-size={args.micro_batch_size} must be >= 1")
    if args.seq_len < 0:
        raise UsageError(f"--seq-len={args.seq_len} must be >= 1 (or 0: the default)")
    # torch is imported only from here on
    from dynatrain.trainer.evaluate import eval_config, run_eval

    config = eval_config(args.model, args.layout, seq_len=args.seq_len,
                         micro_batch_size=args.micro_batch_size, precision=args.precision,
                         data=args.data, data_dtype=args.data_dtype, tokenizer=args.tokenizer,
                         seed=args.seed)
    result = run_eval(config, args.sequences, backend=args.backend)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        ppl = math.exp(result.loss) if result.loss < 700 else math.inf
        print(f"{result.model} under {result.layout}: loss {result.loss:.6f} (perplexity "
              f"{ppl:,.2f}) over {result.sequences} sequences x {config.seq_len} tokens, "
              f"{result.tokens / max(result.seconds, 1e-9):,.0f} tokens/s on {result.world} "
              f"process(es), backend {result.backend}")
    return 0

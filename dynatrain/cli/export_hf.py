"""``dynatrain export-hf CHECKPOINT OUT``: a training checkpoint as a Hugging Face checkpoint.

Reads a DCP checkpoint of any layout (a ``step-*`` directory, or the directory holding them:
the newest is taken; a checkpoint root with one job's folder ``<root>/<job>/step-*`` works too) one output shard at a time and writes ``config.json`` plus safetensors
that ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads unchanged
(:mod:`dynatrain.trainer.hf_export`).
"""

from __future__ import annotations

import argparse

from dynatrain.cli.errors import UsageError
from dynatrain.vps.presets import PRESETS


def register(sub) -> None:
    p = sub.add_parser(
        "export-hf", help="write a training checkpoint as a Hugging Face checkpoint",
        description="Write the model weights of a DynaTrain checkpoint (saved under any layout)\n"
        "as a Hugging Face checkpoint: config.json and safetensors shards (with\n"
        "model.safetensors.index.json when there is more than one), named as transformers'\n"
        "save_pretrained names them. Llama, Qwen2, Qwen3, Mixtral and Qwen3-MoE models; the\n"
        "architecture follows from the model (a model imported with hf:DIR keeps its\n"
        "config.json). Memory: about one shard.",
        epilog="examples:\n"
        "  dynatrain export-hf checkpoints/ out/llama          # newest step-* in checkpoints/\n"
        "  dynatrain export-hf checkpoints/step-00000100 out/m --model hf:/models/llama "
        "--max-shard-size 500MB",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a checkpoint directory (step-NNNNNNNN), a directory of them, or a "
                        "checkpoint root holding one job's folder of them")
    p.add_argument("out", metavar="OUT", help="output directory (new or empty)")
    p.add_argument("--model", default=None, metavar="M",
                   help="the model the checkpoint holds: a preset "
                   f"({', '.join(PRESETS)}), a .yaml/.json spec or hf:DIR (its config.json "
                   "and tokenizer files are carried over); default: the model the checkpoint "
                   "records")
    p.add_argument("--max-shard-size", default="2GB", metavar="SIZE",
                   help="largest safetensors file, e.g. 500MB, 2GB, 1GiB (default 2GB)")
    p.add_argument("--quiet", action="store_true", help="print only the output directory")
    p.set_defaults(func=run_export_hf)


def run_export_hf(args) -> int:
    from dynatrain.trainer.hf_export import ExportError, export_hf  # torch from here on
    from dynatrain.vps.hf import read_hf_config
    from dynatrain.vps.presets import load_model

    model = base = None
    source = ""
    if args.model:
        model = load_model(args.model)
        if args.model.startswith("hf:"):
            source = args.model[3:]
            base = read_hf_config(source)
    say = None if args.quiet else (lambda line: print(line, flush=True))
    try:
        result = export_hf(args.checkpoint, args.out, model=model, base_config=base,
                           copy_from=source, max_shard_size=args.max_shard_size, progress=say)
    except (ExportError, FileNotFoundError, NotADirectoryError) as e:
        raise UsageError(str(e)) from None
    if args.quiet:
        print(result.out)
    return 0

"""The ``dynatrain`` parser and dispatch: one entry point, one subcommand per capability.

Each subcommand lives in a module of this package with a ``register(subparsers)`` function;
:data:`COMMANDS` lists them in the order ``--help`` shows them. This module only dispatches and
turns user errors (bad model, bad layout, impossible plan) into one line on stderr and exit
code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from dynatrain import __version__
from dynatrain.cli import (bench, chart, dev, hf_config, models, operator_, plan, report, run,
                           train, worker)
from dynatrain.cli import eval as eval_  # bound as eval_: `eval` would hide the builtin
from dynatrain.cli import export_hf, tokenize_
from dynatrain.cli.errors import USER_ERRORS, UsageError

COMMANDS = (plan, models, train, eval_, run, report, worker, operator_, bench, dev, chart,
            hf_config, tokenize_, export_hf)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynatrain",
        description="DynaTrain: switch the parallelism layout of a running training job.",
    )
    parser.add_argument("--version", action="version", version=f"dynatrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:   # its options are the worker's own (argparse would eat them)
        return worker.dispatch(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (*USER_ERRORS, UsageError) as e:
        print(f"dynatrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `dynatrain plan ... | head`
        return 0

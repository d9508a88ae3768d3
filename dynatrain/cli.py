"""The ``dynatrain`` console script: one entry point, one subcommand per capability.

Each subcommand lives in its own module and registers itself with ``register(subparsers)``;
this module only dispatches and turns user errors (bad model, bad layout, impossible plan)
into one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from dynatrain import __version__
from dynatrain.vps.layout import LayoutError
from dynatrain.vps.model import ModelSpecError
from dynatrain.trainer.config import ConfigError
from dynatrain.vps.planner import PlanError
from dynatrain.controller.job import JobError
from dynatrain.controller.scenario import ScenarioError

USER_ERRORS = (LayoutError, ModelSpecError, PlanError, ConfigError, JobError, ScenarioError)


class UsageError(ValueError):
    """A command-line value is not valid; the message names it and what would be."""


def build_parser() -> argparse.ArgumentParser:
    from dynatrain import bench_switch, operator_cmd, plan_cmd, run_cmd, train_cmd

    parser = argparse.ArgumentParser(
        prog="dynatrain",
        description="DynaTrain: switch the parallelism layout of a running training job.",
    )
    parser.add_argument("--version", action="version", version=f"dynatrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    plan_cmd.register(sub)
    train_cmd.register(sub)
    run_cmd.register(sub)
    operator_cmd.register(sub)
    bench_switch.register(sub)
    try:  # the local control plane for operator development (optional module)
        from dynatrain.devcluster import cli as devcluster_cli
    except ImportError:
        devcluster_cli = None
    if devcluster_cli is not None:
        devcluster_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:   # its options are the worker's own (argparse would eat them)
        from dynatrain.agent.worker import main as worker_main

        return worker_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (*USER_ERRORS, UsageError) as e:
        print(f"dynatrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `dynatrain plan ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())

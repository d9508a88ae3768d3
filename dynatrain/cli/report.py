"""``dynatrain report SUMMARY.json``: the picture of a local run, drawn from its saved summary.

``dynatrain run --report DIR`` draws the same picture when the run ends; this command draws it
again from what ``--summary-json`` wrote (:mod:`dynatrain.controller.report` does the drawing).
:func:`check_out_dir` is shared with ``run``, which refuses a bad folder before it trains.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from dynatrain.cli.errors import UsageError

EPILOG = """\
examples:
  dynatrain run examples/quickstart.yaml --summary-json out.json
  dynatrain report out.json --out runs/   # runs/quickstart-run.png
"""


def register(sub) -> None:
    p = sub.add_parser(
        "report", help="draw a local run's picture (PNG) from its summary JSON",
        description="Draw loss and tokens/s against step and wall time, every switch and\n"
        "recovery marked with its reason, layouts and pause, and the run's summary beside\n"
        "them, from the JSON that `dynatrain run --summary-json` wrote. Writes\n"
        "<DIR>/<job>-run.png and prints its path.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("summary", metavar="SUMMARY.json", help="a run's summary (--summary-json)")
    p.add_argument("--out", metavar="DIR",
                   help="folder for the PNG, made if missing (default: the summary's folder)")
    p.set_defaults(func=report)


def check_out_dir(value: str, flag: str) -> Path:
    """``value`` as the folder a report goes into, refused now if it cannot be one: it, or
    the nearest part of it that exists, is a file, or that part is not writable."""
    path = Path(value)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        what = "is" if existing == path else f"is under {str(existing)!r}, which is"
        raise UsageError(f"{flag}={value!r} {what} a file, not a directory; give a directory "
                         "(it is made if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}={value!r}: {str(existing)!r} is not writable")
    return path


def report(args) -> int:
    from dynatrain.controller.report import ReportError, write_report

    source = Path(args.summary)
    out = check_out_dir(args.out if args.out is not None else str(source.parent), "--out")
    try:
        summary = json.loads(source.read_text())
    except FileNotFoundError:
        raise UsageError(f"{args.summary!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{args.summary!r} is not a readable JSON file: {e}") from None
    try:
        path = write_report(summary, out)
    except ReportError as e:
        raise UsageError(f"{args.summary!r}: {e}") from None
    print(f"report: {path}")
    return 0

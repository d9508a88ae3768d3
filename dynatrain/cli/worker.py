"""``dynatrain worker``: one worker process with its gRPC agent (``dynatrain.agent.worker``).

``dynatrain run`` and the operator's pods start it. Its options are the worker's own, so
:func:`dispatch` hands it the arguments before argparse sees them; :func:`register` only lists
the command in ``dynatrain --help``.
"""

from __future__ import annotations


def register(sub) -> None:
    sub.add_parser("worker", help="one worker process with its agent (started for you by "
                   "`run` and by the operator's pods; `dynatrain worker --help`)")


def dispatch(argv: list[str]) -> int:
    from dynatrain.agent.worker import main as worker_main

    return worker_main(argv)

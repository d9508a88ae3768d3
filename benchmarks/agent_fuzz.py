"""Fuzz a live, training agent and print the counts (issue #21, part 5).

A target worker trains gpt-tiny (dp=1, bearer token, loopback only) while its agent gets
``--requests`` generated requests: random and wire-mutated protobuf messages of every Agent
method, garbage bytes, fields over their bounds and messages over gRPC's size limit, wrong,
missing and duplicated tokens, stale Prepare/Commit/Abort generations, unknown methods and
the health service, first one at a time, then from ``--threads`` threads at once (bounded by
``--flood-seconds``). A reference worker trains the same job untouched. Printed: requests per
kind, answers per gRPC code, crashes, health checks, steps trained during the fuzz, the loss
comparison with the reference (bit for bit) and requests per second. Exit code 1 names every
check that failed (``dynatrain.bench.fuzz.failures``). The generator and the judge are
``dynatrain.bench.fuzz``; ``tests/agent/test_fuzz.py`` runs a shorter fixed-seed run. Run:

    .venv/bin/python benchmarks/agent_fuzz.py [--requests 20000] [--seed N] [--threads 32]
        [--flood-seconds 120] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from dynatrain.bench.fuzz import failures, report, run_fuzz


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000,
                        help="requests in all (default %(default)s)")
    parser.add_argument("--seed", type=int, default=None,
                        help="the generator's seed (default: a random one, printed)")
    parser.add_argument("--threads", type=int, default=32,
                        help="threads of the concurrent flood (default %(default)s)")
    parser.add_argument("--serial-fraction", type=float, default=0.3,
                        help="share of the requests sent one at a time first (default "
                             "%(default)s)")
    parser.add_argument("--flood-seconds", type=float, default=120.0,
                        help="time bound of the flood; requests not sent by then are "
                             "dropped (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.threads < 1 or not 0 <= args.serial_fraction <= 1 \
            or args.flood_seconds <= 0:
        parser.error(f"--requests {args.requests}, --threads {args.threads}, "
                     f"--serial-fraction {args.serial_fraction}, --flood-seconds "
                     f"{args.flood_seconds}: expected requests and threads >= 1, a fraction "
                     "in [0, 1] and seconds > 0")
    result = run_fuzz(args.requests, seed=args.seed, threads=args.threads,
                      serial_fraction=args.serial_fraction, flood_seconds=args.flood_seconds)
    print(report(result))
    failed = failures(result)
    for f in failed:
        print(f"FAILED: {f}")
    if args.json:
        print(json.dumps(result, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""How long the local runner's workers take to come up: forked from a server with torch
imported, against a new interpreter each (dynatrain.controller.workerstart).

Each method runs in a fresh process of its own (so the fork server's own start, importing
torch once, is counted in its figure), starts ``--workers`` real workers of a small job at
once, and times them until every agent answers its health check, as the runner waits for
them. Repeated ``--repeats`` times, alternating the methods; the medians are printed side by
side. A figure, not a verdict: run it on an otherwise idle machine.

    .venv/bin/python benchmarks/worker_start.py --workers 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = ("apiVersion: dynatrain.io/v1alpha1\nkind: DynaTrainJob\nmetadata: {name: start}\n"
       "spec: {model: {preset: gpt-tiny}, elastic: {minWorkers: 1, maxWorkers: 4}, "
       "globalBatchSize: 4, training: {steps: 4, seqLen: 16}}\n")


def one(method: str, workers: int) -> float:
    """Start ``workers`` workers with ``method``; seconds until every agent is healthy."""
    from dynatrain.agent.client import AgentClient
    from dynatrain.controller.workerstart import start_worker

    out = Path(tempfile.mkdtemp(prefix="worker-start-"))
    (out / "job.yaml").write_text(JOB)
    token = out / "token"
    token.write_text(os.urandom(16).hex())
    t0 = time.monotonic()
    procs = [start_worker(["--job", str(out / "job.yaml"), "--device", str(d),
                           "--token-file", str(token), "--ready-file", str(out / f"{d}.ready"),
                           "--threads", "1", "--backend", "gloo",
                           "--parent-pid", str(os.getpid())],
                          dict(os.environ), out / f"worker-{d}.log", method)
             for d in range(workers)]
    for d, proc in enumerate(procs):
        ready = out / f"{d}.ready"
        while not ready.exists():
            if proc.poll() is not None:
                sys.exit(f"worker {d} exited with {proc.returncode}:\n"
                         f"{(out / f'worker-{d}.log').read_text()[-2000:]}")
            time.sleep(0.01)
        port = json.loads(ready.read_text())["agent_port"]
        AgentClient(f"127.0.0.1:{port}", token_file=str(token)).wait_healthy(60.0)
    took = time.monotonic() - t0
    for proc in procs:
        proc.send_signal(2)                     # SIGINT: stop (standby: at once)
    for proc in procs:
        proc.wait(timeout=30)
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4, help="workers started at once (4)")
    p.add_argument("--repeats", type=int, default=3, help="runs per method (3)")
    p.add_argument("--one", choices=("forkserver", "exec"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.workers < 1 or args.repeats < 1:
        p.error(f"--workers {args.workers} and --repeats {args.repeats} must be >= 1")
    if args.one:
        print(json.dumps({"seconds": one(args.one, args.workers)}))
        return 0
    times: dict[str, list[float]] = {"exec": [], "forkserver": []}
    for r in range(args.repeats):
        for method in times:
            proc = subprocess.run([sys.executable, __file__, "--one", method,
                                   "--workers", str(args.workers)],
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode:
                sys.exit(f"{method}: {proc.stderr[-3000:]}")
            times[method].append(json.loads(proc.stdout.strip().splitlines()[-1])["seconds"])
            print(f"run {r + 1}/{args.repeats} {method:10s} {times[method][-1]:6.2f} s",
                  flush=True)
    e, f = statistics.median(times["exec"]), statistics.median(times["forkserver"])
    print(f"\n{args.workers} workers up and healthy, median of {args.repeats} "
          f"({os.cpu_count()} CPUs): exec {e:.2f} s, forkserver {f:.2f} s "
          f"(fork server's own start included): {e / f:.1f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())

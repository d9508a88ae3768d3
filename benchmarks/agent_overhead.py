"""Idle agent overhead on step time: the same trainer with and without its agent beside it.

One process, gpt-tiny under dp=1 (one rank, so no peer's noise). Blocks of steps rotate
between, each with a freshly built trainer:

  A  the bare reference trainer;
  B  the worker as `dynatrain run` starts it, idle: gRPC agent (token auth) and metrics
     endpoint serving, per-step metrics and step records, no calls after the start;
  C  the same, with a controller polling Status at 4 Hz as the local runner does;

so that drift of a shared machine falls on all alike. Prints median(B) / median(A) - 1 (the
idle overhead; target <= 1%), the same for C, and the spread of A between its blocks. Run:
    .venv/bin/python benchmarks/agent_overhead.py [--rounds 6] [--steps 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from dynatrain.agent.client import AgentClient
from dynatrain.agent.server import serve
from dynatrain.agent.v1 import agent_pb2
from dynatrain.agent.worker import Worker
from dynatrain.spec.job import job_from_manifest
from dynatrain.controller.orchestrator import switch
from dynatrain.controller.rendezvous import RendezvousServer
from dynatrain.trainer.groups import build_groups
from dynatrain.trainer.trainer import Trainer
from dynatrain.vps.generations import DeviceManager
from dynatrain.vps.layout import bind, parse_layout

ROOT = Path(__file__).resolve().parents[1]


def _job(steps: int):
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["training"]["steps"] = steps
    doc["spec"]["globalBatchSize"] = 4
    return job_from_manifest(doc)


def bare_trainer(job) -> Trainer:
    layout = parse_layout("dp=1").with_devices([0])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = build_groups(bind(layout, job.model), 0,
                          DeviceManager(store, 0).group_factory(0, layout))
    return Trainer(job.train_config(layout), groups)


def with_agent(job, poll: bool) -> list[float]:
    """One worker's step times, from start to the job's last step (a fresh store each time)."""
    store = RendezvousServer("127.0.0.1")       # the controller's store, as the runner's
    tmp = Path(tempfile.mkdtemp())
    token = tmp / "token"
    token.write_text(secrets.token_urlsafe(16))
    worker = Worker(job, 0)
    _, _ = worker.control.metrics.serve()
    server = serve(worker.control, token_file=str(token))
    client = AgentClient(server.address, token_file=str(token))
    done = threading.Event()

    def controller():
        layout = parse_layout("dp=1").with_devices([0])
        switch({0: client}, 1, None, layout, store.address, reason="start")
        seen = 0
        while not done.is_set():
            if poll:                                  # the local runner's polling
                st = client.status(since_step=seen)
                seen = max([seen] + [r.step for r in st.steps])
            if worker.control.state == agent_pb2.StatusResponse.FINISHED:
                worker.stop()
                return
            time.sleep(0.25)

    t = threading.Thread(target=controller, daemon=True)
    t.start()
    worker.run()
    done.set()
    t.join(5)
    records = list(worker.control.records)
    server.stop(0)
    client.close()
    store.close()
    return [r.seconds for r in records]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="A/B block pairs (default 6)")
    p.add_argument("--steps", type=int, default=30, help="steps per block (default 30)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    skip = 3                                          # a block's first steps pay allocation
    job = _job(args.steps + skip)
    a, b, c, a_blocks = [], [], [], []
    for _ in range(args.rounds):
        trainer = bare_trainer(job)
        block = [trainer.train_step().seconds for _ in range(args.steps + skip)][skip:]
        del trainer
        a += block
        a_blocks.append(statistics.median(block))
        b += with_agent(job, poll=False)[skip:]
        c += with_agent(job, poll=True)[skip:]
    ma, mb, mc = statistics.median(a), statistics.median(b), statistics.median(c)
    out = {"bare_step_seconds": ma, "idle_agent_step_seconds": mb,
           "polled_agent_step_seconds": mc, "overhead": mb / ma - 1,
           "overhead_polled": mc / ma - 1,
           "bare_block_spread": (max(a_blocks) - min(a_blocks)) / ma, "steps_each": len(a)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"bare trainer          {ma * 1e3:.2f} ms / step (median of {len(a)} steps)")
        print(f"idle agent            {mb * 1e3:.2f} ms / step")
        print(f"agent polled at 4 Hz  {mc * 1e3:.2f} ms / step")
        print(f"idle agent overhead {out['overhead'] * 100:+.2f}% (target <= 1%), polled "
              f"{out['overhead_polled'] * 100:+.2f}%; the bare blocks' medians spread "
              f"{out['bare_block_spread'] * 100:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

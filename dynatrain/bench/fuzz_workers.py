"""The fuzz run's worker processes: the job they train, their start, and their monitor.

The process side of :mod:`.fuzz`: :func:`job_manifest` (the quickstart job, small and long),
:func:`spawn_worker` (a real ``python -m dynatrain.agent.worker`` in standby, waited for
until its ready file appears; the agent's live tests start workers with it too) and
:class:`Monitor` (a thread that checks both workers are alive, the target's health on both
its ports, and collects every step record). Separate because it is the harness around the
target, not the fuzzing: it knows nothing of the generated requests.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from dynatrain.agent.client import AgentCallError, AgentClient
from dynatrain.agent.v1 import agent_pb2

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------
# The processes


def job_manifest(steps: int = 100000) -> dict:
    """The quickstart job, small and long (it trains until stopped)."""
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["training"]["steps"] = steps
    doc["spec"]["globalBatchSize"] = 4
    return doc


def spawn_worker(workdir: Path, job: Path, token: Path, device: int, timeout_s: float = 120,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, dict]:
    """A worker process in standby; returns it and its ready file (agent_port, ...)."""
    ready = workdir / f"ready-{device}"
    log = open(workdir / f"worker-{device}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "dynatrain.agent.worker", "--job", str(job),
                             "--device", str(device), "--token-file", str(token),
                             "--ready-file", str(ready), "--threads", "1", *extra],
                            stdout=log, stderr=subprocess.STDOUT,
                            # a SIGABRT (sent if it does not stop) dumps every thread's stack
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    log.close()
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"worker {device} exited with {proc.returncode} at start:\n"
                               + (workdir / f"worker-{device}.log").read_text()[-3000:])
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"worker {device} did not start within {timeout_s:g} s")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


class Monitor(threading.Thread):
    """Every ``period`` seconds: the target's health on its agent port and its plaintext
    health port (no token, as a kubelet asks), both
    processes alive, and the step records of both workers (Status after the last one seen),
    which outlive the agent's own window of 1000."""

    def __init__(self, procs: dict[str, subprocess.Popen], clients: dict[str, AgentClient],
                 health: list[AgentClient], period: float = 0.25):
        super().__init__(name="fuzz-monitor", daemon=True)
        self.procs, self.clients, self.health_clients, self.period = (
            procs, clients, health, period)
        self.records: dict[str, dict[int, agent_pb2.StepRecord]] = {k: {} for k in clients}
        self.health_checks = 0
        self.health_failures: list[str] = []
        self.status_refusals: collections.Counter = collections.Counter()
        self.dead: dict[str, int] = {}
        self._halt = threading.Event()
        self.lock = threading.Lock()

    def healthy(self) -> bool:
        """Ask every health endpoint once; False (and the failure noted) if one is not
        SERVING."""
        all_ok = True
        for client in self.health_clients:
            t0 = time.monotonic()
            try:
                ok = client.health(timeout_s=10)
                why = "" if ok else "not SERVING (or no answer within 10 s)"
            except AgentCallError as e:
                ok, why = False, f"{e.code.name}: {e.details}"
            with self.lock:
                self.health_checks += 1
                if not ok:
                    self.health_failures.append(
                        f"{client.address} at {time.strftime('%H:%M:%S')} after "
                        f"{time.monotonic() - t0:.1f} s: {why}")
            all_ok = all_ok and ok
        return all_ok

    def poll(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None and name not in self.dead:
                self.dead[name] = proc.returncode
        self.healthy()
        for name, client in self.clients.items():
            self.pull(name, client)

    def pull(self, name: str, client: AgentClient) -> None:
        with self.lock:
            seen = self.records[name]
            since = max(seen) if seen else 0
        try:
            st = client.status(since, timeout_s=10)
        except AgentCallError as e:   # a busy refusal under the flood: ask again next time
            with self.lock:
                self.status_refusals[e.code.name] += 1
            return
        with self.lock:
            for r in st.steps:
                seen.setdefault(r.step, r)

    def last(self, name: str) -> int:
        """The last step seen of worker ``name`` (0: none yet)."""
        with self.lock:                # the monitor's thread adds records meanwhile
            return max(self.records[name], default=0)

    def run(self) -> None:
        while not self._halt.wait(self.period):
            self.poll()

    def stop(self) -> None:
        self._halt.set()
        self.join(30)

"""The local runner: a ``DynaTrainJob`` on this machine, with capacity changes from a scenario.

It plays the part the cluster plays for the operator: it starts worker processes
(``python -m dynatrain.agent.worker``, each an agent in standby), hosts the rendezvous store,
gives the controller core the workers' agents as they come up, turns scenario events into
capacity signals (a preemption notice now, the kill at the deadline; new workers), and shows
live progress. Everything else (which layout, when to switch, the switch itself) is the
controller core's and the agents' work, exactly as on a cluster.

Every worker's output goes to ``<run dir>/worker-<device>.log``; when a worker dies
unexpectedly the job stops and the tail of that log is shown.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from dynatrain.agent.client import AgentClient
from dynatrain.agent.metrics import REASONS, Metrics

from .core import JobController, JobFailed
from .hardware import DeviceProfile
from .job import JobSpec
from .orchestrator import Timeouts
from .policy import Policy
from .scenario import Event, Scenario

WORKER_START_TIMEOUT_S = 120.0


@dataclass
class WorkerProcess:
    device: int
    proc: subprocess.Popen
    log: Path
    agent: str = ""
    metrics: str = ""
    kill_at: float | None = None
    expected_exit: bool = False


@dataclass
class RunResult:
    job: str
    steps: int
    final_loss: float
    losses: dict[int, float]
    switches: list
    samples_consumed: int
    samples_exactly_once: bool
    wall_seconds: float
    layouts: list[str] = field(default_factory=list)
    recoveries: list = field(default_factory=list)
    """Switch records of the recoveries from unplanned failures (reason ``failure``)."""
    failures: list = field(default_factory=list)
    """(device, wall time) of every worker that died in the running layout."""

    def summary(self) -> dict:
        return {"job": self.job, "steps": self.steps, "final_loss": self.final_loss,
                "switches": [s.summary() for s in self.switches],
                "losses": [self.losses[k] for k in sorted(self.losses)],
                "samples_consumed": self.samples_consumed,
                "samples_exactly_once": self.samples_exactly_once,
                "recoveries": [s.summary() for s in self.recoveries],
                "failures": [{"device": d, "time": t} for d, t in self.failures],
                "wall_seconds": self.wall_seconds}


class LocalRunner:
    def __init__(self, job: JobSpec, job_path: str, scenario: Scenario, *, run_dir: Path,
                 profile: DeviceProfile, policy: Policy | None = None, out=print,
                 metrics_port: int = 0, prometheus_sd: str | None = None,
                 threads_per_worker: int = 0, timeouts: Timeouts = Timeouts(),
                 resume_from: str = "", restart_on_failure: bool = False,
                 worker_env: dict[int, dict[str, str]] | None = None):
        self.job, self.job_path, self.scenario = job, job_path, scenario
        self.run_dir, self.out = run_dir, out
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.token_file = run_dir / "agent-token"
        self.token_file.write_text(secrets.token_urlsafe(32))
        self.token_file.chmod(0o600)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeouts.group_s))
        self.metrics = Metrics(reasons=REASONS)
        _, self.metrics_port = self.metrics.serve(port=metrics_port)
        self.prometheus_sd = prometheus_sd
        self.controller = JobController(job, rendezvous=f"127.0.0.1:{self.store.port}",
                                        profile=profile, metrics=self.metrics, policy=policy,
                                        timeouts=timeouts, log=self._say)
        cores = os.cpu_count() or 1
        self.threads = threads_per_worker or max(1, cores // max(1, job.max_workers))
        self.workers: dict[int, WorkerProcess] = {}
        self.next_device = 0
        self.t0 = time.monotonic()
        # Locally the checkpoints live in the run directory, whatever spec.checkpoint.path says
        # (that is the claim's mount point in a worker pod).
        self.checkpoint_dir = str(run_dir / "checkpoints")
        self.controller.resume_from = resume_from or job.recovery.resume_from
        self.restart_on_failure = restart_on_failure
        self.controller.recover_in_memory = not restart_on_failure
        """Recover the old way, for comparison: stop every worker, start fresh ones from the
        newest checkpoint (``dynatrain bench chaos`` measures both)."""
        self.worker_env = worker_env or {}
        """Extra environment per device (fault injection in ``dynatrain bench chaos``)."""
        self.kills: list[tuple[int, float]] = []
        """(device, wall time) of every scenario kill."""
        self.restarts: list[tuple[int, float]] = []
        """(checkpoint step, wall time) of every checkpoint-and-restart."""
        self.failures: list[tuple[int, float]] = []
        """(device, wall time) of every worker that died in the running layout."""

    def _say(self, text: str) -> None:
        self.out(f"[{time.monotonic() - self.t0:6.1f}s] {text}")

    # -- workers -----------------------------------------------------------------------------
    def _spawn(self, count: int) -> list[int]:
        devices = []
        for _ in range(count):
            d = self.next_device
            self.next_device += 1
            ready = self.run_dir / f"worker-{d}.ready"
            ready.unlink(missing_ok=True)
            log = self.run_dir / f"worker-{d}.log"
            cmd = [sys.executable, "-m", "dynatrain.agent.worker", "--job", self.job_path,
                   "--device", str(d), "--token-file", str(self.token_file),
                   "--ready-file", str(ready), "--threads", str(self.threads),
                   "--parent-pid", str(os.getpid()), "--checkpoint-dir", self.checkpoint_dir]
            env = {**os.environ, **self.worker_env.get(d, {})}
            with open(log, "w") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env)
            self.workers[d] = WorkerProcess(d, proc, log)
            devices.append(d)
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        for d in devices:
            w = self.workers[d]
            ready = self.run_dir / f"worker-{d}.ready"
            while not ready.exists():
                if w.proc.poll() is not None:
                    raise JobFailed(f"worker {d} exited with code {w.proc.returncode} while "
                                    f"starting:\n{_tail(w.log)}")
                if time.monotonic() > deadline:
                    raise JobFailed(f"worker {d} did not start within "
                                    f"{WORKER_START_TIMEOUT_S:.0f} s:\n{_tail(w.log)}")
                time.sleep(0.05)
            info = json.loads(ready.read_text())
            w.agent = f"127.0.0.1:{info['agent_port']}"
            w.metrics = f"127.0.0.1:{info['metrics_port']}"
            client = AgentClient(w.agent, token_file=str(self.token_file))
            client.wait_healthy(30.0)
            self.controller.add_device(d, client)
        self._write_sd()
        return devices

    def _write_sd(self) -> None:
        """Prometheus file_sd targets: the controller and every live worker."""
        if not self.prometheus_sd:
            return
        targets = [{"targets": [f"127.0.0.1:{self.metrics_port}"],
                    "labels": {"role": "controller", "dynatrain_job": self.job.name}}]
        for w in self.workers.values():
            if w.proc.poll() is None and w.metrics:
                targets.append({"targets": [w.metrics],
                                "labels": {"role": "worker", "device": str(w.device),
                                           "dynatrain_job": self.job.name}})
        tmp = Path(self.prometheus_sd + ".tmp")
        tmp.write_text(json.dumps(targets))
        tmp.rename(self.prometheus_sd)

    def _check_workers(self) -> None:
        now = time.monotonic()
        for w in list(self.workers.values()):
            code = w.proc.poll()
            if code is None and w.kill_at is not None and now >= w.kill_at:
                self._say(f"worker {w.device}: notice expired, killed")
                w.proc.kill()
                w.proc.wait()
                code = w.proc.returncode
                w.expected_exit = True
            if code is None:
                continue
            in_layout = w.device in self.controller.members
            del self.workers[w.device]
            self._write_sd()
            if in_layout:
                self.failures.append((w.device, time.time()))
                if self.restart_on_failure:
                    self._restart(w.device, code)
                    return
                self.controller.fail_device(w.device, f"worker exited with code {code}; its "
                                            f"log ends:\n{_tail(w.log, 5)}")
                continue
            if code != 0 and not w.expected_exit:
                self._say(f"worker {w.device} (standing by) exited with code {code}; its log "
                          f"ends:\n{_tail(w.log, 5)}")
            self.controller.remove_device(w.device)

    def _restart(self, device: int, code) -> None:
        """Checkpoint-and-restart: every worker stops, fresh ones load the newest checkpoint."""
        from dynatrain.trainer.checkpoint import latest_checkpoint

        found = latest_checkpoint(self.checkpoint_dir)
        if found is None:
            raise JobFailed(f"worker {device} exited with code {code} and there is no "
                            f"checkpoint in {self.checkpoint_dir} to restart from")
        path, step = found
        self._say(f"worker {device} exited with code {code}: restarting every worker from "
                  f"checkpoint {path} (step {step})")
        count = len(self.controller.members)
        self.restarts.append((step, time.time()))
        self._stop_all()
        self.workers.clear()
        self.controller.restart_from(path, step)
        self._spawn(count)

    def _apply(self, event: Event) -> None:
        self._say(f"scenario at step {event.at_step}: {event.describe()}")
        if event.kind == "preempt":
            for d in event.workers:
                w = self.workers.get(d)
                if w is None:
                    self._say(f"  worker {d} is not running; nothing to preempt")
                    continue
                w.kill_at = time.monotonic() + event.notice_seconds
                w.expected_exit = True
                self.controller.notice(d, event.notice_seconds)
        elif event.kind == "kill":
            for d in event.workers:
                w = self.workers.get(d)
                if w is None:
                    self._say(f"  worker {d} is not running; nothing to kill")
                    continue
                w.proc.kill()           # no notice: the controller learns it from the exit
                self.kills.append((d, time.time()))
        elif event.kind == "join":
            new = self._spawn(event.count)
            self._say(f"  workers {new} up (standby)")
        else:
            self.controller.request_layout(event.layout)

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> RunResult:
        job, c = self.job, self.controller
        initial = self.scenario.initial_workers or job.workers or job.max_workers
        self._say(f"job {job.name}: {job.model.name}, {job.training.steps} steps, global batch "
                  f"{job.global_batch_size}, {initial} workers (elastic {job.min_workers}.."
                  f"{job.max_workers}); run dir {self.run_dir}")
        self._say(f"metrics: controller http://127.0.0.1:{self.metrics_port}/metrics")
        self._spawn(initial)
        events = list(self.scenario.events)
        last_print = 0.0
        try:
            while True:
                self._check_workers()
                record = c.tick()
                if self.restart_on_failure and c.failed:
                    self._restart(min(c.failed), "unknown (it stopped answering)")
                    continue
                if record is not None:
                    self._report_switch(record)
                p = c.progress
                while events and p.step >= events[0].at_step and c.layout is not None:
                    self._apply(events.pop(0))
                if p.finished:
                    break
                if p.loss is not None and time.monotonic() - last_print > 1.0:
                    last_print = time.monotonic()
                    self._say(f"step {p.step:>4}/{job.training.steps}  loss {p.loss:.4f}  "
                              f"{p.tokens_per_second:8,.0f} tok/s  {c.layout.to_text()}  "
                              f"({len(c.members)} workers)")
                time.sleep(0.05)
        finally:
            self._stop_all()
        return self._result()

    def _report_switch(self, r) -> None:
        if not r.from_layout:
            self._say(f"started {r.to_layout} on devices {list(self.controller.members)} "
                      f"(generation {r.generation})")
            return
        self._say(f"SWITCH {r.from_layout} -> {r.to_layout}  reason {r.reason}  at step "
                  f"{r.step}  pause {r.pause_seconds * 1e3:.1f} ms  "
                  f"{_mib(r.bytes)} MiB over the network ({_mib(r.bytes_local)} MiB local)  "
                  f"prepare {r.prepare_seconds:.2f} s in the background")

    def _stop_all(self) -> None:
        for w in self.workers.values():
            if w.proc.poll() is None:
                w.proc.terminate()
        for w in self.workers.values():
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        for client in self.controller.clients.values():
            client.close()

    def _result(self) -> RunResult:
        p = self.controller.progress
        steps = max(p.losses) if p.losses else 0
        first = p.first_step * self.job.global_batch_size
        total = steps * self.job.global_batch_size
        counts = [0] * max(0, total - first)
        for a, b in p.samples:
            for i in range(max(a, first), min(b, total)):
                counts[i - first] += 1
        once = bool(counts) and all(n == 1 for n in counts) and \
            sum(b - a for a, b in p.samples) == total - first
        return RunResult(self.job.name, steps, p.losses.get(steps, float("nan")), p.losses,
                         self.controller.switches, sum(b - a for a, b in p.samples), once,
                         time.monotonic() - self.t0, recoveries=self.controller.recoveries,
                         failures=self.failures)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:])


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"

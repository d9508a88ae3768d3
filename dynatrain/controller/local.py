"""The local runner: a ``DynaTrainJob`` on this machine, with capacity changes from a scenario.

It plays the part the cluster plays for the operator: it starts worker processes
(``dynatrain.agent.worker``, each an agent in standby; forked from a server that has torch
imported, or each a new interpreter: :mod:`.workerstart`), hosts the rendezvous store,
gives the controller core the workers' agents as they come up, turns scenario events into
capacity signals (a preemption notice now, the kill at the deadline; an eviction's SIGTERM,
which the worker itself reports; new workers), and shows
live progress. Everything else (which layout, when to switch, the switch itself) is the
controller core's and the agents' work, exactly as on a cluster.

Nothing here blocks the job: a joining worker is started and handed to the controller once its
agent is up, and the runner's :meth:`LocalRunner._sense` (new workers, exits, due scenario
events) also runs while a switch waits, so a signal is taken in within a step of its arrival
whatever is in flight.

Every worker's output goes to ``<run dir>/worker-<device>.log``; when a worker dies
unexpectedly the job stops and the tail of that log is shown.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


from dynatrain.agent.client import AgentClient
from dynatrain.agent.metrics import REASONS, Metrics
from dynatrain.agent.worker_control import DEFAULT_GRACE_S
from dynatrain.trainer.backend import visible_gpu

from . import decide
from . import inbox as ev
from .core import JobController, JobFailed
from dynatrain.spec.hardware import DeviceProfile
from dynatrain.spec.job import JobSpec
from .orchestrator import Timeouts
from .policy import Policy
from .rendezvous import RendezvousServer
from .scenario import Event, Scenario
from .workerstart import ForkedWorker, start_worker, worker_start_method

WORKER_START_TIMEOUT_S = 120.0


@dataclass
class WorkerProcess:
    device: int
    proc: subprocess.Popen | ForkedWorker
    log: Path
    agent: str = ""
    metrics: str = ""
    kill_at: float | None = None
    expected_exit: bool = False
    start_deadline: float = 0.0
    """Until the agent is up (``agent`` empty): when to give up on it."""


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
    data_problems: list = field(default_factory=list)
    """What the exactly-once audit found (each names the step and the samples)."""
    samples_inferred: int = 0
    """Samples counted from a restored state, their reader's report lost with it."""
    requests: list = field(default_factory=list)
    """Every requested layout and its answer (:class:`~.core.LayoutRequest`)."""
    events: list = field(default_factory=list)
    """Every scenario event: its step, and the step at which it was taken in."""
    decisions: list = field(default_factory=list)
    """Every switch or recovery the controller started (:attr:`.core.JobController.decisions`)."""
    started_at: float = 0.0
    """Wall time (Unix seconds) at which the run started: the summary's times count from it."""
    timeline: dict = field(default_factory=dict)
    """step -> (wall time at its end, tokens per second) (:attr:`.progress.Progress.timeline`)."""
    measurements: list = field(default_factory=list)
    """Each generation's measured step against the cost model (:mod:`.measured`)."""

    def summary(self) -> dict:
        return {"job": self.job, "steps": self.steps, "final_loss": self.final_loss,
                "switches": [self._timed(s) for s in self.switches],
                "losses": [self.losses[k] for k in sorted(self.losses)],
                "samples_consumed": self.samples_consumed,
                "samples_exactly_once": self.samples_exactly_once,
                "recoveries": [self._timed(s) for s in self.recoveries],
                "failures": [{"device": d, "time": t} for d, t in self.failures],
                "data_problems": self.data_problems,
                "samples_inferred": self.samples_inferred,
                "requests": [r.summary() for r in self.requests],
                "events": self.events,
                "decisions": self.decisions,
                "measurements": [m.summary() for m in self.measurements],
                "wall_seconds": self.wall_seconds,
                "step_log": self.step_log()}

    def _timed(self, record) -> dict:
        """A switch's summary with ``time``: seconds from the run's start to the switch."""
        return {**record.summary(), "time": round(record.wall_time - self.started_at, 6)}

    def step_log(self) -> list[dict]:
        """Every step's loss, tokens per second and the time its end was reported (seconds
        since the run started), in step order; a step trained again after a recovery shows
        its latest training."""
        out = []
        for step in sorted(self.losses):
            end, tps = self.timeline.get(step, (None, 0.0))
            out.append({"step": step, "loss": self.losses[step], "tokens_per_second": tps,
                        "time": None if end is None else round(end - self.started_at, 6)})
        return out


class LocalRunner:
    def __init__(self, job: JobSpec, job_path: str, scenario: Scenario, *, run_dir: Path,
                 profile: DeviceProfile, policy: Policy | None = None, out=print,
                 metrics_port: int = 0, prometheus_sd: str | None = None,
                 threads_per_worker: int = 0, timeouts: Timeouts | None = None,
                 resume_from: str = "", restart_on_failure: bool = False,
                 worker_env: dict[int, dict[str, str]] | None = None, backend: str = "auto",
                 save_hf: str = "", worker_start: str | None = None):
        self.job, self.job_path, self.scenario = job, job_path, scenario
        # How workers start (:mod:`.workerstart`): forked from a server that has torch
        # imported (the default), or each a new interpreter (the restart baseline's default).
        self.worker_start = worker_start_method(worker_start, restarts=restart_on_failure)
        # Where the trained model goes (spec.output.hf unless overridden); absolute, so it
        # means the same to every worker whatever its working directory.
        target = save_hf or job.save_hf
        self.save_hf = str(Path(target).resolve()) if target else ""
        self.run_dir, self.out = run_dir, out
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # The job's TensorBoard events: spec.output.tensorboard (absolute, as save_hf), else
        # the run dir's (a cluster's default, the checkpoint claim, has no local meaning).
        self.tensorboard = str(Path(job.tensorboard).resolve() if job.tensorboard
                               else (run_dir / "tensorboard").resolve())
        timeouts = timeouts or job.recovery.timeouts_config()      # spec.recovery.timeouts
        self.token_file = run_dir / "agent-token"
        self.token_file.write_text(secrets.token_urlsafe(32))
        self.token_file.chmod(0o600)
        self.store = RendezvousServer("127.0.0.1")
        self.metrics = Metrics(namespace=job.namespace, job=job.name, reasons=REASONS)
        _, self.metrics_port = self.metrics.serve(port=metrics_port)
        self.prometheus_sd = prometheus_sd
        self.controller = JobController(job, rendezvous=self.store.address,
                                        profile=profile, metrics=self.metrics, policy=policy,
                                        timeouts=timeouts, log=self._say)
        cores = os.cpu_count() or 1
        self.threads = threads_per_worker or max(1, cores // max(1, job.max_workers))
        # Workers that share this machine's cores in the solver's model (profile.shared_cores)
        # share them in fact: each takes cores // workers threads under every layout, so a
        # release or a shrink gives the survivors the cores the model said they would get.
        self.share_cores = 0 if threads_per_worker else profile.shared_cores
        self.workers: dict[int, WorkerProcess] = {}
        self.next_device = 0
        self.t0 = time.monotonic()
        self.started_at = time.time()
        # Locally the checkpoints live in the run directory, whatever spec.checkpoint.path says
        # (that is the claim's mount point in a worker pod): the workers' checkpoint root, in
        # which the job writes its own folder (<root>/<job>/step-N).
        self.checkpoint_dir = str(run_dir / "checkpoints")
        resume = resume_from or job.recovery.resume_from
        # Absolute: a worker reads a relative checkpoint path as relative to its checkpoint
        # root (as on a cluster), while the user meant this process's working directory.
        self.controller.resume_from = str(Path(resume).resolve()) if resume else ""
        self.checkpoint_sources = [self.controller.resume_from] if resume else []
        """Where else the workers may read a checkpoint from (``--checkpoint-source``): the
        user's own ``--resume-from`` checkpoint. A worker loads checkpoints only under its
        roots, whatever a Prepare names."""
        self.restart_on_failure = restart_on_failure
        self.controller.recover_in_memory = not restart_on_failure
        """Recover the old way, for comparison: stop every worker, start fresh ones from the
        newest checkpoint (``dynatrain bench chaos`` measures both)."""
        self.worker_env = worker_env or {}
        """Extra environment per device (fault injection in ``dynatrain bench chaos``)."""
        self.backend = backend
        """Every worker's ``--backend`` (``dynatrain run --backend``; auto: from the job)."""
        self.gpu_of: dict[int, int] = {}
        """Device -> the GPU (index among ours) its worker was given, for GPU workers."""
        self.kills: list[tuple[int, float]] = []
        """(device, wall time) of every scenario kill."""
        self.restarts: list[tuple[int, float]] = []
        """(checkpoint step, wall time) of every checkpoint-and-restart."""
        self.failures: list[tuple[int, float]] = []
        """(device, wall time) of every worker that died in the running layout."""
        self.events: list[Event] = []
        """Scenario events not yet due."""
        self.event_log: list[dict] = []
        self.controller.sense = self._sense
        self.grace_s = min([e.notice_seconds for e in scenario.events if e.kind == "evict"],
                           default=DEFAULT_GRACE_S)
        """What the workers report as their grace period once told to leave: the shortest
        of the scenario's evictions (a pod's is set when it starts, as on Kubernetes)."""

    def _say(self, text: str) -> None:
        self.out(f"[{time.monotonic() - self.t0:6.1f}s] {text}")

    def _prepare_data(self) -> None:
        """A text corpus is tokenised here, once, before any worker starts: the workers (and
        the ones that join later) then only map the cached token file. Token ids are checked
        against the model's vocabulary here too, so a mismatch stops the job before it starts."""
        from dynatrain.trainer.sources import prepare_and_check

        prepare_and_check(self.job.training, self.job.model.vocab_size, say=self._say)

    # -- workers -----------------------------------------------------------------------------
    def _spawn(self, count: int, *, wait: bool = True) -> list[int]:
        """Start ``count`` workers; each is handed to the controller once its agent is up
        (``wait``: before returning; otherwise by :meth:`_register_ready`, so a join never
        holds up the job while the new processes import torch)."""
        devices = []
        for _ in range(count):
            d = self.next_device
            self.next_device += 1
            ready = self.run_dir / f"worker-{d}.ready"
            ready.unlink(missing_ok=True)
            log = self.run_dir / f"worker-{d}.log"
            argv = ["--job", self.job_path,
                    "--device", str(d), "--token-file", str(self.token_file),
                    "--ready-file", str(ready), "--threads", str(self.threads),
                    "--share-cores", str(self.share_cores),
                    "--parent-pid", str(os.getpid()), "--checkpoint-dir", self.checkpoint_dir,
                    "--grace-seconds", f"{self.grace_s:g}"]
            for source in self.checkpoint_sources:
                argv += ["--checkpoint-source", source]
            if self.save_hf:
                argv += ["--save-hf", self.save_hf]
            argv += ["--tensorboard", self.tensorboard]
            env = {**os.environ, **self.worker_env.get(d, {})}
            argv += ["--backend", self.backend]
            if self.backend == "nccl" or (self.backend == "auto" and self.job.gpus_per_worker):
                # One GPU per worker, as a device plugin gives each pod its own: the lowest
                # that no live worker holds, and the only one the worker sees (its cuda:0).
                held = {self.gpu_of.get(w) for w in self.workers}
                self.gpu_of[d] = min(i for i in range(len(held) + 1) if i not in held)
                env["CUDA_VISIBLE_DEVICES"] = visible_gpu(self.gpu_of[d])
            proc = start_worker(argv, env, log, self.worker_start)
            self.workers[d] = WorkerProcess(d, proc, log, start_deadline=time.monotonic()
                                            + WORKER_START_TIMEOUT_S)
            devices.append(d)
        while wait and any(not self.workers[d].agent for d in devices if d in self.workers):
            self._register_ready(fatal=True)
            time.sleep(0.05)
        return devices

    def _register_ready(self, *, fatal: bool = False) -> None:
        """Hand every worker whose agent came up to the controller. A worker that exits or
        does not come up in time stops the job (``fatal``: the initial workers) or is
        reported and forgotten (a joiner: the job goes on without it)."""
        for w in list(self.workers.values()):
            if w.agent:
                continue
            ready = self.run_dir / f"worker-{w.device}.ready"
            problem = None
            if ready.exists():
                info = json.loads(ready.read_text())
                w.agent = f"127.0.0.1:{info['agent_port']}"
                w.metrics = f"127.0.0.1:{info['metrics_port']}"
                client = AgentClient(w.agent, token_file=str(self.token_file))
                client.wait_healthy(30.0)
                self.controller.push(ev.DeviceUp(w.device, client))
                self._say(f"worker {w.device} up (standby)")
                self._write_sd()
                continue
            if w.proc.poll() is not None:
                problem = f"exited with code {w.proc.returncode} while starting"
            elif time.monotonic() > w.start_deadline:
                problem = f"did not start within {WORKER_START_TIMEOUT_S:.0f} s"
                w.proc.kill()
                w.proc.wait()
            if problem is None:
                continue
            del self.workers[w.device]
            if fatal:
                raise JobFailed(f"worker {w.device} {problem}:\n{_tail(w.log)}")
            self._say(f"worker {w.device} {problem}; the job goes on without it:\n"
                      f"{_tail(w.log, 5)}")

    def _write_sd(self) -> None:
        """Prometheus file_sd targets: the controller and every live worker. The series carry
        the job's ``namespace`` and ``job`` themselves: scrape with ``honor_labels: true``, or
        Prometheus's own ``job`` label (the scrape config's name) takes that name."""
        if not self.prometheus_sd:
            return
        targets = [{"targets": [f"127.0.0.1:{self.metrics_port}"],
                    "labels": {"role": "controller"}}]
        for w in self.workers.values():
            if w.proc.poll() is None and w.metrics:
                targets.append({"targets": [w.metrics],
                                "labels": {"role": "worker", "device": str(w.device)}})
        tmp = Path(self.prometheus_sd + ".tmp")
        tmp.write_text(json.dumps(targets))
        tmp.rename(self.prometheus_sd)

    def _check_workers(self) -> None:
        now = time.monotonic()
        for w in list(self.workers.values()):
            if not w.agent:
                continue                           # starting: _register_ready watches it
            code = w.proc.poll()
            if code is None and w.kill_at is not None and now >= w.kill_at:
                self._say(f"worker {w.device}: notice expired, killed")
                w.proc.kill()
                w.proc.wait()
                code = w.proc.returncode
                w.expected_exit = True
            if code is None and w.device in self.controller.lost:
                # Declared failed while alive (hung): what a cluster does to its pod.
                self._say(f"worker {w.device}: declared failed by the controller; killed")
                w.proc.kill()
                w.proc.wait()
                code = w.proc.returncode
                w.expected_exit = True
            if code is None:
                continue
            del self.workers[w.device]
            self._write_sd()
            if w.device in self.controller.lost:
                self.failures.append((w.device, time.time()))
                self.controller.push(ev.DeviceLeft(w.device))
                continue
            if decide.exit_is_failure(member=w.device in self.controller.members,
                                      released=False, code=code):
                self.failures.append((w.device, time.time()))
                if self.restart_on_failure:
                    self._restart(w.device, code)
                    return
                self.controller.push(ev.DeviceFailed(
                    w.device, f"worker exited with code {code}; its log ends:\n"
                    f"{_tail(w.log, 5)}"))
                continue
            if code != 0 and not w.expected_exit:
                self._say(f"worker {w.device} (standing by) exited with code {code}; its log "
                          f"ends:\n{_tail(w.log, 5)}")
            self.controller.push(ev.DeviceLeft(w.device))

    def _restart(self, device: int, code) -> None:
        """Checkpoint-and-restart: every worker stops, fresh ones load the newest checkpoint."""
        from dynatrain.trainer.checkpoint import job_checkpoint_dir, latest_checkpoint

        found = latest_checkpoint(self.checkpoint_dir, self.job.name)
        if found is None:
            where = job_checkpoint_dir(self.checkpoint_dir, self.job.name)
            raise JobFailed(f"worker {device} exited with code {code} and there is no "
                            f"checkpoint in {where} to restart from")
        path, step = found
        self._restart_all(path, step, len(self.controller.members),
                          f"worker {device} exited with code {code}")

    def _restart_all(self, path: str, step: int, count: int, why: str) -> None:
        """Every worker stops; ``count`` fresh ones start from checkpoint ``path`` at ``step``
        ("" and 0: from scratch)."""
        self._say(f"{why}: restarting {count} workers from "
                  + (f"checkpoint {path} (step {step})" if path else "step 0 (no checkpoint)"))
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
                self.controller.push(ev.Notice(d, event.notice_seconds))
        elif event.kind == "evict":
            for d in event.workers:
                w = self.workers.get(d)
                if w is None or w.proc.poll() is not None:
                    self._say(f"  worker {d} is not running; nothing to evict")
                    continue
                # What the kubelet does to an evicted pod: SIGTERM, SIGKILL when the grace
                # period ends. The controller learns of it from the worker's Status alone.
                w.proc.send_signal(signal.SIGTERM)
                w.kill_at = time.monotonic() + event.notice_seconds
                w.expected_exit = True
        elif event.kind == "kill":
            for d in event.workers:
                w = self.workers.get(d)
                if w is None:
                    self._say(f"  worker {d} is not running; nothing to kill")
                    continue
                w.proc.kill()           # no notice: the controller learns it from the exit
                self.kills.append((d, time.time()))
        elif event.kind == "hang":
            for d in event.workers:
                w = self.workers.get(d)
                if w is None or w.proc.poll() is not None:
                    self._say(f"  worker {d} is not running; nothing to hang")
                    continue
                w.proc.send_signal(signal.SIGSTOP)   # alive, silent: the watchdog's case
                self.kills.append((d, time.time()))
        elif event.kind == "join":
            new = self._spawn(event.count, wait=False)
            self._say(f"  workers {new} starting")
        elif event.kind == "minEfficiency":     # a spec edit, as `kubectl edit` makes it
            self.job = dataclasses.replace(self.job, min_efficiency=event.value)
            self.controller.push(ev.SpecEdited(self.job))
        else:
            self.controller.push(ev.LayoutRequested(event.layout))

    def _release(self, devices) -> None:
        """Stop the workers a ``release`` switch left out, or a slow one a rebalance left out
        (as the operator deletes their pods): the machine's CPUs or GPUs go back to whatever
        else runs there."""
        c = self.controller
        for d in sorted(devices):
            w = self.workers.get(d)
            if w is not None and w.agent and w.proc.poll() is None and not w.expected_exit:
                self._say(f"worker {d}: " + ("left out (it computes slower than its peers)"
                                             if d in c.slow else
                                             "released (spec.elastic.minEfficiency)"))
                w.expected_exit = True
                w.proc.send_signal(signal.SIGTERM)

    def _apply_due_events(self) -> None:
        c = self.controller
        while self.events and c.progress.step >= self.events[0].at_step \
                and c.layout is not None:
            event = self.events.pop(0)
            self.event_log.append({"kind": event.kind, "at_step": event.at_step,
                                   "taken_step": c.progress.step,
                                   "workers": list(event.workers),
                                   "in_switch": c.switching,
                                   "time": time.time()})
            self._apply(event)

    def _sense(self) -> None:
        """Push what happened into the controller's inbox: workers that came up or exited,
        scenario events now due. The controller also calls it while a switch waits (and takes
        the events in after it)."""
        self._register_ready()
        if not self.restart_on_failure:        # a restart replaces every worker: not mid-switch
            self._check_workers()
        self._apply_due_events()

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> RunResult:
        job, c = self.job, self.controller
        initial = self.scenario.initial_workers or job.workers or job.max_workers
        self._say(f"job {job.name}: {job.model.name}, {job.training.steps} steps, global batch "
                  f"{job.global_batch_size}, {initial} workers (elastic {job.min_workers}.."
                  f"{job.max_workers}); run dir {self.run_dir}")
        self._say(f"metrics: controller http://127.0.0.1:{self.metrics_port}/metrics; "
                  f"TensorBoard: tensorboard --logdir {self.tensorboard}")
        self._prepare_data()
        self._spawn(initial)
        self.events = list(self.scenario.events)
        last_print = 0.0
        try:
            while True:
                self._register_ready()
                self._check_workers()
                record = c.tick()
                if self.restart_on_failure and c.failed:
                    self._restart(min(c.failed), "unknown (it stopped answering)")
                    continue
                if record is not None:
                    self._report_switch(record)
                    if record.reason == "release":
                        self._release(set(self.workers) - set(c.members))
                    self._release(c.slow - set(c.members))
                p = c.progress
                self._apply_due_events()
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
            self.store.close()
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
                w.proc.send_signal(signal.SIGINT)   # stop now (SIGTERM would be a notice)
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
        problems = p.audit(self.job.global_batch_size, steps)
        once = steps > p.first_step and not problems
        inferred = sum(b - a for spans in p.inferred.values() for a, b in spans)
        return RunResult(self.job.name, steps, p.losses.get(steps, float("nan")), p.losses,
                         self.controller.switches, sum(b - a for a, b in p.samples), once,
                         time.monotonic() - self.t0, recoveries=self.controller.recoveries,
                         failures=self.failures, data_problems=problems,
                         samples_inferred=inferred, requests=list(self.controller.requests),
                         events=self.event_log, decisions=self.controller.decisions,
                         started_at=self.started_at, timeline=dict(p.timeline),
                         measurements=[self.controller.measurements[g]
                                       for g in sorted(self.controller.measurements)])


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:])


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"

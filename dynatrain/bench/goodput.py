"""Goodput under a capacity trace: live switches side by side with restart-based elasticity, the
benchmark behind ``dynatrain bench goodput``.

The same job runs twice on this machine, one process per worker, each run in a process of its
own, and both see the same capacity trace at the same wall-clock offsets:

- live: DynaTrain's way. A preemption notice makes the controller switch the running
  layout off the doomed worker before its deadline; a kill without notice is recovered in
  place (buddy mirrors, else the newest checkpoint); a new worker starts in standby and the
  job grows onto it live once it is up.
- restart: the way Kubeflow's PyTorchJob, elastic torchrun and DLRover handle the same
  events. Every capacity change stops every worker; fresh processes start on the new capacity
  with the layout the solver picks and load the newest DCP checkpoint, taken every
  ``checkpointEvery`` steps. A preemption notice is not acted on (torchrun and Kubeflow do not
  watch for one): the workers train on until the doomed one is killed at its deadline, and
  that kill is what restarts the job. A join restarts the job at once to take in the new
  worker (elastic torchrun's membership change), as does a kill. Without a checkpoint yet, a
  restart starts from step 0.

Trace file (YAML):

  job: quickstart.yaml        # DynaTrainJob manifest, relative to the trace file
  steps: 240                  # optional: overrides spec.training.steps
  checkpointEvery: 20         # K: steps between DCP checkpoints, in both runs
  initialWorkers: 4           # optional: default spec.elastic.workers or maxWorkers
  events:                     # by atSeconds: seconds since the start of the job's first step
    - atSeconds: 5
      preempt: {count: 1, noticeSeconds: 5}   # notice now, the worker is killed at the deadline
    - atSeconds: 12
      kill: {count: 1}                        # killed without notice (kill -9)
    - atSeconds: 20
      join: {count: 1}                        # new worker(s) start

Events name how many workers, not which: the victims are the running layout's workers with
the highest device ids (the same rule in both runs). The workers in the job (those with a
notice no longer counted) must stay within spec.elastic.minWorkers..maxWorkers. An event
due while the job has no running layout (a restart under way) is applied once it has one.

Measures, per run, from the per-step wall-clock timestamps the workers report (each step's
start and end; every step trained, steps trained again included):

- goodput: wall time spent in steps that count / total wall. Total wall runs from the start
  of the first step to the end of the last (process start-up before the first step is the
  same in both runs and left out). Of the times a step was trained, only the last counts:
  steps trained after the newest checkpoint and trained again after a restart do not count,
  nor does time spent outside steps (restarts, process start-up, checkpoint loading and
  saving, switches, recoveries).
- steps lost: step trainings that were redone (a step trained three times counts two).
  In the restart run, each restart loses the steps since its checkpoint: steps reached minus
  checkpoint step.
- time to first step: for each event, from the moment it was applied (the notice, the kill,
  the join) to the end of the first step of the first layout the controller decided on after
  it (the live run's switch or recovery, the restart run's start after its restart). "-" when
  there was none before the job ended.
- ratio: live goodput / restart goodput.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from dynatrain.controller.inbox import Notice
from dynatrain.controller.scenario import ScenarioError

KINDS = ("preempt", "kill", "join")
MODES = ("live", "restart")


class TraceError(ScenarioError):
    """A trace file is not valid; the message names the event and field."""


@dataclass(frozen=True)
class TraceEvent:
    at_seconds: float
    kind: str
    count: int
    notice_seconds: float = 0.0

    def describe(self) -> str:
        if self.kind == "preempt":
            return f"preempt {self.count} ({self.notice_seconds:g} s notice)"
        return f"{self.kind} {self.count}"


@dataclass(frozen=True)
class Trace:
    job: Path
    checkpoint_every: int
    events: tuple[TraceEvent, ...]
    steps: int | None = None
    initial_workers: int | None = None
    source: str = "trace"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_trace(doc, *, source: str = "trace", base: Path = Path(".")) -> Trace:
    """A trace from its YAML document; every problem found is named in one :class:`TraceError`
    (``events[i].field``). ``base``: the directory ``job`` is relative to. The job itself is
    checked by :func:`load_trace`."""
    if not isinstance(doc, dict):
        raise TraceError(f"{source}: expected a mapping with job, checkpointEvery and events, "
                         f"got {type(doc).__name__}")
    problems = []
    unknown = set(doc) - {"job", "steps", "checkpointEvery", "initialWorkers", "events"}
    if unknown:
        problems.append(f"unknown keys {sorted(unknown)}; valid: job, steps, checkpointEvery, "
                        "initialWorkers, events")
    job = doc.get("job")
    if not isinstance(job, str) or not job:
        problems.append(f"job={job!r} must be the path of a DynaTrainJob manifest (relative to "
                        "the trace file)")
    every = doc.get("checkpointEvery")
    if not _is_int(every) or every < 1:
        problems.append(f"checkpointEvery={every!r} must be a positive integer (steps between "
                        "checkpoints)")
    for key in ("steps", "initialWorkers"):
        v = doc.get(key)
        if v is not None and (not _is_int(v) or v < 1):
            problems.append(f"{key}={v!r} must be a positive integer")
    raw = doc.get("events")
    if not isinstance(raw, list) or not raw:
        problems.append(f"events={raw!r} must be a non-empty list")
        raw = []
    events = []
    for i, e in enumerate(raw):
        where = f"events[{i}]"
        if not isinstance(e, dict):
            problems.append(f"{where} must be a mapping, got {e!r}")
            continue
        at = e.get("atSeconds")
        if not _is_number(at) or at < 0:
            problems.append(f"{where}.atSeconds={at!r} must be a number >= 0 (seconds since "
                            "the job's first step)")
            continue
        kinds = [k for k in KINDS if k in e]
        extra = set(e) - set(KINDS) - {"atSeconds"}
        if len(kinds) != 1 or extra:
            problems.append(f"{where} must have atSeconds and exactly one of "
                            f"{', '.join(KINDS)}"
                            + (f" (unknown keys {sorted(extra)})" if extra else ""))
            continue
        kind = kinds[0]
        value = e[kind]
        allowed = {"count", "noticeSeconds"} if kind == "preempt" else {"count"}
        shape = "{count: N, noticeSeconds: S}" if kind == "preempt" else "{count: N}"
        if not isinstance(value, dict):
            problems.append(f"{where}.{kind} must be {shape}, got {value!r}")
            continue
        if "workers" in value:
            problems.append(f"{where}.{kind}.workers: a trace names how many workers, not "
                            f"which: use {shape}")
            continue
        if set(value) - allowed:
            problems.append(f"{where}.{kind}: unknown keys {sorted(set(value) - allowed)}; "
                            f"expected {shape}")
            continue
        count = value.get("count")
        if not _is_int(count) or count < 1:
            problems.append(f"{where}.{kind}.count={count!r} must be a positive integer")
            continue
        notice = 0.0
        if kind == "preempt":
            notice = value.get("noticeSeconds")
            if not _is_number(notice) or notice <= 0:
                problems.append(f"{where}.preempt.noticeSeconds={notice!r} must be a positive "
                                "number")
                continue
        events.append(TraceEvent(float(at), kind, count, float(notice)))
    if problems:
        raise TraceError(f"{source}: " + "; ".join(problems))
    return Trace(base / job, every, tuple(sorted(events, key=lambda ev: ev.at_seconds)),
                 steps=doc.get("steps"), initial_workers=doc.get("initialWorkers"),
                 source=source)


def check_capacity(trace: Trace, initial: int, min_workers: int, max_workers: int) -> None:
    """The workers in the job after each event (a notice takes its workers out at once) must
    stay within ``min_workers..max_workers``."""
    problems, n = [], initial
    order = sorted(range(len(trace.events)), key=lambda i: trace.events[i].at_seconds)
    for i in order:
        ev = trace.events[i]
        n += ev.count if ev.kind == "join" else -ev.count
        if n < max(1, min_workers):
            problems.append(f"events[{i}].{ev.kind}.count={ev.count} at {ev.at_seconds:g} s "
                            f"leaves {n} workers, fewer than spec.elastic.minWorkers="
                            f"{max(1, min_workers)}")
        elif n > max_workers:
            problems.append(f"events[{i}].join.count={ev.count} at {ev.at_seconds:g} s makes "
                            f"{n} workers, more than spec.elastic.maxWorkers={max_workers}")
    if problems:
        raise TraceError(f"{trace.source}: " + "; ".join(problems))


def load_trace(path: str | Path) -> tuple[Trace, dict]:
    """The trace at ``path`` and the job manifest it runs (steps and checkpoint interval set
    from the trace), both checked."""
    from dynatrain.spec.job import KIND, job_from_manifest

    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file {str(path)!r} does not exist")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise TraceError(f"{path}: not valid YAML: {e}") from None
    trace = parse_trace(doc, source=str(path), base=path.parent)
    if not trace.job.is_file():
        raise TraceError(f"{path}: job={str(doc['job'])!r}: no such file ({trace.job})")
    docs = [d for d in yaml.safe_load_all(trace.job.read_text()) if isinstance(d, dict)]
    manifests = [d for d in docs if d.get("kind") == KIND]
    if not manifests:
        raise TraceError(f"{path}: job={str(doc['job'])!r} holds no {KIND}")
    manifest = json.loads(json.dumps(manifests[0]))
    spec = manifest.setdefault("spec", {})
    if trace.steps:
        spec.setdefault("training", {})["steps"] = trace.steps
    ck = spec.setdefault("checkpoint", {})
    ck.setdefault("claimName", "unused-locally")
    ck["intervalSteps"] = trace.checkpoint_every
    job = job_from_manifest(manifest, source=str(trace.job))
    if job.gpus_per_worker:
        raise TraceError(f"{path}: the goodput bench runs CPU workers; the job asks for "
                         f"{job.gpus_per_worker} GPU(s) per worker (spec.resources.gpus)")
    initial = trace.initial_workers or job.workers or job.max_workers
    check_capacity(trace, initial, job.min_workers, job.workers or job.max_workers)
    return replace(trace, initial_workers=initial), manifest


# -- accounting (pure) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StepSpan:
    """One training of one step: its number, its layout's generation, wall start and end."""
    step: int
    generation: int
    start: float
    end: float


def account(spans: list[StepSpan]) -> dict:
    """Goodput and steps lost of one run, from every step it trained.

    Of the trainings of a step only the last (by end time) counts; the others were redone
    (steps lost). Total wall: from the first step's start to the last step's end."""
    if not spans:
        return {"goodput": 0.0, "wall_seconds": 0.0, "counted_seconds": 0.0, "steps_lost": 0,
                "lost_seconds": 0.0, "steps": 0}
    last: dict[int, StepSpan] = {}
    for s in sorted(spans, key=lambda s: s.end):
        last[s.step] = s
    counted = sum(s.end - s.start for s in last.values())
    lost = [s for s in spans if last[s.step] is not s]
    wall = max(s.end for s in spans) - min(s.start for s in spans)
    return {"goodput": counted / wall if wall > 0 else 0.0, "wall_seconds": wall,
            "counted_seconds": counted, "steps_lost": len(lost),
            "lost_seconds": sum(s.end - s.start for s in lost), "steps": max(last)}


def time_to_first_step(at: float, spans: list[StepSpan], decisions: list[float]
                       ) -> float | None:
    """From ``at`` to the end of the first step trained by a layout that started after the
    controller's first decision after ``at`` (a switch, a recovery, or the start after a
    restart; ``decisions``: their wall times). A layout that trained no step (replaced at once
    by a later one) is passed over. None: no decision after ``at``, or no step after it."""
    decided = min((t for t in decisions if t >= at), default=None)
    if decided is None:
        return None
    firsts: dict[int, StepSpan] = {}
    for s in spans:
        f = firsts.get(s.generation)
        if f is None or s.step < f.step:
            firsts[s.generation] = s
    after = [f for f in firsts.values() if f.start >= decided]
    if not after:
        return None
    return min(after, key=lambda f: f.start).end - at


def restart_steps_lost(restarts: list[dict]) -> int:
    """What the checkpoint interval implies: each restart loses the steps between its
    checkpoint and the step the job had reached."""
    return sum(max(0, r["from_step"] - r["checkpoint_step"]) for r in restarts)


def summarize(raw: dict) -> dict:
    """One run's measures from what its process reported (``run_mode``'s output)."""
    spans = [StepSpan(*s) for s in raw.get("step_times", [])]
    out = {"mode": raw["mode"], "outcome": raw["outcome"], **account(spans)}
    t0 = raw.get("t_first") or 0.0
    events = []
    for e in raw.get("events", []):
        ttfs = time_to_first_step(e["applied_time"], spans, raw.get("decisions", []))
        events.append({**{k: v for k, v in e.items() if not k.endswith("_time")},
                       "applied_at_seconds": e["applied_time"] - t0,
                       "time_to_first_step": ttfs})
    out.update(events=events, events_not_applied=raw.get("not_applied", []),
               restarts=[{**{k: v for k, v in r.items() if k != "time"},
                          "at_seconds": r["time"] - t0, "steps_lost": max(
                              0, r["from_step"] - r["checkpoint_step"])}
                         for r in raw.get("restarts", [])],
               switches=raw.get("switches", 0), recoveries=raw.get("recoveries", 0),
               final_loss=raw.get("final_loss"), samples_exactly_once=raw.get("exactly_once"),
               process_seconds=raw.get("process_seconds"), message=raw.get("message", ""))
    return out


# -- one run, in a process of its own ------------------------------------------------------------
def _runner_class():
    from dynatrain.controller.local import LocalRunner

    class TraceRunner(LocalRunner):
        """The local runner, with events from a trace at wall-clock offsets, and, in the
        restart mode, a stop-everything restart from the newest checkpoint on every capacity
        change."""

        def __init__(self, *args, trace: Trace, mode: str, **kw):
            super().__init__(*args, **kw)
            self.controller.step_times = {}      # every step's wall start and end, kept
            self.mode = mode
            self.pending = list(enumerate(trace.events))
            self.capacity = self.scenario.initial_workers
            self.t_first: float | None = None
            self.applied: list[dict] = []
            self.restart_log: list[dict] = []
            self.restart_wanted = ""

        def _apply_due_events(self) -> None:
            c = self.controller
            if self.t_first is None:
                if not c.step_times:
                    return
                self.t_first = min(s for s, _ in c.step_times.values())
            while self.pending and c.layout is not None and not self.restart_wanted:
                i, ev = self.pending[0]
                now = time.time()
                if now - self.t_first < ev.at_seconds:
                    return
                self.pending.pop(0)
                self._say(f"trace event {i} at {ev.at_seconds:g} s: {ev.describe()}")
                victims = self._act(ev)
                self.applied.append({"index": i, "kind": ev.kind, "count": ev.count,
                                     "at_seconds": ev.at_seconds, "workers": victims,
                                     "step": c.progress.step, "applied_time": now})

        def _act(self, ev: TraceEvent) -> list[int]:
            c = self.controller
            if ev.kind == "join":
                self.capacity += ev.count
                if self.mode == "live":
                    return self._spawn(ev.count, wait=False)
                self.restart_wanted = f"{ev.count} worker(s) joined"
                return []
            alive = sorted(d for d in c.members if d in self.workers and d not in c.doomed
                           and self.workers[d].kill_at is None
                           and self.workers[d].proc.poll() is None)
            victims = alive[-ev.count:]
            self.capacity -= len(victims)
            for d in victims:
                w = self.workers[d]
                if ev.kind == "kill":
                    w.proc.kill()
                    self.kills.append((d, time.time()))
                    continue
                # At the deadline _check_workers kills it; the live run is told now.
                w.kill_at = time.monotonic() + ev.notice_seconds
                w.expected_exit = True
                if self.mode == "live":
                    c.push(Notice(d, ev.notice_seconds))
            return victims

        def _check_workers(self) -> None:
            if self.restart_wanted and not self.controller.switching:
                why, self.restart_wanted = self.restart_wanted, ""
                self._restart(None, None, why=why)
                return
            super()._check_workers()

        def _restart(self, device, code, why: str = "") -> None:
            from dynatrain.trainer.checkpoint import latest_checkpoint

            c = self.controller
            c.poll(judge=False)          # the survivors' last step records, before they stop
            reached = c.progress.step
            found = latest_checkpoint(self.checkpoint_dir, self.job.name)
            path, step = found if found is not None else ("", 0)
            why = why or f"worker {device} exited with code {code}"
            self.restart_log.append({"why": why, "from_step": max(reached, step),
                                     "checkpoint_step": step, "workers": self.capacity,
                                     "time": time.time()})
            self._restart_all(path, step, self.capacity, why)

    return TraceRunner


def run_mode(trace_path: str, mode: str, workdir: Path) -> dict:
    """Run the trace's job once here, ``mode`` live or restart; returns what happened."""
    from dynatrain.controller.core import JobFailed
    from dynatrain.spec.hardware import PROFILES
    from dynatrain.spec.job import load_job
    from dynatrain.controller.policy import Policy
    from dynatrain.controller.scenario import Scenario

    trace, manifest = load_trace(trace_path)
    job_path = workdir / "job.yaml"
    job_path.write_text(yaml.safe_dump(manifest))
    job = load_job(job_path)
    initial = trace.initial_workers

    def out(line: str) -> None:
        print(line, flush=True)

    runner = _runner_class()(
        job, str(job_path), Scenario(initial, ()), run_dir=workdir / "run",
        profile=PROFILES["cpu"], out=out,
        # No voluntary switch in the restart run: it changes layout only by restarting.
        policy=Policy() if mode == "live" else Policy(last_voluntary=float("inf")),
        restart_on_failure=mode == "restart", trace=trace, mode=mode,
        # Both runs start workers as new pods do, a fresh interpreter each: a live join's
        # start-up is part of what the two are compared on.
        worker_start="exec")
    t0 = time.monotonic()
    raw: dict = {"mode": mode}
    try:
        result = runner.run()
        raw.update(outcome="finished", steps=result.steps, final_loss=result.final_loss,
                   exactly_once=result.samples_exactly_once,
                   switches=sum(1 for s in result.switches if s.from_layout),
                   recoveries=len(result.recoveries))
    except JobFailed as e:
        raw.update(outcome="failed", message=str(e))
    c = runner.controller
    raw.update(step_times=[[step, gen, s, e] for (gen, step), (s, e)
                           in sorted(c.step_times.items())],
               t_first=runner.t_first, events=runner.applied,
               decisions=[d["time"] for d in c.decisions],
               not_applied=[i for i, _ in runner.pending], restarts=runner.restart_log,
               process_seconds=time.monotonic() - t0)
    return raw


def _spawn_mode(trace_path: str, mode: str, root: Path, timeout_s: float, say) -> dict:
    workdir = root / mode
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(workdir / "bench.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dynatrain.bench.goodput", "run",
                                 str(Path(trace_path).resolve()), mode, str(workdir)],
                                stdout=subprocess.PIPE, stderr=log, text=True,
                                start_new_session=True)
        timer = threading.Timer(timeout_s, _kill_group, (proc,))
        timer.daemon = True
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                say(f"  [{mode}] {line.rstrip()}")
            proc.wait()
        finally:
            timer.cancel()
    shutil.rmtree(workdir / "run" / "checkpoints", ignore_errors=True)
    path = workdir / "result.json"
    if not path.exists():
        why = (f"no result within {timeout_s:g} s" if time.monotonic() - t0 >= timeout_s
               else f"the run's process exited with {proc.returncode}")
        return {"mode": mode, "outcome": "error", "message": f"{why}; see {workdir}/bench.log"}
    return json.loads(path.read_text())


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass


def bench_goodput(trace_path: str, *, timeout_s: float = 1800.0, keep: str | None = None,
                  say=print) -> dict:
    """Both runs of the trace, one after the other, and their measures side by side."""
    trace, manifest = load_trace(trace_path)
    spec = manifest["spec"]
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="dynatrain-goodput-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    runs = {}
    for mode in MODES:
        say(f"{mode} run")
        raw = _spawn_mode(trace_path, mode, root, timeout_s, say)
        runs[mode] = summarize(raw) if raw["outcome"] != "error" else raw
    live, restart = runs["live"], runs["restart"]
    ratio = None
    if live.get("goodput") and restart.get("goodput"):
        ratio = live["goodput"] / restart["goodput"]
    out = {"trace": str(trace_path), "job": (manifest.get("metadata") or {}).get("name"),
           "model": (spec.get("model") or {}).get("preset"),
           "steps": (spec.get("training") or {}).get("steps"),
           "initial_workers": trace.initial_workers,
           "checkpoint_every": trace.checkpoint_every,
           "trace_events": [{"index": i, "at_seconds": e.at_seconds, "kind": e.kind,
                             "count": e.count, "notice_seconds": e.notice_seconds or None}
                            for i, e in enumerate(trace.events)],
           "live": live, "restart": restart, "goodput_ratio": ratio,
           "wall_seconds": time.monotonic() - t0}
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return out


def format_report(r: dict) -> str:
    """The human-readable table of :func:`bench_goodput`'s result."""
    live, restart = r["live"], r["restart"]

    def f(run, key, fmt):
        v = run.get(key)
        return "-" if v is None else format(v, fmt)

    rows = [("outcome", f(live, "outcome", ""), f(restart, "outcome", "")),
            ("goodput", f(live, "goodput", ".3f"), f(restart, "goodput", ".3f")),
            ("wall, first to last step (s)", f(live, "wall_seconds", ".1f"),
             f(restart, "wall_seconds", ".1f")),
            ("in steps that count (s)", f(live, "counted_seconds", ".1f"),
             f(restart, "counted_seconds", ".1f")),
            ("steps lost", f(live, "steps_lost", "d"), f(restart, "steps_lost", "d")),
            ("steps", f(live, "steps", "d"), f(restart, "steps", "d")),
            ("switches / recoveries", f"{live.get('switches', '-')} / "
             f"{live.get('recoveries', '-')}", "-"),
            ("restarts", str(len(live.get("restarts", []))),
             str(len(restart.get("restarts", []))))]
    lines = [f"goodput under {r['trace']}: {r['steps']} steps of {r['model']}, "
             f"{len(r['trace_events'])} events, checkpoint every {r['checkpoint_every']} steps",
             "", f"  {'':<30}{'live switches':>16}{'restart':>16}"]
    lines += [f"  {name:<30}{a:>16}{b:>16}" for name, a, b in rows]
    lines += ["", "  time to first step after each event (s):",
              f"  {'#':>3} {'at (s)':>7}  {'event':<26}{'live':>10}{'restart':>10}"]
    by = {m: {e["index"]: e for e in r[m].get("events", [])} for m in MODES}
    for e in r["trace_events"]:
        cells = []
        for m in MODES:
            got = by[m].get(e["index"])
            if got is None:
                cells.append("n/a")         # not applied: the job finished first
            elif got["time_to_first_step"] is None:
                cells.append("-")
            else:
                cells.append(f"{got['time_to_first_step']:.2f}")
        what = TraceEvent(e["at_seconds"], e["kind"], e["count"],
                          e["notice_seconds"] or 0.0).describe()
        lines.append(f"  {e['index']:>3} {e['at_seconds']:>7.1f}  {what:<26}"
                     f"{cells[0]:>10}{cells[1]:>10}")
    ratio = r.get("goodput_ratio")
    lines += ["", "  goodput ratio (live / restart): "
              + (f"{ratio:.2f}x" if ratio is not None else "-"),
              f"  bench wall time: {r['wall_seconds']:.0f} s"]
    for m in MODES:
        if r[m].get("message"):
            lines.append(f"  {m}: {r[m]['message'].splitlines()[0][:200]}")
    return "\n".join(lines)


def _main(argv: list[str]) -> int:
    """Child process: ``run TRACE MODE DIR``: one run, its result in ``DIR/result.json``."""
    trace_path, mode, workdir = argv
    wd = Path(workdir)
    raw = run_mode(trace_path, mode, wd)
    (wd / "result.json").write_text(json.dumps(raw))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "run" and sys.argv[3] in MODES:
        sys.exit(_main(sys.argv[2:]))
    print("usage: python -m dynatrain.bench.goodput run TRACE live|restart DIR "
          "(use `dynatrain bench goodput`)", file=sys.stderr)
    sys.exit(2)

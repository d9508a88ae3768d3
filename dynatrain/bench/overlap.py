"""Overlapping events: random scenarios of notices, evictions (SIGTERM), joins, requested
layouts, kills and hangs a few steps apart, each judged against the same job without events (``dynatrain bench chaos
--overlap N``, and the property test in ``tests/controller/test_overlap.py``).

A scenario (:func:`random_scenario`) is drawn from a seed: 3 to 6 events, most 0 to 2 steps
after the previous one, so each lands while the last is being handled (during a Prepare, a
Commit or a recovery). A run is one ``dynatrain run`` of :func:`job_manifest` with that
scenario. :func:`judge` names everything that is wrong with it:

- the losses differ from the run without events (more than 1e-5 relative, at any step);
- a sample of some step was not read exactly once (``samples_exactly_once`` and the audit);
- a requested layout was neither applied nor answered;
- a preemption notice, an eviction or a kill was acted on (a switch or recovery *started*: the
  controller's ``decisions``) more than one step after it was due, or a hang was not
  recovered within the watchdog plus ``HANG_SLACK_S``.

The job keeps a checkpoint every 4 steps: two kills a step apart can take a worker and the only
other copy of its state, and the checkpoint is then the honest way back (counted, not hidden).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

STEPS = 48
GLOBAL_BATCH = 12
WATCHDOG_S = 4.0
HANG_SLACK_S = 6.0
"""A hang is found by the watchdog and then recovered: this much beyond the watchdog."""
MAX_LATE_STEPS = 1
LAYOUTS = ("dp=2,tp=1,pp=1", "dp=1,tp=2,pp=1", "dp=1,tp=1,pp=2", "dp=3,tp=1,pp=1",
           "dp=2,tp=1,pp=2", "dp=1,tp=2,pp=2", "dp=4,tp=1,pp=1")
"""Layouts a scenario may request (every one divides the global batch of 12)."""


def job_manifest(*, steps: int = STEPS, max_workers: int = 5,
                 watchdog_s: float = WATCHDOG_S) -> dict:
    return {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": "overlap"},
            "spec": {"model": {"preset": "gpt-tiny"}, "resources": {"gpus": 0},
                     "elastic": {"minWorkers": 1, "maxWorkers": max_workers},
                     "parallelism": {"mode": "auto"}, "globalBatchSize": GLOBAL_BATCH,
                     "training": {"steps": steps, "seqLen": 32, "learningRate": 3e-4},
                     "checkpoint": {"claimName": "unused-locally", "path": "/checkpoints",
                                    "intervalSteps": 4},
                     "recovery": {"timeouts": {"statusSeconds": 1,
                                               "watchdogSeconds": watchdog_s}}}}


def random_scenario(seed: int, *, steps: int = STEPS, initial: int = 4,
                    max_workers: int = 5) -> dict:
    """3 to 6 events from ``seed``, never leaving fewer than two live workers, at most one
    hang; mostly 0-2 steps apart (deliberate overlaps), all before ``steps - 12``."""
    rng = random.Random(seed)
    alive, next_id, hung = list(range(initial)), initial, False
    # Workers certainly up and in the job: a joiner counts a few steps after its join (it
    # takes seconds to start), and a requested layout's leavers exit (a layout for w workers
    # leaves at most w). A removal needs more than two of them, so some always remain.
    sure, joining = initial, []
    events, step = [], rng.randint(6, 9)
    for _ in range(rng.randint(3, 6)):
        sure += sum(n for at, n in joining if at <= step)
        joining = [(at, n) for at, n in joining if at > step]
        kinds = ["layout"]
        if len(alive) > 2 and sure > 2:
            kinds += ["preempt", "evict", "kill", "kill"] + ([] if hung else ["hang"])
        if len(alive) < max_workers:
            kinds += ["join", "join"]
        kind = rng.choice(kinds)
        if kind == "join":
            count = rng.randint(1, min(2, max_workers - len(alive)))
            alive += list(range(next_id, next_id + count))
            next_id += count
            joining.append((step + 4, count))
            events.append({"atStep": step, "join": count})
        elif kind == "layout":
            layout = rng.choice(LAYOUTS)
            sure = min(sure, _world(layout))
            events.append({"atStep": step, "layout": layout})
        else:
            victim = rng.choice(alive)
            alive.remove(victim)
            sure -= 1
            hung = hung or kind == "hang"
            body = {"workers": [victim]}
            if kind == "preempt":
                body["noticeSeconds"] = 30
            elif kind == "evict":
                body["graceSeconds"] = 30
            events.append({"atStep": step, kind: body})
        step += rng.choice([0, 1, 1, 2, 2, 3])
        if step > steps - 12:
            break
    return {"initialWorkers": initial, "events": events}


def run(workdir: Path, name: str, job: dict, scenario: dict | None, *,
        timeout_s: float = 600.0, env: dict | None = None, backend: str = "") -> dict:
    """One ``dynatrain run`` (its workers on ``backend`` if given); its summary with
    ``stdout``, ``returncode`` and ``wall``."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, summary = workdir / f"{name}-job.yaml", workdir / f"{name}.json"
    job_path.write_text(yaml.safe_dump(job))
    cmd = [sys.executable, "-m", "dynatrain", "run", str(job_path), "--summary-json",
           str(summary), "--run-dir", str(workdir / name), "--cooldown", "0"]
    if backend:
        cmd += ["--backend", backend]
    if scenario is not None:
        (workdir / f"{name}-scenario.yaml").write_text(yaml.safe_dump(scenario))
        cmd += ["--scenario", str(workdir / f"{name}-scenario.yaml")]
    summary.unlink(missing_ok=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **(env or {})})
        stdout, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout, code = f"{e.stdout or ''}\n(timed out after {timeout_s:.0f} s)", -1
    out = json.loads(summary.read_text()) if summary.is_file() else {}
    out.update(stdout=stdout if isinstance(stdout, str) else stdout.decode(),
               returncode=code, wall=time.monotonic() - t0)
    return out


def judge(out: dict, reference: dict, *, steps: int = STEPS,
          watchdog_s: float = WATCHDOG_S) -> list[str]:
    """Everything wrong with a run with events (empty: it passed)."""
    if out.get("returncode") != 0 or "losses" not in out:
        tail = "\n".join(out.get("stdout", "").splitlines()[-15:])
        return [f"the run exited {out.get('returncode')}:\n{tail}"]
    problems = []
    if out["steps"] != steps:
        problems.append(f"trained {out['steps']} steps, not {steps}")
    for k, (a, b) in enumerate(zip(out["losses"], reference["losses"]), start=1):
        if abs(a - b) > 1e-5 * abs(b):
            problems.append(f"step {k}: loss {a} differs from {b} without events")
            break
    if not out["samples_exactly_once"] or out["data_problems"]:
        problems.append("data not read exactly once: " + "; ".join(out["data_problems"][:3]))
    for req in out["requests"]:
        if req["state"] not in ("applied", "waiting", "superseded", "refused") \
                or not req["answer"]:
            problems.append(f"layout request {req['layout']} left {req['state']} without "
                            f"an answer")
    problems += [f"{ev['kind']} due at step {ev['at_step']} {why}"
                 for ev, why in lateness(out, watchdog_s) if why]
    return problems


def lateness(out: dict, watchdog_s: float = WATCHDOG_S) -> list[tuple[dict, str]]:
    """(event, what was late about it or "") for every event."""
    found = []
    for ev in out["events"]:
        why = ""
        if ev["taken_step"] - ev["at_step"] > MAX_LATE_STEPS:
            why = f"was taken in at step {ev['taken_step']}"
        elif ev["kind"] in ("preempt", "evict", "kill", "hang") and ev["workers"]:
            act = next((d for d in out["decisions"] if d["time"] >= ev["time"]
                        and not set(ev["workers"]) & set(d["devices"])), None)
            victim_member = _member_at(out, ev)
            if act is None and victim_member:
                why = "was never acted on"
            elif act is not None and victim_member:
                if ev["kind"] == "hang":
                    if act["time"] - ev["time"] > watchdog_s + HANG_SLACK_S:
                        why = (f"was recovered {act['time'] - ev['time']:.1f} s later "
                               f"(watchdog {watchdog_s:g} s)")
                elif act["step"] - ev["at_step"] > MAX_LATE_STEPS:
                    why = f"was acted on at step {act['step']}"
        ev["late"] = why
        found.append((ev, why))
    return found


def _member_at(out: dict, ev: dict) -> bool:
    """Whether the event's worker was in the job's layout when the event came (a standby or
    starting worker's loss needs no switch)."""
    before = [d for d in out["decisions"] if d["time"] <= ev["time"]]
    return bool(before) and bool(set(ev["workers"]) & set(before[-1]["devices"]))


def _world(layout: str) -> int:
    sizes = dict(part.split("=") for part in layout.split(","))
    return int(sizes["dp"]) * int(sizes["tp"]) * int(sizes["pp"])


def bench_overlap(trials: int, *, seed: int = 0, steps: int = STEPS, timeout_s: float = 600.0,
                  keep: str | None = None, say=print) -> dict:
    """``trials`` random scenarios and one reference run; figures and every problem."""
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="dynatrain-overlap-"))
    job = job_manifest(steps=steps)
    say(f"reference run (no events), {steps} steps ...")
    reference = run(root, "reference", job, None, timeout_s=timeout_s)
    if reference.get("returncode") != 0:
        raise RuntimeError("the reference run failed:\n" + reference.get("stdout", "")[-3000:])
    results = []
    for i in range(trials):
        scenario = random_scenario(seed + i, steps=steps)
        kinds = [next(k for k in e if k != "atStep") for e in scenario["events"]]
        say(f"trial {i}: " + ", ".join(f"{k}@{e['atStep']}"
                                       for k, e in zip(kinds, scenario["events"])))
        out = run(root, f"trial-{i}", job, scenario, timeout_s=timeout_s)
        problems = judge(out, reference, steps=steps)
        late = [ev["taken_step"] - ev["at_step"] for ev in out.get("events", [])]
        acted = [d["step"] for d in out.get("decisions", [])]
        results.append({
            "trial": i, "seed": seed + i, "events": kinds, "passed": not problems,
            "problems": problems, "switches": len(out.get("switches", [])),
            "recoveries": len(out.get("recoveries", [])),
            "from_checkpoint": sum(1 for r in out.get("recoveries", [])
                                   if r["phases"].get("from_checkpoint")),
            "requests": [r["state"] for r in out.get("requests", [])],
            "events_in_switch": sum(1 for ev in out.get("events", []) if ev["in_switch"]),
            "max_intake_steps_late": max(late, default=0), "decision_steps": acted,
            "samples_inferred": out.get("samples_inferred", 0),
            "wall_seconds": round(out["wall"], 1)})
        say(f"  {'passed' if not problems else 'FAILED: ' + '; '.join(problems)} "
            f"({results[-1]['switches']} switches, {results[-1]['recoveries']} recoveries, "
            f"{out['wall']:.0f} s)")
    walls = [r["wall_seconds"] for r in results]
    return {"trials": trials, "passed": sum(r["passed"] for r in results),
            "events": sum(len(r["events"]) for r in results),
            "events_in_switch": sum(r["events_in_switch"] for r in results),
            "recoveries": sum(r["recoveries"] for r in results),
            "recoveries_from_checkpoint": sum(r["from_checkpoint"] for r in results),
            "requests_answered": sum(len(r["requests"]) for r in results),
            "max_intake_steps_late": max((r["max_intake_steps_late"] for r in results),
                                         default=0),
            "reference_wall_seconds": round(reference["wall"], 1),
            "wall_seconds_median": statistics.median(walls) if walls else None,
            "workdir": str(root), "results": results}

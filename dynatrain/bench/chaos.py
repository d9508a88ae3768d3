"""Kill workers of a running job at random points and judge every trial: the benchmark behind
``dynatrain bench chaos``.

Each trial is a real local job (``dynatrain run``'s runner, one process per worker, in a
process of its own with a time limit) that loses a worker without notice at a random point:

- ``step``: SIGKILL of a random member while it trains (one worker, or a worker and its buddy
  at once: then no mirror survives and the job falls back on its checkpoint if any state was
  unique);
- ``prepare``: the victim dies inside its background preparation of a switch;
- ``transfer``: the victim dies as the switch's transfer starts.

A trial is then judged: **recovered** when training went on to the last step and the state the
recovery restored equals, bit for bit, a failure-free run of the same job at the restored step
(every tensor and state kind, step and data position; the failure-free runs are made once per
layout after the trials); a **clean failure** when the job stopped with a message that says
why; **hung** when the trial passed its time limit; **corrupted** when the restored state
differs. MTTR is the time from the kill to the end of the first step after the recovery.

For comparison, ``--restart-trials`` trials recover the old way: every worker stops and fresh
ones load the newest checkpoint (one per step, the best case for a restart).

Under ``--backend nccl-sim`` every trial also counts the workers that the simulated
ProcessGroupNCCL watchdog took down (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 1 or 3: an op past
its timeout aborts the process) or whose communicator it aborted (2, CleanUpOnly): after a kill
a survivor must be freed by the recovery's abort of the failed generation, not by its op timing
out (``watchdog_kills``, ``watchdog_aborts``; from the workers' logs). ``--first-trial N`` runs
trials N.. of the seeded plan, so that two runs (on two backends, say) split one plan.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

LAYOUTS = ("dp=4", "dp=2,pp=2", "dp=2,tp=2,zero=1", "tp=2,pp=2", "dp=4,zero=1")
"""Initial layouts of the trials: replicated state, pipelines, ZeRO shards, and no DP at all
(every byte unique: only the mirrors can save it)."""
SWITCH_TO = {"dp=4": "dp=2,tp=2", "dp=2,pp=2": "dp=4", "dp=2,tp=2,zero=1": "tp=2,pp=2",
             "tp=2,pp=2": "dp=2,pp=2", "dp=4,zero=1": "dp=2,pp=2"}
"""The switch in flight when a ``prepare`` or ``transfer`` kill lands."""
KINDS = ("step", "prepare", "transfer")
WATCHDOG_KILL = "[nccl-sim watchdog]"
"""What :mod:`dynatrain.vps.ncclsim`'s watchdog prints before it takes a process down."""
WATCHDOG_ABORT = "the watchdog aborted the communicator"
"""The error of an op whose communicator the watchdog aborted (CleanUpOnly); the worker prints
it when its generation is interrupted."""


@dataclass
class TrialSpec:
    index: int
    kind: str
    """step | prepare | transfer | restart | reference"""
    layout: str
    victims: list[int] = field(default_factory=list)
    at_step: int = 0
    steps: int = 16
    checkpoint_every: int = 4
    dump_steps: list[int] = field(default_factory=list)
    """Reference runs only: the steps whose state to keep."""
    global_batch_size: int = 8
    seq_len: int = 32
    check_state: bool = True
    """Dump the restored state for the bit-for-bit check (False: a timing-only trial, whose
    recovery does not pay for writing it; ``benchmarks/vs_torchft.py``)."""
    limits: dict = field(default_factory=dict)
    """``spec.parallelism.limits`` (empty: none), e.g. maxTP/maxPP 1 for pure DP."""
    backend: str = "gloo"
    """The workers' backend: ``gloo``, or ``nccl-sim`` for NCCL's failure semantics (the
    bit-for-bit references always run on gloo)."""


@dataclass
class TrialResult:
    index: int
    kind: str
    layout: str
    victims: list[int]
    outcome: str = ""
    """recovered | clean_failure | hung | corrupted | error"""
    message: str = ""
    restored_step: int | None = None
    restored_from: str = ""
    """memory | checkpoint | restart"""
    mttr_seconds: float | None = None
    new_layout: str = ""
    steps: int = 0
    seconds: float = 0.0
    watchdog_killed: list[int] = field(default_factory=list)
    """Devices the (simulated) NCCL watchdog took down in this trial; always empty on gloo."""
    watchdog_aborted: list[int] = field(default_factory=list)
    """Devices whose communicator the watchdog aborted (an op of theirs passed its timeout)."""


def watchdog_victims(run_dir: Path) -> tuple[list[int], list[int]]:
    """(devices taken down, devices whose communicator was aborted) by the nccl-sim watchdog,
    from the workers' logs in ``run_dir`` (``worker-<device>.log``)."""
    killed, aborted = [], []
    for log in sorted(Path(run_dir).glob("worker-*.log")):
        try:
            device = int(log.stem.split("-", 1)[1])
            text = log.read_text(errors="replace")
        except (ValueError, OSError):
            continue
        if WATCHDOG_KILL in text:
            killed.append(device)
        if WATCHDOG_ABORT in text:
            aborted.append(device)
    return sorted(killed), sorted(aborted)


def _manifest(spec: TrialSpec) -> dict:
    return {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": f"chaos-{spec.index}"},
            "spec": {"model": {"preset": "gpt-tiny"},
                     "elastic": {"minWorkers": 1, "maxWorkers": 4},
                     "parallelism": {"mode": "auto", "layout": spec.layout,
                                     **({"limits": spec.limits} if spec.limits else {})},
                     "globalBatchSize": spec.global_batch_size,
                     "training": {"steps": spec.steps, "seqLen": spec.seq_len,
                                  "learningRate": 3e-4},
                     "recovery": {"mirror": True},
                     "checkpoint": {"claimName": "unused-locally",
                                    "intervalSteps": spec.checkpoint_every}}}


# -- one trial, in a process of its own ---------------------------------------------------------
def run_trial(spec: TrialSpec, workdir: Path) -> dict:
    """Run one trial here (the bench runs this in a child process); returns what happened."""
    import yaml

    from dynatrain.controller.core import JobFailed
    from dynatrain.controller.inbox import LayoutRequested
    from dynatrain.spec.hardware import PROFILES
    from dynatrain.spec.job import load_job
    from dynatrain.controller.local import LocalRunner
    from dynatrain.controller.policy import Policy
    from dynatrain.controller.scenario import Event, Scenario
    from dynatrain.vps.layout import parse_layout

    job_path = workdir / "job.yaml"
    job_path.write_text(yaml.safe_dump(_manifest(spec)))
    job = load_job(job_path)
    events = []
    env: dict[int, dict[str, str]] = {}
    if spec.kind in ("step", "restart"):
        events.append(Event(spec.at_step, "kill", workers=tuple(spec.victims)))
    elif spec.kind in ("prepare", "transfer"):
        events.append(Event(spec.at_step, "layout",
                            layout=parse_layout(SWITCH_TO[spec.layout])))
        point = "prepare,skip:1" if spec.kind == "prepare" else "transfer"
        env[spec.victims[0]] = {"DYNATRAIN_FAULT": f"device:{spec.victims[0]},at:{point}"}
    dumps = workdir / "dumps"
    common = {"DYNATRAIN_FAULT_LOG": str(workdir / "faults.jsonl")}
    if spec.check_state:
        common["DYNATRAIN_DUMP_RESTORED"] = str(dumps)
    if spec.dump_steps:
        common["DYNATRAIN_DUMP_STEPS"] = ",".join(map(str, spec.dump_steps))
    lines: list[str] = []
    runner = LocalRunner(job, str(job_path), Scenario(4, tuple(events)), run_dir=workdir / "run",
                         profile=PROFILES["cpu"], policy=Policy(cooldown_s=1e9),
                         out=lines.append, restart_on_failure=spec.kind == "restart",
                         backend=spec.backend,
                         worker_env={d: {**common, **env.get(d, {})} for d in range(8)})
    # Layout fixed at start (auto mode would re-plan after the start); recoveries pick freely.
    runner.controller.push(LayoutRequested(parse_layout(spec.layout)))
    runner.controller.step_times = {}         # every step's wall times (a short job: small)
    out: dict = {"log": lines}
    try:
        result = runner.run()
    except JobFailed as e:
        out.update(outcome="clean_failure", message=str(e))
        return out
    out.update(outcome="finished", steps=result.steps,
               exactly_once=result.samples_exactly_once,
               recoveries=[r.summary() | {"generation": r.generation} for r in result.recoveries],
               first_step_end={str(k): v for k, v in runner.controller.first_step_end.items()},
               step_times=[[g, k, a, b] for (g, k), (a, b)
                           in sorted(runner.controller.step_times.items())],
               kills=[{"device": d, "time": t} for d, t in runner.kills],
               faults=_read_jsonl(workdir / "faults.jsonl"),
               restarts=[{"step": s, "time": t} for s, t in runner.restarts])
    return out


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- the bench ----------------------------------------------------------------------------------
def plan_trials(n: int, seed: int, steps: int, first: int = 0) -> list[TrialSpec]:
    """A reproducible mix: every kind and layout, kills between the first checkpoint and a few
    steps before the end; every fifth step-kill takes a worker and its buddy together.
    ``first``: trials ``first .. first+n-1`` of the plan (the first ``first`` left out), so
    two runs can split one plan."""
    from dynatrain.trainer.redundancy import buddy_map
    from dynatrain.vps.layout import parse_layout

    rng = random.Random(seed)
    trials = []
    for i in range(first + n):
        kind = KINDS[i % len(KINDS)]
        layout = LAYOUTS[(i // len(KINDS)) % len(LAYOUTS)]
        victim = rng.randrange(4)
        victims = [victim]
        if kind == "step" and i % 5 == 4:
            lay = parse_layout(layout).with_devices(range(4))
            victims.append(buddy_map(lay)[victim])
        trials.append(TrialSpec(i, kind, layout, sorted(set(victims)),
                                at_step=rng.randrange(3, steps - 5), steps=steps))
    return trials[first:]


def _spawn_trial(spec: TrialSpec, root: Path, timeout_s: float, *, keep: bool = False
                 ) -> tuple[dict | None, float]:
    workdir = root / f"trial-{spec.index}-{spec.kind}"
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "spec.json").write_text(json.dumps(asdict(spec)))
    t0 = time.monotonic()
    with open(workdir / "trial.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dynatrain.bench.chaos", "trial",
                                 str(workdir)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return None, time.monotonic() - t0
    if not keep:       # the trial's checkpoints are not needed once it is over (disk)
        shutil.rmtree(workdir / "run" / "checkpoints", ignore_errors=True)
    path = workdir / "result.json"
    if not path.exists():
        return {"outcome": "error", "message": f"trial process exited with {proc.returncode}; "
                f"see {workdir / 'trial.log'}"}, time.monotonic() - t0
    return json.loads(path.read_text()), time.monotonic() - t0


def _load_states(paths: list[Path]):
    from dynatrain.trainer.state import assemble_full
    from dynatrain.trainer.state_io import read_state
    from dynatrain.vps.presets import PRESETS

    # The workers' dumps (agent.worker_loop._dump_state) are safetensors + JSON: nothing in
    # them is unpickled.
    return assemble_full(PRESETS["gpt-tiny"], [read_state(p)[0] for p in paths])


def _judge(spec: TrialSpec, raw: dict | None, seconds: float, root: Path) -> TrialResult:
    r = TrialResult(spec.index, spec.kind, spec.layout, spec.victims, seconds=seconds)
    if raw is None:
        r.outcome, r.message = "hung", f"no result within the trial's time limit ({seconds:.0f} s)"
        return r
    if raw["outcome"] != "finished":
        r.outcome, r.message = raw["outcome"], raw.get("message", "")
        return r
    r.steps = raw["steps"]
    kill_times = [k["time"] for k in raw["kills"]] + [f["time"] for f in raw["faults"]]
    if spec.kind == "restart":
        if not raw["restarts"] or not kill_times:
            r.outcome, r.message = "error", "no restart happened"
            return r
        r.restored_step, r.restored_from = raw["restarts"][0]["step"], "restart"
        ends = [t for t in raw["first_step_end"].values() if t > min(kill_times)]
        r.mttr_seconds = min(ends) - min(kill_times) if ends else None
        r.outcome = "recovered"
        return r
    if not raw["recoveries"]:
        r.outcome, r.message = "error", ("the job finished without a recovery (the kill did not "
                                         "land)" if not kill_times else "no recovery recorded")
        return r
    rec = raw["recoveries"][0]
    r.restored_step = rec["step"]
    r.new_layout = rec["to"]
    r.restored_from = "checkpoint" if rec["phases"].get("from_checkpoint") else "memory"
    end = raw["first_step_end"].get(str(rec["generation"]))
    if end is not None and kill_times:
        r.mttr_seconds = end - min(kill_times)
    if not raw["exactly_once"] or r.steps != spec.steps:
        r.outcome = "corrupted"
        r.message = f"finished at step {r.steps} of {spec.steps}; samples exactly once: " \
                    f"{raw['exactly_once']}"
        return r
    r.outcome = "recovered"   # the state check comes after the reference runs
    return r


def _check_states(results: list[TrialResult], specs: list[TrialSpec], root: Path,
                  timeout_s: float, say, jobs: int = 1) -> None:
    """Failure-free runs, one per initial layout (``jobs`` at a time), keep the states at the
    restored steps; each recovered trial's restored state must equal them bit for bit."""
    import torch

    want: dict[str, set[int]] = {}
    for r in results:
        if r.outcome == "recovered" and r.kind != "restart":
            want.setdefault(r.layout, set()).add(r.restored_step)
    refs = [TrialSpec(10_000 + n, "reference", layout, steps=specs[0].steps,
                      dump_steps=sorted(steps))
            for n, (layout, steps) in enumerate(sorted(want.items()))]
    for spec in refs:
        say(f"reference run under {spec.layout} (steps {spec.dump_steps})")
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        raws = list(pool.map(lambda spec: _spawn_trial(spec, root, timeout_s)[0], refs))
    for spec, raw in zip(refs, raws):
        layout = spec.layout
        ref_dir = root / f"trial-{spec.index}-reference" / "dumps"
        for r in results:
            if r.layout != layout or r.outcome != "recovered" or r.kind == "restart":
                continue
            if raw is None or raw["outcome"] != "finished":
                r.outcome, r.message = "error", "the failure-free reference run failed"
                continue
            ref = _load_states(sorted(ref_dir.glob(
                f"step{r.restored_step}-rank*.safetensors")))
            spec_r = next(s for s in specs if s.index == r.index)
            dumps = root / f"trial-{spec_r.index}-{spec_r.kind}" / "dumps"
            gen = min(int(p.name.split("-")[0][3:])
                      for p in dumps.glob("gen*-rank*.safetensors"))
            got = _load_states(sorted(dumps.glob(f"gen{gen}-rank*.safetensors")))
            bad = [k for k, t in ref.tensors.items()
                   if k not in got.tensors or not torch.equal(t, got.tensors[k])]
            if bad or (got.step, got.data_position) != (ref.step, ref.data_position):
                r.outcome = "corrupted"
                r.message = (f"restored state differs from the failure-free run at step "
                             f"{r.restored_step}: {len(bad)} tensors differ (first: {bad[:1]}); "
                             f"step/position {got.step}/{got.data_position} vs "
                             f"{ref.step}/{ref.data_position}")


def bench_chaos(trials: int, *, seed: int = 0, steps: int = 16, restart_trials: int = 3,
                timeout_s: float = 240.0, keep: str | None = None, say=print,
                backend: str = "gloo", first: int = 0, jobs: int = 1) -> dict:
    """Run the plan's trials (``jobs`` at a time), check every recovered state against the
    failure-free references, and sum up (the JSON of ``dynatrain bench chaos``)."""
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="dynatrain-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    specs = [replace(s, backend=backend) for s in plan_trials(trials, seed, steps, first)]
    rng = random.Random(seed + 1)
    specs += [TrialSpec(first + trials + i, "restart", "dp=2,pp=2", [rng.randrange(4)],
                        at_step=rng.randrange(3, steps - 5), steps=steps, checkpoint_every=1)
              for i in range(restart_trials)]
    t0 = time.monotonic()

    def trial(spec: TrialSpec) -> TrialResult:
        raw, seconds = _spawn_trial(spec, root, timeout_s, keep=bool(keep))
        r = _judge(spec, raw, seconds, root)
        r.watchdog_killed, r.watchdog_aborted = watchdog_victims(
            root / f"trial-{spec.index}-{spec.kind}" / "run")
        say(f"trial {spec.index:>3} {spec.kind:<8} {spec.layout:<17} kill {spec.victims} at "
            f"step {spec.at_step:>2}: {r.outcome}"
            + (f", restored step {r.restored_step} ({r.restored_from}) -> {r.new_layout}"
               if r.restored_step is not None else "")
            + (f", MTTR {r.mttr_seconds:.2f} s" if r.mttr_seconds is not None else "")
            + (f", watchdog took down {r.watchdog_killed}" if r.watchdog_killed else "")
            + (f", watchdog aborted {r.watchdog_aborted}" if r.watchdog_aborted else "")
            + (f"  [{r.message.splitlines()[0][:160]}]" if r.message else ""))
        return r

    # Trials are independent jobs (their own processes, ports and directories); side by side
    # they share the machine's cores, which stretches MTTR figures but not the verdicts.
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(trial, specs))
    _check_states(results, specs, root, timeout_s, say, jobs)
    chaos = [r for r in results if r.kind != "restart"]
    restart = [r.mttr_seconds for r in results if r.kind == "restart" and r.mttr_seconds]
    mttr = [r.mttr_seconds for r in chaos if r.outcome == "recovered" and r.mttr_seconds]
    from_memory = [r.mttr_seconds for r in chaos if r.outcome == "recovered"
                   and r.restored_from == "memory" and r.mttr_seconds]
    out = {"trials": len(chaos),
           "recovered": sum(r.outcome == "recovered" for r in chaos),
           "clean_failures": sum(r.outcome == "clean_failure" for r in chaos),
           "hung": sum(r.outcome == "hung" for r in chaos),
           "corrupted": sum(r.outcome == "corrupted" for r in chaos),
           "errors": sum(r.outcome == "error" for r in chaos),
           "recovered_from_memory": sum(r.outcome == "recovered" and r.restored_from == "memory"
                                        for r in chaos),
           "recovered_from_checkpoint": sum(r.outcome == "recovered"
                                            and r.restored_from == "checkpoint" for r in chaos),
           "mttr_seconds_median": statistics.median(mttr) if mttr else None,
           "mttr_memory_seconds_median": statistics.median(from_memory) if from_memory else None,
           "restart_mttr_seconds": statistics.median(restart) if restart else None,
           # Every trial's, restarts included: workers lost to the NCCL watchdog (nccl-sim).
           "watchdog_kills": sum(len(r.watchdog_killed) for r in results),
           "watchdog_aborts": sum(len(r.watchdog_aborted) for r in results),
           "backend": backend,
           "wall_seconds": time.monotonic() - t0,
           "results": [asdict(r) for r in results]}
    if out["mttr_memory_seconds_median"] and out["restart_mttr_seconds"]:
        out["speedup"] = out["restart_mttr_seconds"] / out["mttr_memory_seconds_median"]
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _trial_main(workdir: str) -> int:
    """Child process: run the trial in ``workdir`` and write ``result.json``."""
    wd = Path(workdir)
    spec = TrialSpec(**json.loads((wd / "spec.json").read_text()))
    watchdog = threading.Timer(3600, lambda: os._exit(3))
    watchdog.daemon = True
    watchdog.start()
    out = run_trial(spec, wd)
    (wd / "result.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "trial":
        sys.exit(_trial_main(sys.argv[2]))
    print("usage: python -m dynatrain.bench.chaos trial DIR (use `dynatrain bench chaos`)",
          file=sys.stderr)
    sys.exit(2)

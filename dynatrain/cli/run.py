"""``dynatrain run JOB.yaml``: an elastic job with live switches on this machine, no cluster.

The controller core's local runner (``dynatrain.controller.local``) does the work; this module
checks the command-line values, picks the solver's device model and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

from dynatrain.cli.errors import UsageError
from dynatrain.cli.report import check_out_dir

EPILOG = """\
examples:
  dynatrain run examples/quickstart.yaml --scenario examples/scenario.yaml
  dynatrain run examples/quickstart.yaml --summary-json summary.json
  dynatrain run examples/quickstart.yaml --scenario examples/scenario.yaml --report runs/demo

A scenario lists capacity changes by step (see examples/scenario.yaml):
  events:
    - {atStep: 15, preempt: {workers: [3], noticeSeconds: 30}}
    - {atStep: 20, evict: {workers: [2], graceSeconds: 30}}   # SIGTERM, as Kubernetes
    - {atStep: 30, join: 1}
    - {atStep: 45, layout: "dp=1,tp=2,pp=2"}
    - {atStep: 50, kill: {workers: [1]}}     # no notice: recovered from memory
    - {atStep: 60, hang: {workers: [2]}}     # SIGSTOP: found by the watchdog
Timeouts (spec.recovery.timeouts, seconds): statusSeconds 2 < watchdogSeconds 8 <
collectiveSeconds 60 <= prepareSeconds 60 < commitSeconds 120 < giveUpSeconds 600.
"""


def register(sub) -> None:
    p = sub.add_parser(
        "run", help="run a DynaTrainJob manifest on this machine, with live switches",
        description="Run a DynaTrainJob manifest (the YAML the operator accepts) with worker "
        "processes on this machine: each worker is a trainer with its gRPC agent; the "
        "controller core picks the layout for the workers at hand and switches it live as "
        "capacity changes (from --scenario). Prints live progress, one line per switch and "
        "a summary.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", metavar="JOB.yaml", help="DynaTrainJob manifest")
    p.add_argument("--scenario", metavar="FILE", help="capacity changes (YAML)")
    p.add_argument("--summary-json", metavar="FILE",
                   help="write switches, steps, losses and final loss as JSON")
    p.add_argument("--report", metavar="DIR",
                   help="after the run, draw its picture into DIR/<job>-run.png (DIR is made "
                   "if missing): loss and tokens/s by step and wall time, each switch and "
                   "recovery marked, the summary beside them; `dynatrain report` redraws it "
                   "from a --summary-json file")
    p.add_argument("--run-dir", metavar="DIR",
                   help="worker logs and the agent token (default: a new temporary dir)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="controller's Prometheus port (default: any free port)")
    p.add_argument("--prometheus-sd", metavar="FILE",
                   help="keep a Prometheus file_sd target list of the controller and workers "
                   "(scrape it with honor_labels: true: the series' own `job` label is the "
                   "DynaTrainJob's name)")
    p.add_argument("--device-profile", default="per-worker", metavar="P",
                   help="the solver's device model: 'per-worker' (default: this machine's "
                        "cores measured, each worker counted as a device of its own, as pods "
                        "on a cluster would be), 'shared' (workers share this machine's "
                        "cores: the honest model for this machine, which favours few "
                        "workers), or a preset (h100, a100, cpu)")
    p.add_argument("--cooldown", type=float, default=10.0,
                   help="seconds between voluntary switches (default 10)")
    p.add_argument("--margin", type=float, default=1.10,
                   help="estimated speedup a voluntary switch needs (default 1.10)")
    p.add_argument("--resume-from", metavar="CHECKPOINT",
                   help="start from this checkpoint (written under any layout): a "
                        "step-NNNNNNNN directory, a job's folder of them (the newest is "
                        "taken), or a checkpoint root of job folders (this job's, else the "
                        "only one); overrides spec.recovery.resumeFrom. The workers may read "
                        "it (--checkpoint-source) besides the run's own checkpoints")
    p.add_argument("--restart-on-failure", action="store_true",
                   help="recover from a worker that dies the old way, for comparison: stop "
                        "every worker and start fresh ones from the newest checkpoint "
                        "(default: recover live from the in-memory copies)")
    p.add_argument("--save-hf", metavar="OUT", default="",
                   help="when the job completes, write the trained model to OUT as a Hugging "
                        "Face checkpoint (config.json + safetensors; overrides "
                        "spec.output.hf)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo", "nccl-sim"), default="auto",
                   help="the workers' backend: auto (default) is NCCL with one GPU per worker "
                        "when spec.resources.gpus is 1, gloo on the CPU when 0; nccl fails "
                        "unless CUDA is available; gloo runs a GPU job on the CPU; nccl-sim "
                        "runs on the CPU with NCCL's failure semantics (a test harness)")
    p.add_argument("--worker-start", choices=("forkserver", "exec"), default=None,
                   help="how workers start: forkserver (default) forks each from one server "
                        "that has imported torch (a worker is up in about a second, not "
                        "after ~5 s of CPU each); exec starts each as a new interpreter. "
                        "Default: $DYNATRAIN_WORKER_START, else forkserver (exec with "
                        "--restart-on-failure, whose restarts stand for new pods)")
    p.set_defaults(func=run_job)


def run_job(args) -> int:
    if args.report is not None:
        check_out_dir(args.report, "--report")     # now, not after the whole job has trained
    from dynatrain.controller.calibrate import measure_cpu_profile
    from dynatrain.controller.core import JobFailed
    from dynatrain.spec.hardware import PROFILES
    from dynatrain.spec.job import load_job
    from dynatrain.controller.local import LocalRunner
    from dynatrain.controller.policy import Policy
    from dynatrain.controller.scenario import Scenario, load_scenario

    job = load_job(args.job)
    scenario = load_scenario(args.scenario) if args.scenario else Scenario(None, ())
    if job.suspend:
        raise UsageError(f"{args.job}: spec.suspend is true: a suspended job does not run "
                         "(on a cluster the operator keeps it checkpointed without pods); set "
                         "it to false to run it here, with --resume-from to continue from "
                         "its checkpoint")
    if job.gpus_per_worker > 1:
        raise UsageError(f"spec.resources.gpus={job.gpus_per_worker}: the local runner runs "
                         "one device per worker; use gpus: 0 (CPU) or 1")
    backend = _backend(args.backend, job)
    if args.device_profile in ("per-worker", "shared"):
        profile = measure_cpu_profile()
        if args.device_profile == "per-worker":
            profile = replace(profile, shared_cores=0,
                              memory_bytes=profile.memory_bytes // max(1, job.max_workers),
                              name="cpu (one device per worker)")
    elif args.device_profile in PROFILES:
        profile = PROFILES[args.device_profile]
    else:
        raise UsageError(f"--device-profile={args.device_profile!r}; valid: per-worker, shared, "
                         f"{', '.join(PROFILES)}")
    if args.margin < 1.0 or args.cooldown < 0:
        raise UsageError(f"--margin={args.margin} must be >= 1 and --cooldown={args.cooldown} "
                         ">= 0")
    run_dir = Path(args.run_dir) if args.run_dir else None
    resume = args.resume_from or job.recovery.resume_from
    if resume and not args.resume_from and job.recovery.checkpoint_dir \
            and not Path(resume).is_absolute():
        # A relative spec.recovery.resumeFrom names a checkpoint under the job's checkpoint
        # root, as on a cluster (there: the claim's mount); locally the root is the run's.
        if run_dir is None:
            raise UsageError(f"spec.recovery.resumeFrom={resume!r} is relative to the "
                             "checkpoint root, which locally is <run dir>/checkpoints: give "
                             "--run-dir, or --resume-from with the checkpoint's path")
        resume = str(run_dir / "checkpoints" / resume)
    if resume:
        from dynatrain.trainer.checkpoint import CheckpointPathError, latest_checkpoint

        if not (Path(resume) / ".metadata").is_file():
            try:
                found = latest_checkpoint(resume, job.name) if Path(resume).is_dir() else None
            except CheckpointPathError as e:
                raise UsageError(f"--resume-from: {e}") from None
            if found is None:
                raise UsageError(f"--resume-from={resume!r} is not a checkpoint (a directory "
                                 "with DCP .metadata) nor a directory holding step-* "
                                 "checkpoints (directly or in a job's folder)")
            resume = found[0]
    if args.restart_on_failure and not job.recovery.checkpoint_interval:
        raise UsageError("--restart-on-failure needs checkpoints: set "
                         "spec.checkpoint.intervalSteps in the job")
    save_hf = args.save_hf or job.save_hf
    if save_hf and Path(save_hf).exists() and (not Path(save_hf).is_dir()
                                                or any(Path(save_hf).iterdir())):
        # Found now, not after the whole job has trained.
        raise UsageError(f"the model's output {save_hf!r} (--save-hf / spec.output.hf) exists "
                         "and is not an empty directory; choose a new one")
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="dynatrain-"))
    runner = LocalRunner(job, args.job, scenario, run_dir=run_dir, profile=profile,
                         policy=Policy(margin=args.margin, cooldown_s=args.cooldown),
                         metrics_port=args.metrics_port, prometheus_sd=args.prometheus_sd,
                         resume_from=resume or "",
                         restart_on_failure=args.restart_on_failure, backend=backend,
                         save_hf=save_hf, worker_start=args.worker_start)
    try:
        result = runner.run()
    except JobFailed as e:
        print(f"dynatrain run: job {job.name} failed: {e}")
        return 1
    _print_summary(result)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(result.summary(), indent=2))
    exported = True
    if save_hf:
        exported = (Path(save_hf) / "config.json").is_file()
        if exported:
            print(f"  model: written to {save_hf} (Hugging Face format: transformers loads it)")
        else:
            print(f"  model: NOT written to {save_hf}: the rank-0 worker's log in {run_dir} "
                  "says why")
    drawn = True
    if args.report is not None:
        from dynatrain.controller.report import write_report

        try:
            print(f"  report: {write_report(result.summary(), args.report)}")
        except OSError as e:     # the run's numbers are printed above; the picture alone failed
            print(f"  report: NOT written to {args.report}: {e}")
            drawn = False
    return 0 if result.samples_exactly_once and exported and drawn else 1


def _backend(requested: str, job) -> str:
    """The workers' backend, checked here before any worker starts: a GPU job needs CUDA and
    one GPU per worker on this machine (each worker gets its own)."""
    from dynatrain.trainer.backend import BackendError, asked_for, job_backend, require_cuda

    try:
        backend = job_backend(requested, job.gpus_per_worker)
        if backend == "nccl":
            require_cuda(asked_for(requested, job.gpus_per_worker), count=job.max_workers)
    except BackendError as e:
        raise UsageError(str(e)) from None
    return backend


def _print_summary(r) -> None:
    print()
    print(f"job {r.job}: {r.steps} steps in {r.wall_seconds:.1f} s, final loss "
          f"{r.final_loss:.4f}, {len(r.switches)} switches")
    if r.switches:
        print(f"  {'step':>5}  {'reason':<13} {'from':<22} {'to':<22} {'pause':>9} "
              f"{'network':>10}")
        for s in r.switches:
            print(f"  {s.step:>5}  {s.reason:<13} {s.from_layout:<22} {s.to_layout:<22} "
                  f"{s.pause_seconds * 1e3:7.1f}ms {s.bytes / 2**20:7.2f}MiB")
    for rec in r.recoveries:
        lost = int(rec.phases.get("lost_steps", 0))
        where = "checkpoint" if rec.phases.get("from_checkpoint") else "memory"
        print(f"  recovery at step {rec.step} from {where}: {rec.from_layout} -> "
              f"{rec.to_layout}, {rec.phases.get('recovery_seconds', 0):.2f} s, "
              f"{lost} step(s) trained again")
    for req in r.requests:
        print(f"  layout request {req.layout.to_text()} (step {req.step}): {req.state}: "
              f"{req.answer}")
    verdict = "each exactly once" if r.samples_exactly_once else "NOT exactly once"
    inferred = (f" ({r.samples_inferred} counted from a restored state: their reader died "
                "before reporting them)" if r.samples_inferred else "")
    print(f"  data: {r.samples_consumed} samples consumed, {verdict}{inferred}")
    for problem in r.data_problems[:10]:
        print(f"    {problem}")
    if len(r.data_problems) > 10:
        print(f"    ... and {len(r.data_problems) - 10} more (--summary-json has them all)")

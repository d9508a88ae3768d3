"""One training process: the reference trainer, driven by the agent that runs beside it.

The process starts in *standby*: the agent serves (gRPC and metrics), no state is held, torch's
lazy setup has been paid. Everything else arrives through the agent:

- ``Prepare(g, layout, devices, rendezvous)`` starts the background work of generation ``g``
  (:meth:`DeviceManager.prepare`: plan, rounds, the transition group, the new layout's
  groups) while the training loop keeps stepping. The first generation has no old layout: its
  preparation only builds the groups, and its commit builds a fresh trainer from the seed.
- ``Commit(g)`` is answered by the training loop at a step boundary. With ``at_step = 0`` the
  boundary is agreed without guessing: every rank adds 1 to the step's own loss all-reduce once
  it holds the commit (``Trainer.train_step(signal=...)``), so all ranks see the same sum at the
  same step and switch together right after it. Joiners hold no state and enter the switch at
  once; the transfer's first collective waits for the old world to arrive.
- A device that leaves in a switch answers its Commit, lingers until its last Status has been
  read (or a few seconds), and exits 0.
- SIGTERM is a notice, not a stop: on Kubernetes every planned removal (``kubectl delete pod``,
  an eviction, a drain, a spot shutdown) arrives as SIGTERM with a grace period. A member
  trains on, says ``leaving`` in its Status, and exits once a switch has taken it out of the
  job; only if the grace period runs out first is it killed (a failure, recovered). SIGINT
  stops at the next step boundary.
- ``--backend auto`` (the default) trains with NCCL on the pod's GPU (``cuda:0`` of the visible
  ones, or ``--cuda-device`` / ``LOCAL_RANK``) when the job asks for ``spec.resources.gpus >=
  1``, with gloo on the CPU when it asks for none (:mod:`dynatrain.trainer.backend`). A GPU
  asked for where CUDA is unavailable stops the worker at start with one line and exit code 2:
  it never falls back to the CPU silently.

RPCs run on the gRPC server's threads and only exchange small messages with the training loop
under a lock, so an RPC (good or bad) never blocks or crashes a step. The agent's side is
:mod:`dynatrain.agent.worker_control`, the training loop :mod:`dynatrain.agent.worker_loop`;
:class:`Worker` owns one of each (the loop holds a reference to the control, whose state the
two share), and the agent serves its ``control``. This module is the process around them
(``python -m dynatrain.agent.worker``): its command line, torch's warm-up, the agent's
servers, signals and the watch on the parent process.

On a cluster the agent serves mutual TLS from the job's Secret (``--tls-dir``; the caller's
certificate must name ``--tls-client-name``) with the bearer token as a second factor, and the
health service alone on a plaintext ``--health-port`` for the kubelet's probe. A Prepare's
rendezvous store must be on the caller's own address (or an ``--allow-rendezvous`` host), and
its checkpoint under ``--checkpoint-dir`` or a ``--checkpoint-source``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from dynatrain.spec.hardware import cpu_quota, threads_for_quota
from dynatrain.spec.job import JobSpec, load_job
from dynatrain.trainer.backend import (BACKENDS, NCCL_CLEAN_UP_ONLY, NCCL_ERROR_HANDLING,
                                       BackendError, asked_for, cuda_index, job_backend,
                                       nccl_error_handling, torch_device)
from dynatrain.trainer.trainer import warm_up
from dynatrain.vps import faults

from .auth import DEFAULT_CLIENT_NAME, AuthConfigError
from .metrics import REASONS, Metrics
from .server import serve
from .worker_control import DEFAULT_GRACE_S, WorkerControl
from .worker_loop import TrainingLoop


class Worker:
    """One worker, in two parts: :attr:`control`, its state and the agent's Control over it
    (served on the gRPC threads), and :attr:`loop`, the training loop over that state (the
    main thread), which holds a reference to the control."""

    def __init__(self, job: JobSpec, device: int, *, backend: str = "gloo",
                 metrics: Metrics | None = None, torch_device: torch.device | None = None,
                 checkpoint_dir: str = "", save_hf: str = "",
                 checkpoint_sources: tuple[str, ...] | list[str] = (),
                 tensorboard_dir: str = "", log_every: int = 0, share_cores: int = 0,
                 min_step_s: float = 0.0):
        self.control = WorkerControl(job, device, backend=backend, metrics=metrics,
                                     torch_device=torch_device, checkpoint_dir=checkpoint_dir,
                                     checkpoint_sources=checkpoint_sources)
        self.loop = TrainingLoop(self.control, save_hf=save_hf,
                                 tensorboard_dir=tensorboard_dir, log_every=log_every,
                                 share_cores=share_cores, min_step_s=min_step_s)

    def run(self) -> int:
        """Run the training loop on this thread until it ends; the process's exit code."""
        return self.loop.run()

    def stop(self) -> None:
        """:meth:`TrainingLoop.stop`: end at the next step boundary (signal-safe)."""
        self.loop.stop()

    def leave(self) -> None:
        """:meth:`TrainingLoop.leave`: told to leave, a notice (signal-safe)."""
        self.loop.leave()


def _watch_parent(pid: int, worker: Worker) -> None:
    """Stop when the runner that started us is gone (killed with no chance to stop us), so a
    crashed runner leaves no workers training on."""
    def watch():
        while os.getppid() == pid:
            time.sleep(1.0)
        print(f"device {worker.control.device}: parent process {pid} is gone; stopping",
              flush=True)
        worker.stop()
        time.sleep(10)
        os._exit(1)                   # the training loop did not stop in time (a hung wait)

    threading.Thread(target=watch, name="dynatrain-parent-watch", daemon=True).start()


def fit_threads_to_cpu_limit(device: int, quota: float | None = None) -> int:
    """Without --threads: torch's one thread per core, unless this process's cgroup limits it
    to fewer cores (a pod's ``limits.cpu``), then the limit's whole cores
    (:func:`dynatrain.spec.hardware.cpu_quota` says why). Returns the threads set."""
    quota = cpu_quota() if quota is None else quota
    default = torch.get_num_threads()
    threads = threads_for_quota(quota, default)
    if threads < default:
        print(f"device {device}: {threads} torch thread(s) for a CPU limit of {quota:g} "
              f"cores (torch's default here: {default})", flush=True)
        torch.set_num_threads(threads)
    return threads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="dynatrain worker",
        description="One training process with its agent (started by `dynatrain run` or the "
                    "operator's worker pods). It waits in standby until the controller "
                    "prepares and commits a generation that includes it.")
    parser.add_argument("--job", required=True, help="the DynaTrainJob manifest (YAML)")
    parser.add_argument("--device", type=int, required=True, help="this worker's device id")
    parser.add_argument("--host", default="127.0.0.1", help="address the agent binds")
    parser.add_argument("--metrics-host", default="", metavar="ADDR",
                        help="address the Prometheus endpoint binds (default: --host); in a "
                             "pod 0.0.0.0, so that `kubectl port-forward`, which connects to "
                             "the pod's loopback, reaches it too")
    parser.add_argument("--agent-port", type=int, default=0, help="gRPC port (0: any free)")
    parser.add_argument("--metrics-port", type=int, default=0, help="metrics port (0: any)")
    parser.add_argument("--token-file", help="file holding the callers' bearer token")
    parser.add_argument("--insecure", action="store_true",
                        help="accept unauthenticated callers (tests on loopback only)")
    parser.add_argument("--tls-dir", metavar="DIR",
                        help="serve mutual TLS: DIR/tls.crt and DIR/tls.key are the serving "
                             "certificate, callers need a certificate signed by "
                             "DIR/client-ca.crt; the files are re-read when they change "
                             "(a rotated Secret needs no restart)")
    parser.add_argument("--tls-client-name", default=DEFAULT_CLIENT_NAME, metavar="NAME",
                        help="with --tls-dir, the name (subject CN or DNS SAN) the caller's "
                             "certificate must carry (default: %(default)s)")
    parser.add_argument("--health-port", type=int, default=0, metavar="PORT",
                        help="also serve the gRPC health service, and only it, in plaintext "
                             "on PORT, for the kubelet's probe (it has no client certificate); "
                             "0 (default): no separate health port")
    parser.add_argument("--allow-rendezvous", action="append", default=[], metavar="HOST",
                        help="a rendezvous host a Prepare may name besides the caller's own "
                             "address (repeatable; for NAT or a service mesh)")
    parser.add_argument("--ready-file", help="write {agent_port, metrics_port, health_port, "
                        "pid} here once serving")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0, the default: torch's, one per core this "
                             "process may run on, or fewer under a CPU limit: the limit's "
                             "whole cores, at least one)")
    parser.add_argument("--share-cores", type=int, default=0, metavar="N",
                        help="the job's workers share this machine's N cores (the local "
                             "runner's --device-profile shared): use N // workers threads "
                             "under each layout, reset at every switch (0, the default: "
                             "--threads stays)")
    parser.add_argument("--min-step-seconds", type=float, default=0.0, metavar="S",
                        help="a floor on each training step's wall time: a faster step idles "
                             "the rest (a Commit ends the wait at once). For "
                             "workers that stand in for GPUs on a shared CPU, as the dev "
                             "cluster's --gpu-pods-on-cpu runs them (default 0: none)")
    parser.add_argument("--parent-pid", type=int, default=0,
                        help="exit when this process (the local runner) is gone")
    parser.add_argument("--grace-seconds", type=float, default=DEFAULT_GRACE_S,
                        help="how long this worker lives on after SIGTERM before it is "
                             "killed (the pod's terminationGracePeriodSeconds; default "
                             "%(default)g); it reports this as its notice")
    parser.add_argument("--checkpoint-dir", default="",
                        help="where periodic checkpoints go (default: the job's "
                             "spec.recovery.checkpoint.dir); a Prepare's checkpoint must lie "
                             "under it or under a --checkpoint-source")
    parser.add_argument("--checkpoint-source", action="append", default=[], metavar="DIR",
                        help="a further directory a Prepare may start from a checkpoint in "
                             "(repeatable; e.g. the local runner's --resume-from)")
    parser.add_argument("--save-hf", default="", metavar="OUT",
                        help="when the job completes, write the trained model to OUT as a "
                             "Hugging Face checkpoint (default: the job's spec.output.hf)")
    parser.add_argument("--tensorboard", default="", metavar="DIR",
                        help="while this worker is the job's rank 0, write TensorBoard event "
                             "files to DIR (default: the job's spec.output.tensorboard, else "
                             "<checkpoint dir>/<job>/tensorboard when the job checkpoints)")
    parser.add_argument("--log-every", type=int, default=0, metavar="N",
                        help="while rank 0, log a step line every N steps (default: the job's "
                             "spec.output.logEverySteps, 10)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto (default): NCCL on a GPU when the job's "
                             "spec.resources.gpus >= 1, gloo on the CPU when 0; nccl: GPU or "
                             "fail; gloo: the CPU, whatever the job asks for")
    parser.add_argument("--cuda-device", type=int, default=None, metavar="N",
                        help="with NCCL, the visible GPU to use (default: LOCAL_RANK if set, "
                             "else 0: a pod sees only the GPUs its device plugin gave it)")
    args = parser.parse_args(argv)
    if args.log_every < 0:
        parser.error(f"--log-every {args.log_every} is invalid; expected N >= 1, or 0 for the "
                     "job's spec.output.logEverySteps")
    if not 0 <= args.health_port <= 65535:
        parser.error(f"--health-port {args.health_port} is invalid; expected 1..65535, or 0 "
                     "for none")
    if args.tls_dir and not Path(args.tls_dir).is_dir():
        parser.error(f"--tls-dir {args.tls_dir!r} is not a directory; it must hold tls.crt, "
                     "tls.key and client-ca.crt")
    try:
        faults.slowdown(args.device)                 # a malformed test setting fails here
    except ValueError as e:
        parser.error(str(e))
    if not 0 <= args.min_step_seconds <= 60:
        parser.error(f"--min-step-seconds {args.min_step_seconds} is invalid; expected 0 "
                     "(none) to 60")
    if args.threads < 0 or args.share_cores < 0:
        parser.error(f"--threads {args.threads} / --share-cores {args.share_cores}: expected "
                     "0 (none) or a positive count")
    if args.threads:
        torch.set_num_threads(args.threads)
    elif not args.share_cores:
        fit_threads_to_cpu_limit(args.device)
    job = load_job(args.job)
    try:
        backend = job_backend(args.backend, job.gpus_per_worker)
        device = torch_device(backend, cuda_index(args.cuda_device),
                              asked=asked_for(args.backend, job.gpus_per_worker))
    except BackendError as e:      # at start, one line, before anything serves or trains
        print(f"dynatrain worker: error: {e}", file=sys.stderr, flush=True)
        return 2
    if backend in ("nccl", "nccl-sim"):
        value, ours = nccl_error_handling()
        if not ours and value != NCCL_CLEAN_UP_ONLY:
            print(f"device {args.device}: {NCCL_ERROR_HANDLING}={value} as set: a timed-out "
                  f"collective may take this process down (DynaTrain sets "
                  f"{NCCL_CLEAN_UP_ONLY}, clean up only, when it is unset)", flush=True)
    if backend == "gloo" and job.gpus_per_worker:
        print(f"device {args.device}: training on the CPU (gloo) as --backend gloo asks, "
              f"though the job asks for spec.resources.gpus: {job.gpus_per_worker}", flush=True)
    metrics = Metrics(namespace=job.namespace, job=job.name, reasons=REASONS)
    _, metrics_port = metrics.serve(port=args.metrics_port, addr=args.metrics_host or args.host)
    worker = Worker(job, args.device, backend=backend, torch_device=device, metrics=metrics,
                    checkpoint_dir=args.checkpoint_dir, save_hf=args.save_hf,
                    checkpoint_sources=args.checkpoint_source,
                    tensorboard_dir=args.tensorboard, log_every=args.log_every,
                    share_cores=args.share_cores, min_step_s=args.min_step_seconds)
    # torch's one-off lazy setup (~1 s) before the agent answers: a joiner that is prepared
    # and committed while still warming up would make every sender wait for it in the switch.
    warm_up()
    if device.type == "cuda":      # the CUDA context too (seconds), for the same reason
        torch.ones(1, device=device).add_(1)
        torch.cuda.synchronize(device)
    if job.recovery.checkpoint_interval and worker.control.checkpoint_dir:
        # DCP is imported lazily (~1.4 s); a job that checkpoints pays it here, not in a step.
        import dynatrain.trainer.dcp_planners  # noqa: F401
    try:
        server = serve(worker.control, host=args.host, port=args.agent_port,
                       token_file=args.token_file, tls_dir=args.tls_dir or None,
                       client_name=args.tls_client_name if args.tls_dir else None,
                       health_port=args.health_port, allow_rendezvous=args.allow_rendezvous,
                       insecure=args.insecure)
    except (AuthConfigError, ValueError, OSError) as e:     # one line, before anything trains
        print(f"dynatrain worker: error: {e}", file=sys.stderr, flush=True)
        return 2
    # SIGTERM is notice (a pod deletion, an eviction, a drain: each comes with a grace
    # period): train on until switched out. SIGINT (the local runner's stop, Ctrl-C) stops
    # at the next step boundary.
    worker.control.grace_s = args.grace_seconds
    signal.signal(signal.SIGTERM, lambda *_: worker.leave())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    if args.parent_pid:
        _watch_parent(args.parent_pid, worker)
    if args.ready_file:
        tmp = Path(args.ready_file + ".tmp")
        tmp.write_text(json.dumps({"agent_port": server.port, "metrics_port": metrics_port,
                                   "health_port": server.health_port,
                                   "pid": os.getpid(), "device": args.device}))
        tmp.rename(args.ready_file)
    try:
        return worker.run()
    finally:
        # Done (left, finished or stopped): a SIGTERM now (the operator deletes a leaver's
        # pod as its switch ends) must not turn the clean exit into death by signal while
        # the interpreter shuts down and no Python handler runs any more.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.stop(1.0)


if __name__ == "__main__":
    sys.exit(main())

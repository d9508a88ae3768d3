"""Running a training job: worker processes on this machine, or one rank under torchrun.

:func:`run_local` starts one process per rank (:mod:`.processes`: forked from a server that has
torch imported; a TCP rendezvous on a free loopback port), gloo on CPU or NCCL when this machine has a GPU per rank, and streams
rank 0's per-step results back through a queue so the caller can show live progress. Every
wait has a timeout. :func:`run_ranks` is that start-up on its own (processes, process group,
device, the queue and its watchdog) for any per-rank body: training here, evaluation in
:mod:`.evaluate`. :func:`main` is the torchrun entry point
(``torchrun --nproc-per-node N -m dynatrain.trainer.launch --model M --layout L``).
"""

from __future__ import annotations

import argparse
import os
import queue as queue_mod
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dynatrain.vps.layout import bind
from dynatrain.ports import free_port

from . import processes
from .config import TrainConfig, make_config
from .groups import build_groups
from .state import FullState, assemble_full, local_from_full
from .state_io import state_from_bytes, state_to_bytes
from .trainer import LocalState, Trainer

DEFAULT_TIMEOUT_S = float(os.environ.get("DYNATRAIN_TRAIN_TIMEOUT_S", "900"))


class RanksFailed(RuntimeError):
    """A rank process died or the job did not finish in time."""


TrainingFailed = RanksFailed
"""The name training callers know :class:`RanksFailed` by."""


@dataclass
class TrainResult:
    model: str
    layout: str
    world: int
    backend: str
    losses: list[float]
    step_seconds: list[float]
    tokens_per_second: float
    """Median over the steps after the first (the first pays one-off allocation costs)."""
    grad_norms: list[float] = field(default_factory=list)
    """Each step's global gradient norm before clipping."""
    full_state: FullState | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("full_state")
        return out


def pick_backend(requested: str, world: int) -> str:
    if requested != "auto":
        return requested
    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        return "nccl"
    return "gloo"


def _device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _train_rank(rank: int, device: torch.device, results, config: TrainConfig, steps: int,
                want_state: bool, start: FullState | None, save_to: str = "") -> None:
    """One rank of :func:`run_local`, inside :func:`run_ranks`' process group."""
    bound = bind(config.layout, config.model)
    groups = build_groups(bound, rank)
    state = local_from_full(start, bound, rank) if start is not None else None
    trainer = Trainer(config, groups, device=device, state=state)
    for _ in range(steps):
        r = trainer.train_step()
        if rank == 0:
            results.put(("step", (r.step, r.loss, r.seconds, r.tokens_per_second,
                                  r.grad_norm)))
    if want_state:
        st = trainer.local_state()
        cpu = {k: (t.detach().cpu(), p) for k, (t, p) in st.tensors.items()}
        # Bytes, not tensors: a queued tensor is a shared-memory handle that dies with
        # this process if it exits before the parent has read it. Safetensors + JSON, not a
        # pickle: the parent reads it without running anything (.state_io).
        results.put(("state", state_to_bytes(LocalState(cpu, st.step, st.data_position))))
    if save_to:  # a DCP checkpoint of the final state (collective over the default group)
        from .checkpoint import save_state

        save_state(trainer.local_state(), config.model, save_to)


def run_local(config: TrainConfig, steps: int, *, backend: str = "auto", progress=None,
              want_state: bool = False, start: FullState | None = None,
              timeout_s: float = DEFAULT_TIMEOUT_S, save_to: str = "") -> TrainResult:
    """Train ``steps`` steps with one process per rank on this machine.

    ``start`` continues from a full training state (under any layout); ``want_state`` returns
    the final full state in ``TrainResult.full_state``; ``save_to`` has the ranks write the
    final state as a DCP checkpoint there (each rank its own shards; ``--save-hf`` exports it).
    """
    world = config.layout.world
    backend = pick_backend(backend, world)
    losses, seconds, norms, states = [], [], [], []

    def on_message(kind, payload):
        if kind == "step":
            step, loss, sec, tps, norm = payload
            losses.append(loss)
            seconds.append(sec)
            norms.append(norm)
            if progress:
                progress(step, steps, loss, sec, tps)
        else:
            states.append(state_from_bytes(payload, source="a rank's final state")[0])

    run_ranks(_train_rank, (config, steps, want_state, start, save_to), world=world,
              backend=backend, messages=steps + (world if want_state else 0),
              on_message=on_message, what=f"training {config.layout.to_text()}",
              timeout_s=timeout_s)
    later = seconds[1:] or seconds
    tps = config.tokens_per_step / statistics.median(later) if later else 0.0
    full = assemble_full(config.model, states) if want_state else None
    return TrainResult(config.model.name, config.layout.to_text(), world, backend, losses,
                       seconds, tps, norms, full)


def _rank_main(rank: int, world: int, port: int, backend: str, timeout_s: float, results,
               body, body_args: tuple) -> None:
    """One rank: its share of the cores, its device, the default process group, then
    ``body(rank, device, results, *body_args)``; the closing barrier keeps every rank's groups
    alive until all ranks are done with them."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = _device(backend, rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        body(rank, device, results, *body_args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(body, body_args: tuple, *, world: int, backend: str, messages: int, on_message,
              what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run ``body(rank, device, results, *body_args)`` in ``world`` processes on this machine.

    ``body`` must be a module-level function (the ranks import it by name); ``backend`` is
    resolved already (:func:`pick_backend`). The ranks report with ``results.put((kind,
    payload))``; each of the ``messages`` reports expected is handed to ``on_message(kind,
    payload)`` as it arrives, and an exception raised there stops the ranks and propagates.
    ``what`` names the job in errors ("training dp=2,tp=1,pp=1"). Raises :class:`RanksFailed`
    when a rank dies or the whole does not finish within ``timeout_s``.
    """
    results = processes.context().Queue()
    procs = processes.start_ranks(
        _rank_main, args=(world, free_port(), backend, timeout_s, results, body, body_args),
        nprocs=world)
    deadline = time.monotonic() + timeout_s
    received = 0
    try:
        while received < messages:
            try:
                kind, payload = results.get(timeout=1.0)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise RanksFailed(f"{what} did not finish within {timeout_s:.0f} s") from None
                if any(p.exitcode not in (None, 0) for p in procs.processes):
                    codes = [p.exitcode for p in procs.processes]
                    raise RanksFailed(f"a worker died (exit codes {codes}); its traceback is "
                                      "printed above") from None
                continue
            received += 1
            on_message(kind, payload)
        while not procs.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise RanksFailed(f"workers did not exit after {what}")
    except BaseException:
        _stop(procs)
        raise


def _stop(procs) -> None:
    for p in procs.processes:
        if p.is_alive():
            p.terminate()
    for p in procs.processes:
        p.join(timeout=10)


def main(argv=None) -> int:
    """torchrun entry: one rank per process, rendezvous from torchrun's environment."""
    parser = argparse.ArgumentParser(description="One rank of a DynaTrain training job "
                                     "(run under torchrun).")
    parser.add_argument("--model", required=True)
    parser.add_argument("--layout", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = parser.parse_args(argv)
    config = make_config(args.model, args.layout, seed=args.seed,
                         global_batch_size=args.global_batch_size,
                         micro_batch_size=args.micro_batch_size)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.layout.world:
        print(f"layout {config.layout.to_text()} needs {config.layout.world} processes, "
              f"torchrun started {world}", file=sys.stderr)
        return 2
    backend = pick_backend(args.backend, world)
    device = _device(backend, int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    try:
        trainer = Trainer(config, build_groups(bind(config.layout, config.model), rank),
                          device=device)
        for _ in range(args.steps):
            r = trainer.train_step()
            if rank == 0:
                print(f"step {r.step:>5}  loss {r.loss:.6f}  {r.tokens_per_second:,.0f} tok/s",
                      flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

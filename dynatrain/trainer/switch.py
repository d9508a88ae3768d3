"""A live switch of the reference trainer at a step boundary.

The trainer hands its local state to the transition engine and lets go of it (so the engine can
free old tensors as their last reader finishes), the engine delivers the new layout's local
tensors, and a new trainer continues from them, with the same step, data position and RNG
state: the scalars travel from the lowest old device to every device over the transition group,
so joiners, which held nothing, resume exactly where the old world stopped. Everything slow
(plan, schedule, process groups) was done beforehand by ``DeviceManager.prepare``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dynatrain.vps import abandon
from dynatrain.vps.generations import PreparedSwitch
from dynatrain.vps.mapping import rank_shards
from dynatrain.vps.transition import (TransitionConfig, TransitionError, TransitionStats,
                                     execute_transition)

from .config import TrainConfig
from .trainer import LocalState, Trainer
from .weights import TORCH_DTYPES

_RNG_BYTES = torch.get_rng_state().numel()


@dataclass
class SwitchResult:
    trainer: Trainer | None
    """The trainer under the new layout, or None on a device that left."""
    pause_seconds: float
    transfer: TransitionStats
    phases: dict
    """Seconds per phase of the pause: release (old state out), scalars, transfer, rebuild."""


def _share_scalars(prepared: PreparedSwitch, device: int, state: LocalState | None,
                   dev: torch.device) -> tuple[int, int, torch.Tensor]:
    """(step, data position, RNG state) of the old world, on every device of the switch."""
    # The lowest old device that is still here (in a recovery, the lowest survivor: every
    # survivor restored the same step, data position and RNG).
    root_device = min(d for d in prepared.plan.old.device_of if d in prepared.group_rank)
    root = prepared.group_rank[root_device]
    buf = torch.zeros(2 + _RNG_BYTES, dtype=torch.int64)
    if state is not None and prepared.group_rank[device] == root:
        buf[0], buf[1] = state.step, state.data_position
        buf[2:] = state.rng["cpu"].to(torch.int64)
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    buf = buf.to(dev)
    try:
        abandon.wait(prepared.transition_group.broadcast([buf], opts))
    except Exception as e:  # a peer died or timed out before the transfer began
        raise TransitionError(f"device {device}: sharing step/data position/RNG from device "
                              f"{root_device} failed: {e}") from e
    buf = buf.cpu()
    return int(buf[0]), int(buf[1]), buf[2:].to(torch.uint8)


def _commit(prepared: PreparedSwitch, device: int, config: TransitionConfig) -> None:
    """Every device of the switch says it is done, or every device learns the switch failed:
    without this, a device that never talked to a dead peer would carry on alone."""
    done = torch.ones(1)
    try:
        work = prepared.transition_group.allreduce([done])
        if abandon.wait(work, config.timeout) is False or int(done) != len(prepared.group_rank):
            raise TimeoutError("not every device completed")
    except Exception as e:
        raise TransitionError(f"device {device}: the switch to generation "
                              f"{prepared.generation} did not complete on every device: {e}"
                              ) from e


def switch(trainer_holder: list, prepared: PreparedSwitch, new_config: TrainConfig, device: int,
           *, config: TransitionConfig = TransitionConfig(),
           torch_device: torch.device | None = None, restored: LocalState | None = None,
           mirrored: dict | None = None) -> SwitchResult:
    """Switch this device to ``new_config.layout`` at the current step boundary.

    ``trainer_holder`` is a one-element list holding the old trainer (or None on a joiner); it
    is emptied here, so that the old state is not kept alive by the caller during the transfer.
    In a recovery the old state is ``restored`` (a snapshot) instead of a live trainer's, and
    ``mirrored`` holds the old local tensors of failed devices this device mirrors (see
    :func:`~dynatrain.vps.transition.execute_transition`).
    """
    t0 = time.perf_counter()
    dev = torch_device or torch.device("cpu")
    trainer = trainer_holder.pop() if trainer_holder else None
    state = trainer.local_state() if trainer is not None else restored
    del trainer, restored
    t1 = time.perf_counter()
    step, position, rng = _share_scalars(prepared, device, state, dev)
    old = {k: t for k, (t, _) in state.tensors.items()} if state is not None else {}
    old_pieces = {k: p for k, (_, p) in state.tensors.items()} if state is not None else {}
    del state
    t2 = time.perf_counter()

    new_shapes, pieces = {}, {}
    if prepared.new_rank is not None:
        for rs in rank_shards(prepared.plan.new, prepared.new_rank):
            dtype = TORCH_DTYPES[rs.tensor.dtype] if rs.state == "param" else torch.float32
            new_shapes[(rs.tensor.name, rs.state)] = (rs.local_shape, dtype)
            pieces[(rs.tensor.name, rs.state)] = rs.pieces
    new, stats = execute_transition(prepared.plan, device, old, new_shapes,
                                    prepared.transition_group, prepared.group_rank,
                                    prepared.rounds, config, dev, old_pieces, pieces,
                                    mirrored=mirrored)
    _commit(prepared, device, config)
    t3 = time.perf_counter()
    phases = {"release": t1 - t0, "scalars": t2 - t1, "transfer": t3 - t2}
    if prepared.new_rank is None:
        return SwitchResult(None, t3 - t0, stats, phases)
    local = LocalState({k: (t, pieces[k]) for k, t in new.items()}, step, position,
                       {"cpu": rng})
    new_trainer = Trainer(new_config, prepared.extra, device=dev, state=local)
    t4 = time.perf_counter()
    phases["rebuild"] = t4 - t3
    return SwitchResult(new_trainer, t4 - t0, stats, phases)

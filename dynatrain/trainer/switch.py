"""A live switch of the reference trainer at a step boundary.

The trainer hands its local state to the transition engine and lets go of it (so the engine can
free old tensors as their last reader finishes), the engine delivers the new layout's local
tensors, and a new trainer continues from them, with the same step, data position and RNG
state: the scalars travel from the lowest old device to every device in the commit all-reduce,
so joiners, which held nothing, resume exactly where the old world stopped. Everything slow
(plan, schedule, process groups) was done beforehand by ``DeviceManager.prepare``, and on CPU so
was allocating the new local tensors that can be neither adopted nor carved (:func:`preallocate`);
the old tensors the switch lets go of are freed, or for carved ones trimmed, in the background
once it is over. The trainer must hold the only references to its tensors when it is handed
over: a tensor still shared elsewhere cannot be carved, and is copied into memory allocated in
the pause.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass

import torch

from dynatrain.vps import abandon
from dynatrain.vps.carving import CARVING, carve_views, free_in_background
from dynatrain.vps.generations import PreparedSwitch
from dynatrain.vps.mapping import rank_shards
from dynatrain.vps.rounds import staging_need
from dynatrain.vps.transition import (TransitionConfig, TransitionError, TransitionInputs,
                                      TransitionStats, execute_transition)

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
    """Seconds per phase of the pause: release (old state out), transfer (of which
    local_copies and network), commit, rebuild."""
    freeing: threading.Thread | None = None
    """The thread dropping (on CPU) the old tensors after the pause."""
    old_groups: object = None
    """The old generation's process groups, for the caller to shut down on its own thread at
    a quiet point (:func:`~dynatrain.trainer.groups.shut_down`): an NCCL communicator torn
    down on another thread while the next step's kernels run can block them."""


def new_local_shapes(prepared: PreparedSwitch) -> tuple[dict, dict]:
    """(shapes, pieces) of this device's new local tensors, keyed (tensor name, state):
    shapes[key] = (local shape, torch dtype). Empty on a device that leaves."""
    shapes, pieces = {}, {}
    if prepared.new_rank is not None:
        for rs in rank_shards(prepared.plan.new, prepared.new_rank):
            dtype = TORCH_DTYPES[rs.tensor.dtype] if rs.state == "param" else torch.float32
            shapes[(rs.tensor.name, rs.state)] = (rs.local_shape, dtype)
            pieces[(rs.tensor.name, rs.state)] = rs.pieces
    return shapes, pieces


def preallocate(prepared: PreparedSwitch, device: int,
                config: TransitionConfig = TransitionConfig()) -> None:
    """Allocate and touch, ahead of the pause, the new local tensors that the switch can
    neither adopt nor carve from this device's old state, and the staging buffer of its
    network rounds (for ``DeviceManager.prepare(preallocate=...)``; fills
    ``prepared.preallocated`` and ``prepared.staging``).

    A fresh CPU allocation faults its pages in on first write, and the kernel zeroes each one:
    done during the pause, that doubles the cost of a local copy. The tensors are held from
    prepare to the switch, so the peak stays old + new + staging; it comes earlier. CPU only:
    on a GPU the caching allocator makes allocation cheap, and memory held early is memory
    the training still needs.
    """
    shapes, pieces = new_local_shapes(prepared)
    old_rank = prepared.plan.old.rank_of_device.get(device)
    old_shards = ({(rs.tensor.name, rs.state): rs
                   for rs in rank_shards(prepared.plan.old, old_rank)}
                  if old_rank is not None else {})
    # What the engine will adopt or carve needs no new memory; meta tensors of the old local
    # shapes tell which blocks are contiguous without touching the real ones.
    skip = {key for key, rs in old_shards.items() if key in pieces and rs.pieces == pieces[key]}
    if config.carve and CARVING:
        metas = {key: torch.empty(rs.local_shape, dtype=shapes[key][1], device="meta")
                 for key, rs in old_shards.items() if key in shapes and key not in skip}
        skip.update(carve_views(prepared.plan, device, metas, shapes, pieces))
    prepared.preallocated = {key: torch.zeros(shape, dtype=dtype)
                             for key, (shape, dtype) in shapes.items() if key not in skip}
    need = staging_need(prepared.rounds, device,
                        None if config.checksums else config.direct_bytes)
    prepared.staging = torch.zeros(need, dtype=torch.uint8) if need else None


def _commit(prepared: PreparedSwitch, device: int, scalars: tuple | None,
            dev: torch.device, config: TransitionConfig) -> tuple[int, int, torch.Tensor]:
    """Every device of the switch says it is done, or every device learns the switch failed
    (without this, a device that never talked to a dead peer would carry on alone); and every
    device learns the old world's (step, data position, RNG state), which joiners lack, from
    the lowest old device still here, in the same all-reduce: it adds 1 per device and the
    root's scalars to everyone else's zeros. (In a recovery the root is the lowest survivor;
    every survivor restored the same step, data position and RNG.)"""
    root_device = min(d for d in prepared.plan.old.device_of if d in prepared.group_rank)
    buf = torch.zeros(3 + _RNG_BYTES, dtype=torch.int64)
    buf[0] = 1
    if device == root_device:
        if scalars is None:     # nothing to share: vote "not done", so that nobody carries on
            buf[0] = 0
        else:
            buf[1], buf[2] = scalars[0], scalars[1]
            buf[3:] = scalars[2].to(torch.int64)
    buf = buf.to(dev)
    try:
        work = prepared.transition_group.allreduce([buf])
        if abandon.wait(work, config.timeout) is False:
            raise TimeoutError("the commit all-reduce timed out")
        if int(buf[0]) != len(prepared.group_rank):
            raise TimeoutError(f"{int(buf[0])} of {len(prepared.group_rank)} devices completed"
                               f" (device {root_device} shares step, data position and RNG)")
    except Exception as e:
        raise TransitionError(f"device {device}: the switch to generation "
                              f"{prepared.generation} did not complete on every device: {e}"
                              ) from e
    buf = buf.cpu()
    return int(buf[1]), int(buf[2]), buf[3:].to(torch.uint8)


def switch(trainer_holder: list, prepared: PreparedSwitch, new_config: TrainConfig, device: int,
           *, config: TransitionConfig = TransitionConfig(),
           torch_device: torch.device | None = None, restored: LocalState | None = None,
           mirrored: dict | None = None, graveyard: list | None = None) -> SwitchResult:
    """Switch this device to ``new_config.layout`` at the current step boundary.

    ``trainer_holder`` is a one-element list holding the old trainer (or None on a joiner); it
    is emptied here, so that the old state is not kept alive by the caller during the transfer.
    In a recovery the old state is ``restored`` (a snapshot) instead of a live trainer's, and
    ``mirrored`` holds the old local tensors of failed devices this device mirrors (see
    :func:`~dynatrain.vps.transition.execute_transition`). If the switch fails, the old
    trainer's process groups go to ``graveyard`` (when given) rather than being torn down: a
    failed generation's groups may have a wait stuck in them.

    Python's cyclic garbage collector is held off for the pause: a full collection over
    torch's object graph takes tens of milliseconds and would otherwise land in it at random.
    """
    paused = gc.isenabled()
    gc.disable()
    try:
        return _switch(trainer_holder, prepared, new_config, device, config=config,
                       torch_device=torch_device, restored=restored, mirrored=mirrored,
                       graveyard=graveyard)
    finally:
        if paused:
            gc.enable()


def _switch(trainer_holder: list, prepared: PreparedSwitch, new_config: TrainConfig,
            device: int, *, config: TransitionConfig, torch_device: torch.device | None,
            restored: LocalState | None, mirrored: dict | None,
            graveyard: list | None) -> SwitchResult:
    t0 = time.perf_counter()
    dev = torch_device or torch.device("cpu")
    if dev.type != "cpu":
        # A recovery's snapshot and mirrors are host copies (the redundancy's pinned buffers);
        # the engine adopts them and NCCL sends from them, so they must be on the device.
        if restored is not None:
            restored = LocalState({k: (t.to(dev), p) for k, (t, p) in restored.tensors.items()},
                                  restored.step, restored.data_position, restored.rng)
        if mirrored:
            mirrored = {d: {k: t.to(dev) for k, t in m.items()} for d, m in mirrored.items()}
    trainer = trainer_holder.pop() if trainer_holder else None
    state = trainer.local_state() if trainer is not None else restored
    # The old generation's process groups die with the trainer, unless held: they are handed
    # back to the caller, which shuts them down on its training thread after the next step.
    old_groups = trainer.g if trainer is not None else None
    del trainer, restored
    scalars = (state.step, state.data_position, state.rng["cpu"]) if state is not None else None
    old = {k: t for k, (t, _) in state.tensors.items()} if state is not None else {}
    old_pieces = {k: p for k, (_, p) in state.tensors.items()} if state is not None else {}
    del state
    t1 = time.perf_counter()

    new_shapes, pieces = new_local_shapes(prepared)
    # On CPU, old tensors are freed after the pause (see the module docstring); on a GPU,
    # freeing is cheap and early frees keep the peak lower.
    retired = [] if dev.type == "cpu" else None
    late = []                                           # dropped after the pause, on a thread
    try:
        new, stats = execute_transition(
            TransitionInputs(plan=prepared.plan, device=device, old=old, new_shapes=new_shapes,
                             group=prepared.transition_group, group_rank=prepared.group_rank,
                             rounds=prepared.rounds, torch_device=dev, old_pieces=old_pieces,
                             new_pieces=pieces, mirrored=mirrored,
                             preallocated=prepared.preallocated, retired=retired,
                             staging=prepared.staging),
            config)
        prepared.preallocated = prepared.staging = None   # new local tensors now, or garbage
        t2 = time.perf_counter()
        step, position, rng = _commit(prepared, device, scalars, dev, config)
    except BaseException:
        if graveyard is not None and old_groups is not None:
            graveyard.append(old_groups)
        raise
    t3 = time.perf_counter()
    phases = {"release": t1 - t0, "transfer": t2 - t1, "local_copies": stats.copy_seconds,
              "network": stats.network_seconds, "commit": t3 - t2,
              "setup": stats.setup_seconds, "post": stats.post_seconds,
              "wait": stats.wait_seconds, "unpack": stats.unpack_seconds}
    del old
    if prepared.new_rank is None:   # a leaver frees its old state on return: nobody waits
        return SwitchResult(None, t3 - t0, stats, phases, old_groups=old_groups)
    late.extend(retired or [])
    del retired
    local = LocalState({k: (t, pieces[k]) for k, t in new.items()}, step, position,
                       {"cpu": rng})
    new_trainer = Trainer(new_config, prepared.extra, device=dev, state=local)
    t4 = time.perf_counter()
    phases["rebuild"] = t4 - t3
    # Freed only now: the thread takes the GIL, which the rebuild above needs; the next
    # training step's kernels leave it free most of the time.
    return SwitchResult(new_trainer, t4 - t0, stats, phases, free_in_background(late),
                        old_groups)

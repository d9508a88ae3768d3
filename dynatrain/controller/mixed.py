"""Devices of different speeds in one job: a pipeline layout that weighs them.

A job whose workers run on two GPU models (an H100 node pool and an A100 one, say) is priced
with the profile of the one with the least memory (``hardware_of``: every layout then fits
every device), and its layers were split evenly between pipeline stages, so the fast devices
waited for the slow ones at every micro-batch. Here, given each device's speed (the FLOP/s of
the profile its node's labels name; the front end knows which node a device runs on):

1. **Stages of like devices.** A stage runs at its slowest device's pace, so the devices are
   sorted fastest first and dealt to the stages in order: the fastest ``dp * tp`` devices form
   stage 0, the next ones stage 1, and so on. Mixing one slow device into every stage would
   slow them all.
2. **Layers in proportion.** Each layer of stage ``i`` costs ``1 / speed_i``; the same layers
   are split again with :func:`balanced_stages` (one at a time to the stage it slows least;
   the measured rebalance of :func:`.decide.rebalance` splits with it too), so a stage of devices twice as fast gets about twice the layers.
3. **Only what fits.** The weighted split is kept only if the cost model says it fits in the
   memory of the profile the job is priced with (the smallest): a fast device with less memory
   never gets layers it cannot hold. Otherwise the even split stays.

Measured costs refine it afterwards: ``spec.parallelism.rebalance`` splits the stages again
from what each stage measures (:func:`.decide.rebalance`). Pure: it imports no grpc,
kubernetes or torch (the decisions' import contract covers it).
"""

from __future__ import annotations

from dataclasses import replace

from dynatrain.spec.hardware import DeviceProfile
from dynatrain.spec.job import JobSpec
from dynatrain.vps.layout import Layout, default_stages

from .costmodel import SolverError, estimate

SPREAD = 1.05
"""Speeds within this factor of each other count as one device kind: nothing is weighed."""


def balanced_stages(stage_compute: tuple[float, ...], stages: tuple[int, ...],
                    fixed: tuple[float, ...] | None = None) -> tuple[int, ...]:
    """The split of the same layers between the same stages that minimises the slowest
    stage, if each layer of stage i costs what stage i measured per layer: stage i with k
    layers costs ``fixed[i] + k * (stage_compute[i] - fixed[i]) / stages[i]`` (``fixed``: what
    a stage computes whatever its layers, the embedding or the head, :mod:`.layercost`; none
    when not given: the device's speed and the layers' mix as measured, spread over its
    layers). One layer at a time goes to the stage it slows least: optimal for this min-max
    (each stage's cost grows linearly with its layers). Ties go to the earlier stage."""
    if len(stage_compute) != len(stages) or not stages or min(stages) < 1:
        raise ValueError(f"stage_compute {stage_compute} and stages {stages} must name the "
                         "same stages, each with at least one layer")
    fixed = fixed or (0.0,) * len(stages)
    per_layer = [(c - f) / n for c, f, n in zip(stage_compute, fixed, stages)]
    split = [1] * len(stages)
    for _ in range(sum(stages) - len(stages)):
        i = min(range(len(split)),
                key=lambda k: (fixed[k] + (split[k] + 1) * per_layer[k], k))
        split[i] += 1
    return tuple(split)


def stage_order(layout: Layout, speeds: dict[int, float]) -> tuple[int, ...]:
    """``layout``'s devices re-dealt to its ranks so that each pipeline stage holds devices of
    like speed, the fastest in stage 0 (ties: lower device id first); rank -> device."""
    devices = sorted(layout.device_of, key=lambda d: (-speeds.get(d, 0.0), d))
    by_rank = [0] * layout.world
    dealt = iter(devices)
    for stage in range(layout.pp):
        for dp in range(layout.dp):
            for tp in range(layout.tp):
                by_rank[layout.rank(stage, dp, tp)] = next(dealt)
    return tuple(by_rank)


def weighted(layout: Layout, speeds: dict[int, float], num_layers: int) -> Layout:
    """``layout`` (with its devices) on stages of like devices, its layers split in proportion
    to each stage's speed (its slowest device's). Unchanged without pipeline stages, when a
    device's speed is unknown, or when all are alike (within :data:`SPREAD`)."""
    known = [speeds.get(d) for d in layout.device_of]
    if layout.pp < 2 or None in known or max(known) <= SPREAD * min(known):
        return layout
    order = stage_order(layout, speeds)
    stage_speed = [min(speeds[order[layout.rank(s, dp, tp)]]
                       for dp in range(layout.dp) for tp in range(layout.tp))
                   for s in range(layout.pp)]
    even = default_stages(num_layers, layout.pp)
    split = balanced_stages(tuple(n / v for n, v in zip(even, stage_speed)), even)
    return replace(layout.with_devices(order), stages=None if split == even else split)


def weigh(job: JobSpec, layout: Layout, speeds: dict[int, float], profile: DeviceProfile,
          estimate_kwargs: dict) -> Layout:
    """:func:`weighted`, kept only where the cost model says the weighted stages fit in
    ``profile``'s memory (the job's pricing profile, the smallest of its devices); else
    ``layout`` itself."""
    if job.mode != "auto" or not speeds:
        return layout
    out = weighted(layout, speeds, job.model.num_layers)
    if out is layout or out.stages is None:
        return out
    try:
        fits = estimate(job.model, out, profile, **estimate_kwargs).fits
    except SolverError:
        fits = False
    return out if fits else layout.with_devices(out.device_of)

"""A pipeline stage's cost per layer: the cost model's per-layer figures, scaled by what each
stage measured (#38 item 1, for the stage rebalance, :func:`.decide.rebalance`).

A stage computes its layers *and* what comes with its place in the pipeline: the first stage
the token embedding, the last the final norm, the head and the loss (on a small model with a
large vocabulary the head alone costs more than a block). Spreading a stage's measured time
evenly over its layers would move part of the head with every layer taken off the last stage.
So each stage is modelled as ``fixed_s + k * layer_s`` seconds per micro-batch for ``k``
layers, both read off the cost model (:attr:`~.costmodel.Estimate.stage_compute`: the layout
as it runs, and the same with one more layer on each stage in turn), and the model's stage is
scaled to the stage's measured time. The scale is the stage's devices' speed against the
profile's (a slowed device, a slower GPU model), so the split that balances the scaled model
is the one that balances the devices as they are.

Pure: no torch, grpc or kubernetes (the decisions' import contract).
"""

from __future__ import annotations

from dataclasses import replace

from dynatrain.spec.hardware import DeviceProfile
from dynatrain.spec.job import JobSpec
from dynatrain.vps.layout import Layout

from .costmodel import SolverError, estimate
from .policy import estimate_kwargs


def stage_model(job: JobSpec, layout: Layout, stages: tuple[int, ...],
                profile: DeviceProfile) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(fixed_s, layer_s): the cost model's compute seconds per micro-batch of each stage that
    do not move with its layers, and of each of its layers, for ``layout`` split as
    ``stages``. None where the model cannot tell (no stage can give a layer, or a layout it
    cannot price)."""
    kw = estimate_kwargs(job)
    base = replace(layout, devices=None, stages=stages, shares=None)
    try:
        now = estimate(job.model, base, profile, **kw).stage_compute
        fixed, layer = [], []
        for s in range(layout.pp):
            # One layer moved off stage s (or onto it, where it has only one) and the stage
            # priced again: the difference is one of its layers.
            other = next((j for j in range(layout.pp) if j != s
                          and (stages[s] > 1 or stages[j] > 1)), None)
            if other is None:
                return None
            moved, sign = list(stages), (1 if stages[s] > 1 else -1)
            moved[s], moved[other] = moved[s] - sign, moved[other] + sign
            then = estimate(job.model, replace(base, stages=tuple(moved)), profile,
                            **kw).stage_compute[s]
            one = (now[s] - then) * sign
            layer.append(one)
            fixed.append(now[s] - stages[s] * one)
    except SolverError:
        return None
    if min(layer) <= 0:
        return None
    return tuple(fixed), tuple(layer)


def fixed_seconds(costs: tuple[float, ...], stages: tuple[int, ...],
                  model: tuple[tuple[float, ...], tuple[float, ...]] | None
                  ) -> tuple[float, ...] | None:
    """Each stage's measured ``costs`` share that does not move with its layers: its model's
    fixed part, scaled like the whole stage to what it measured (None without a model)."""
    if model is None:
        return None
    fixed, layer = model
    out = []
    for cost, n, f, one in zip(costs, stages, fixed, layer):
        modelled = f + n * one
        out.append(cost * max(0.0, f) / modelled if modelled > 0 else 0.0)
    return tuple(out)

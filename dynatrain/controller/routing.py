"""MoE routing skew priced per pipeline stage: what the measured tokens per expert say each
stage's work is, for the stage rebalance (:func:`.decide.rebalance`).

A stage's expert-parallel ranks wait for each other at every all-to-all, so a stage computes
its experts at the pace of its busiest EP rank: when the routers of its layers send
``imbalance`` times the mean share of tokens to one rank's experts, its expert work costs
that many times the balanced one. Each stage's cost is then its dense work plus its expert
work times its measured imbalance (:attr:`.measured.Measurement.stage_ep_imbalance`), the work
counted in FLOPs per token by :func:`dynatrain.vps.stagecost.stage_costs` (weight matmuls,
causal attention at the job's sequence length; backward is the same multiple of forward for
both parts, so it cancels).

The counts are exact where step times are noisy, and they name the cause: a rebalance they
trigger says which stage's routing made it. The costs are scaled to the measured stage compute
(their sum), so the saving a rebalance is judged by stays in seconds.

Pure: no torch, grpc or kubernetes (the decisions' import contract).
"""

from __future__ import annotations

from dataclasses import replace

from dynatrain.spec.job import JobSpec
from dynatrain.vps.layout import Layout, bind
from dynatrain.vps.model import ModelSpec
from dynatrain.vps.stagecost import stage_costs

from .measured import Measurement

MIN_SKEW = 1.05
"""Below this on every stage, routing is even enough that the measured times decide."""


def routed_stage_costs(m: Measurement, model: ModelSpec, layout: Layout,
                       seq_len: int) -> tuple[float, ...] | None:
    """Each stage's compute seconds as its routing makes it (see the module docstring), or
    None when the tokens do not decide: a dense model, ``ep`` 1, no tokens counted, or no
    stage whose busiest EP rank carries ``MIN_SKEW`` times the mean."""
    imbalance = m.stage_ep_imbalance
    if (not model.is_moe or layout.ep < 2 or len(imbalance) != layout.pp
            or max(imbalance) < MIN_SKEW):
        return None
    key = replace(layout, devices=None, stages=bind(layout, model).layout.stages)
    costs = []
    for stage, skew in zip(stage_costs(model, key), imbalance):
        experts = 2.0 * model.experts_top_k * stage.expert_elements \
            / (model.num_experts // layout.ep)
        dense = stage.matmul_flops - experts + stage.attn_flops * seq_len
        costs.append(dense + experts * skew)
    measured, total = sum(m.stage_compute), sum(costs)
    if measured <= 0 or total <= 0:
        return None
    return tuple(c * measured / total for c in costs)


def overlapped(job: JobSpec, layout: Layout) -> float:
    """The share of a step's stage time that the slowest stage sets: ``(m-1)/m`` for ``m``
    micro-batches per data-parallel rank. A layer's routed work costs the same whichever
    stage holds it, so moving it only shortens the part of the step in which the stages
    overlap; with one micro-batch they run one after the other, and no split saves time."""
    micro = job.global_batch_size // (layout.dp * job.training.micro_batch_size)
    return (micro - 1) / micro if micro > 0 else 0.0


def describe(m: Measurement) -> str:
    """The routing behind a rebalance, for its log line."""
    by_stage = "/".join(f"{x:.2f}" for x in m.stage_ep_imbalance)
    return (f"experts' tokens: the busiest EP rank over the mean, by stage {by_stage} "
            f"(measured over {m.steps} steps); stage costs priced from them")

"""The cost model: how fast one layout trains on a device profile, and how much memory it needs.

:func:`estimate` answers *how fast and how big is this layout?* for
:mod:`dynatrain.controller.solver`, which asks it of every candidate, and for the policy,
which weighs the running layout against the solver's pick. It is an analytic model of the
reference trainer (:mod:`dynatrain.trainer`) on a
:class:`~dynatrain.spec.hardware.DeviceProfile`: pure arithmetic over the model spec and
the vps mapping (per stage: :mod:`dynatrain.vps.stagecost`), no torch and no
processes, so the controller can weigh a hundred candidate layouts of a 70B model in well
under a second. The formulas follow.

Memory (peak bytes per device, the busiest rank of the busiest pipeline stage)
------------------------------------------------------------------------------
``state``
    exact: what ``rank_shards(bind(layout, model), rank)`` gives the rank, numel(local_shape)
    times the state's item size (param dtype for ``param``, 4 bytes for master / exp_avg /
    exp_avg_sq). An fp32 model has no separate master in the mapping (the parameter is its
    own master); under ZeRO-1 the trainer nevertheless clones its flat master range, which is
    added. The busiest rank of a stage is its (dp 0, tp 0) rank: uneven ZeRO ranges give their
    extra element to the first ranks. It is evaluated once per distinct stage shape (first,
    last, middle stages of each layer count), with the mapping's single-rank rules
    (:func:`stagecost._rank_state_bytes`, tested equal to summing ``rank_shards``), and
    cached per (model, layout): ``solve`` for llama-7b on 64 devices (57 candidates) takes
    ~0.1 s.
``grads``
    one gradient per TP/EP-local working parameter of the stage, in the param dtype.
``zero3_working``
    ZeRO-3: the reference trainer gathers the whole stage's working weights at the start of
    the step and keeps them until the optimizer has run (one more copy of ``grads``' size).
``activations``
    ``n_s * mb * seq * a_stage * act_bytes``: ``n_s`` micro-batches' autograd graphs are alive
    at once on stage s, which is what the layout's pipeline schedule decides. GPipe keeps all
    ``m = global_batch / (dp * mb)`` of the rank until the backward passes; 1F1B starts the
    oldest micro-batch's backward as soon as the last stage could have sent its gradient, so
    stage s holds ``n_s = min(m, pp - s)`` (the first stage the most; the last stage one).
    Measured on gpt-tiny, pp = 2, m = 8 (tests/trainer/test_schedule_1f1b.py, counting the
    bytes saved for backward): GPipe / 1F1B = 4.0 on stage 0 and 8.0 on stage 1 exactly;
    stage 0 measures 8% below this term, the last stage 30% below (the logits, next).
    ``a_stage`` counts the elements saved
    for backward per token, per layer
    ``4h + (5 * heads * head_dim + mlp) / tp`` -- the replicated norm inputs and outputs
    (4h), q, k, v (kv heads expanded for GQA), the attention output and its reshaped copy,
    and the MLP intermediates (GELU: 2f, SwiGLU: 4f, MoE: ``E + k * (3h + 4f / tp)``).
    It is our own count of what the trainer's autograd graph holds; it agrees with
    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    34 sbh bytes/layer in 16 bit, i.e. 17h elements per token) without their dropout masks
    and without the ``5 * heads * seq / h`` attention-score term, because
    ``scaled_dot_product_attention`` (flash / memory-efficient kernels) never stores the
    seq x seq score matrix. The last stage adds the logits (3 copies of V/tp per token:
    logits, shifted, exp in the vocab-parallel cross-entropy; with tp = 1 torch's
    ``F.cross_entropy`` keeps only its log-softmax, so this over-counts there).
    With activation checkpointing (``spec.training.activationCheckpointing``) a block keeps
    only its input (h per token) and recomputes the rest in its backward pass, so ``a_stage``
    drops each layer's count to ``h``; one block's full count for one micro-batch is added
    for the recomputation in flight. Its time: one more forward of the blocks (matmuls,
    attention, elementwise) per micro-batch, ``+ T (matmul_blocks / F + attn / A + ew_blocks
    b / E)`` in ``compute``, and one more forward of the TP all-reduces (2 per layer).
``buffers``
    the gradient all-reduce bucket (a flat copy of all gradients); it lives after the
    backward pass, when activations are gone, so the peak is
    ``state + grads + zero3_working + max(activations, buffers) + reserved``.

Time of one optimizer step (per-stage quantities for the busiest stage)
-----------------------------------------------------------------------
Let ``T = mb * seq`` tokens per micro-batch, ``m = global_batch / (dp * mb)`` micro-batches
per rank, ``b`` the param dtype's bytes, and for one rank: ``F`` its matmul flops/s in the
model's dtype (a GPU's float32 rate is its CUDA cores', ``fp32_flops_per_second``), ``A``
its fused-attention flops/s (no more than ``F`` in float32), ``E`` its rate of elementwise activation kernels and ``M`` its
streaming memory bandwidth (both bytes read + written per second), ``o`` its host time per
operator.

``compute`` per micro-batch and stage, forward + backward = 3 x forward:
    ``3 T matmul / F + 3 T attn / A + 3 T elementwise b / E + ops o + (m-1)/m 3 W b / M``
    ``matmul = sum over the stage's weight matrices of 2 * tp_local_numel`` (forward = 2
    flops per weight per token; the embedding lookup is free, the head or tied embedding on
    the last stage is a matmul; a routed expert counts ``top_k / experts_local`` of its
    stacked weights); ``attn = 2 * seq * heads * head_dim / tp`` per layer (QK^T and AV,
    causal: half of 4 * seq * d); ``elementwise`` counts the elements that the non-matmul
    kernels read and write per token (norms, residual adds, activation functions, copies,
    RoPE, softmax of the cross-entropy): ``16h`` replicated plus the split MLP / attention
    part, see :func:`stagecost._layer_counts` (on GPUs ~10% of the step; on CPUs, where
    GELU and friends are slow, a quarter); ``ops`` is the stage's operator count
    (:data:`stagecost.BLOCK_OPS`: 118 per GPT block, counted with torch.profiler), which
    matters for small models on CPUs (~0.5 ms per block) and is 0 on GPUs; the last term is
    autograd accumulating each micro-batch's gradients of the stage's ``W`` working weights
    into the previous ones.
``tp_comm``
    per layer and micro-batch 4 all-reduces of the activation ``T * h * b`` (Megatron's f and
    g, 2 forward and 2 backward; MoE: 3 + top_k), plus 1 on the first stage (vocab-parallel
    embedding), 1 + 3 small ones on the last (head input, vocab-parallel cross-entropy). A
    ring all-reduce of B bytes over n ranks costs ``alpha + 2 * (n - 1) / n * B / bw``, with
    ``bw`` the intra-node bandwidth if the group sits in one node, else the inter-node one.
``ep_comm``
    per MoE layer and micro-batch: one count exchange and 4 all-to-alls (dispatch and combine,
    forward and backward) of ``top_k * T * h * b`` bytes, of which ``(ep - 1) / ep`` leave
    the rank: ``alpha + (ep - 1) / ep * B / bw`` each.
``pp_comm``
    per micro-batch and stage boundary: the activation forward and its gradient backward,
    ``2 * (alpha + T * h * b / bw)``.
pipeline (GPipe and 1F1B alike) and ``bubble``
    with ``c_s`` = compute and ``k_s`` = tp + ep + pp communication of stage s per
    micro-batch, the schedule runs ``m + pp - 1`` slots; slot i keeps the stages
    ``max(0, i - m + 1) .. min(i, pp - 1)`` busy and lasts ``max over busy s of (c_s +
    k_s)``: on dedicated devices the textbook ``(m + pp - 1) * t`` for equal stages, and
    ``(m - 1) * max t_s + sum t_s`` in general. On shared cores (below) a slot also lasts at
    least ``max k_s + dp * tp * sum of busy c_s / (ranks that can compute at once)``: the
    busy ranks' work has to fit through the cores, and a light stage that is done leaves its
    core to a heavy one (processor sharing); with a single stage this is ``share * c + k``,
    ``share = max(1, ranks / ranks that can compute at once)``. ``compute`` and the
    communication terms are m steady-state slots; ``bubble`` is what fill and drain add. 1F1B
    has GPipe's fill and drain (the same ``pp - 1`` slots, Narayanan et al. 2021), and the
    trainer overlaps no message with compute in either, so both schedules get this time; they
    differ in ``activations`` only.
``dp_comm``
    after the backward pass (the trainer does not overlap it): a bucketed all-reduce of the
    stage's dense gradients over dp and of its expert gradients over expert-dp
    (``2 * (n - 1) / n * B / bw + alpha``), plus the bucket's pack and unpack
    (``4 * B / M``), plus the tied-embedding all-reduce between the first and last stage
    (pp > 1) and the replicated-kv-head all-reduce (tp > kv heads).
``zero_comm``
    the reference trainer rebuilds parameters with a zero-padded all-reduce of the full
    working weights: after the optimizer for ZeRO-1, before the forward for ZeRO-3, so
    each costs one more gradient-sized all-reduce (:data:`REFERENCE_ZERO_TRAFFIC`). An
    ideal implementation (reduce-scatter + all-gather: ZeRO-1 no extra volume, ZeRO-3 1.5x
    with parameters gathered in forward and backward) is :data:`IDEAL_ZERO_TRAFFIC`.
``optimizer``
    torch's per-tensor AdamW streams ~80 bytes per master element (about ten elementwise
    passes over param, grad and both moments): ``80 * master_elements / M``; with ranks
    sharing cores (below) this and the bucket copies run at the fully shared speed.
``other``
    the loss all-reduce over the world (one ``alpha``).

``step_seconds`` is the sum, ``tokens_per_second = global_batch * seq / step_seconds``.

Ranks that share CPU cores
--------------------------
A profile with ``shared_cores = C > 0`` describes worker processes on one machine, as the
local runner starts them: its flop rate and memory bandwidth are per core, and a rank of a
world of W processes runs ``t = max(1, C // W)`` threads (what
:func:`dynatrain.trainer.launch.run_local` sets), so it computes at ``t`` times the per-core
rate when it has the cores to itself and at most ``C / t`` ranks compute at full speed at
once: with 4 ranks on 2 cores each gets half a core while all are busy, but the one busy
stage at the start of a pipeline gets a whole core. ``memory_bytes`` is then the machine's
memory, shared equally by the W ranks. Collectives among such ranks are slow for a reason
that has nothing to do with bytes: when ranks outnumber cores, each step of a ring waits
until the scheduler runs the peer. :func:`calibrate.measure_gloo_link` measures that per
group size (``group_latency_seconds``); ``benchmarks/solver_vs_measured.py`` found ~1-3 ms
for pairs and ~6 ms for groups of 4 on 4 ranks sharing 2 cores, against 0.3 ms with a core
each.

Not modelled (see also the benchmark ``benchmarks/solver_vs_measured.py``): overlap of
communication with compute (the trainer has none, but a faster trainer would), matmul
efficiency falling with small TP shards or short sequences (``F`` is one figure per
device), latency growing with the group size on GPUs (one ``latency_seconds``) and the
oversubscription latency of a world size other than the one measured, stragglers and load
from other processes, interleaved (virtual-stage) schedules, selective recomputation,
memory fragmentation beyond ``reserved_bytes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from dynatrain.vps.layout import Layout, LayoutError, bind, layout_problems, micro_batch_shares
from dynatrain.vps.model import DTYPE_BYTES, ModelSpec

from dynatrain.spec.hardware import GiB, DeviceProfile
from dynatrain.vps.stagecost import _layer_counts, stage_costs

REFERENCE_ZERO_TRAFFIC = {0: 0.0, 1: 1.0, 3: 1.0}
"""Extra parameter-rebuild all-reduces per step, in units of one gradient all-reduce, for the
reference trainer (:mod:`dynatrain.trainer.optim`: a zero-padded all-reduce, which works on
gloo whose reduce-scatter and uneven all-gather are incomplete)."""
IDEAL_ZERO_TRAFFIC = {0: 0.0, 1: 0.0, 3: 0.5}
"""The same for an implementation with reduce-scatter + all-gather (ZeRO paper's volumes)."""

ADAMW_BYTES_PER_ELEMENT = 80
"""Memory traffic of torch's per-tensor (foreach=False) AdamW per master element: weight decay
(r4 w4), exp_avg lerp (r8 w4), exp_avg_sq mul + addcmul (r4 w4, r8 w4), sqrt, divide, add eps
(3 x r4 w4), addcdiv (r12 w4)."""


class SolverError(ValueError):
    """No layout can run: the message says why (memory needed vs available, batch divisibility,
    layout problems)."""


@dataclass
class Estimate:
    """The cost model's verdict on one layout."""

    layout: Layout
    tokens_per_second: float
    step_seconds: float
    memory_bytes: int
    """Peak per device (state + gradients + activations + working buffers + reserved)."""
    breakdown: dict[str, float]
    """Seconds per step: compute, bubble, tp_comm, ep_comm, pp_comm, dp_comm, zero_comm,
    optimizer, other. They sum to ``step_seconds``."""
    fits: bool
    memory_breakdown: dict[str, int] = field(default_factory=dict)
    """Bytes per device: state, grads, zero3_working, activations, buffers, reserved."""
    available_bytes: int = 0
    stage_activations: tuple[int, ...] = ()
    """Peak activation bytes of each pipeline stage's busiest rank, under the layout's
    schedule (the ``activations`` term per stage)."""
    stage_compute: tuple[float, ...] = ()
    """Seconds each pipeline stage's ranks compute per micro-batch, forward and backward
    (``c_s`` in the module docstring): what a stage costs with its layers, for the per-layer
    model of :mod:`.layercost`."""

    def __str__(self) -> str:
        fits = "" if self.fits else f" (does not fit in {format_gib(self.available_bytes)})"
        return (f"{self.layout.to_text()}: {self.tokens_per_second:,.0f} tok/s, "
                f"{self.step_seconds * 1e3:.1f} ms/step, {format_gib(self.memory_bytes)} "
                f"per device{fits}")


def format_gib(n: float) -> str:
    """Bytes as GiB with two decimals, as the solver's messages show them."""
    return f"{n / GiB:.2f} GiB"


# -- communication ------------------------------------------------------------------------------

def _link(layout: Layout, profile: DeviceProfile, ranks) -> float:
    """Bandwidth of a group: intra-node if all its ranks' devices share a node."""
    nodes = {layout.device_of[r] // profile.devices_per_node for r in ranks}
    return (profile.intra_node_bytes_per_second if len(nodes) == 1
            else profile.inter_node_bytes_per_second)


def _all_reduce(nbytes: float, n: int, bw: float, alpha: float) -> float:
    """Ring all-reduce: every rank sends and receives 2 (n - 1) / n of the buffer."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return alpha + 2 * (n - 1) / n * nbytes / bw


def _group_links(layout: Layout, profile: DeviceProfile) -> dict[str, float]:
    """Bandwidth per axis, judged from the groups of rank 0 and every stage boundary."""
    lay = layout
    r = lay.rank
    out = {
        "tp": _link(lay, profile, [r(0, 0, t) for t in range(lay.tp)]),
        "dp": _link(lay, profile, [r(0, j, 0) for j in range(lay.dp)]),
        "edp": _link(lay, profile, [r(0, j, 0) for j in range(0, lay.dp, lay.ep)]),
        "ep": _link(lay, profile, [r(0, j, 0) for j in range(lay.ep)]),
        "embed": _link(lay, profile, [r(0, 0, 0), r(lay.pp - 1, 0, 0)]),
    }
    out["pp"] = min((_link(lay, profile, [r(p, 0, 0), r(p + 1, 0, 0)])
                     for p in range(lay.pp - 1)), default=profile.intra_node_bytes_per_second)
    return out


# -- the model -----------------------------------------------------------------------------------

def check_batch(model: ModelSpec, global_batch_size: int, micro_batch_size: int,
                seq_len: int) -> None:
    """Raise SolverError naming every batch figure that no layout could run with."""
    problems = []
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        problems.append(f"global_batch_size={global_batch_size!r} must be a positive integer")
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        problems.append(f"micro_batch_size={micro_batch_size!r} must be a positive integer")
    if not isinstance(seq_len, int) or not 1 <= seq_len <= model.max_seq_len:
        problems.append(f"seq_len={seq_len!r} must be in 1..{model.max_seq_len} "
                        f"(max_seq_len of {model.name})")
    if problems:
        raise SolverError("; ".join(problems))


def estimate(model: ModelSpec, layout: Layout, profile: DeviceProfile, *,
             global_batch_size: int, micro_batch_size: int = 1, seq_len: int,
             zero_traffic: dict[int, float] | None = None,
             activation_checkpointing: bool = False) -> Estimate:
    """Throughput and peak memory of ``layout`` (see the module docstring for the formulas),
    under its pipeline schedule, with or without per-block activation checkpointing.

    Raises SolverError if the layout cannot run the model at all (layout problems, a global
    batch that dp * micro_batch_size does not divide, or shares that do not sum to it).
    """
    check_batch(model, global_batch_size, micro_batch_size, seq_len)
    problems = layout_problems(layout, model)
    try:
        shares = micro_batch_shares(layout, global_batch_size, micro_batch_size)
    except LayoutError as e:
        problems.append(str(e))
    if problems:
        raise SolverError(f"layout {layout.to_text()!r} cannot run {model.name}: "
                          + "; ".join(problems))
    zero_traffic = REFERENCE_ZERO_TRAFFIC if zero_traffic is None else zero_traffic
    key = replace(layout, devices=None, stages=bind(layout, model).layout.stages)
    stages = stage_costs(model, key)
    lay = layout
    world, dp, tp, pp, ep = lay.world, lay.dp, lay.tp, lay.pp, lay.ep
    b = DTYPE_BYTES[model.dtype]
    alpha = profile.latency
    flops = profile.rank_flops(world, model.dtype)
    mem_bw = profile.rank_memory_bandwidth(world)
    ew_rate = profile.rank_elementwise_rate(world)
    attn_rate = profile.rank_attention_flops(world, model.dtype)
    concurrent = profile.concurrent_ranks(world)
    links = _group_links(lay, profile)
    # On devices alike, the data-parallel rank with the most micro-batches sets the pace
    # (uneven shares pay off only where devices are not alike: the measured rule prices that).
    m = max(shares)
    tokens = micro_batch_size * seq_len
    act_bytes = tokens * model.hidden_size * b

    # Per block and token: elementwise elements, saved elements, TP all-reduces (fwd + bwd).
    _, block_ew, block_saved, block_reduces = _layer_counts(model, tp)
    layers_of = key.stages

    # Per micro-batch (forward + backward) and stage: compute c_s and communication k_s.
    compute, tp_c, ep_c, pp_c = [], [], [], []
    for st in stages:
        working_b = (st.dense_elements + st.expert_elements) * b
        layers = layers_of[st.index]
        compute.append(3 * tokens * st.matmul_flops / flops
                       + 3 * tokens * st.attn_flops * seq_len / attn_rate
                       + 3 * tokens * st.elementwise * b / ew_rate
                       + st.ops * profile.op_seconds
                       # autograd adds each micro-batch's weight gradients to the previous
                       # ones: read 2, write 1 gradient per micro-batch after the first
                       + (m - 1) / m * 3 * working_b / mem_bw)
        tp_c.append(st.tp_reduces * _all_reduce(act_bytes, tp, links["tp"], alpha(tp))
                    + st.tp_small_reduces * _all_reduce(tokens * 4, tp, links["tp"], alpha(tp)))
        if st.moe_layers and ep > 1:
            moved = (ep - 1) / ep * model.experts_top_k * act_bytes / links["ep"]
            ep_c.append(st.moe_layers * (alpha(ep) + 4 * (alpha(ep) + moved)))
        else:
            ep_c.append(0.0)
        if activation_checkpointing:
            # One more forward of the blocks: their matmuls (the stage's less the head on the
            # last stage), attention, elementwise kernels, forward TP all-reduces and EP
            # exchanges (count, dispatch, combine).
            head = 2 * model.vocab_size / tp * model.hidden_size if st.index == pp - 1 else 0
            compute[-1] += (tokens * (st.matmul_flops - head) / flops
                            + tokens * st.attn_flops * seq_len / attn_rate
                            + tokens * layers * block_ew * b / ew_rate)
            tp_c[-1] += layers * block_reduces / 2 * _all_reduce(act_bytes, tp, links["tp"],
                                                                  alpha(tp))
            if st.moe_layers and ep > 1:
                ep_c[-1] += st.moe_layers * (alpha(ep) + 2 * (alpha(ep) + moved))
        pp_c.append(2 * (alpha(2) + act_bytes / links["pp"]) if pp > 1 else 0.0)
    comm = [tp_c[s] + ep_c[s] + pp_c[s] for s in range(pp)]

    def slot(lo: int, hi: int) -> float:
        """One pipeline slot with stages lo..hi busy: no stage is faster than on its own, and
        on shared cores the busy ranks' work also has to fit through the cores (processor
        sharing: a light stage that is done leaves its core to the heavy one)."""
        busy = range(lo, hi + 1)
        own = max(compute[s] + comm[s] for s in busy)
        if concurrent == math.inf:
            return own
        through_cores = max(comm[s] for s in busy) \
            + dp * tp * sum(compute[s] for s in busy) / concurrent
        return max(own, through_cores)

    if m >= pp:   # fill, steady state (every stage busy), drain
        steady = slot(0, pp - 1)
        pipeline = (m - pp + 1) * steady
        pipeline += sum(slot(0, i) for i in range(pp - 1))
        pipeline += sum(slot(i - m + 1, pp - 1) for i in range(m, m + pp - 1))
    else:
        steady = slot(0, pp - 1) if m == pp else max(
            slot(max(0, i - m + 1), min(i, pp - 1)) for i in range(m + pp - 1))
        pipeline = sum(slot(max(0, i - m + 1), min(i, pp - 1)) for i in range(m + pp - 1))
    # Breakdown: m steady slots, split into the communication of the stage that talks most
    # and compute (the rest); the bubble is what the pipeline takes beyond them.
    talk = max(range(pp), key=lambda s: comm[s])
    parts = {"compute": m * (steady - comm[talk]), "tp_comm": m * tp_c[talk],
             "ep_comm": m * ep_c[talk], "pp_comm": m * pp_c[talk]}
    bubble = pipeline - m * steady
    if bubble < 0:   # shared cores: fill and drain slots run faster than steady ones
        scale = pipeline / (m * steady)
        parts = {k: v * scale for k, v in parts.items()}
        bubble = 0.0
    full_share = max(1.0, world / concurrent)

    # After the backward pass: gradient reduction, ZeRO rebuilds, optimizer. Stages do this
    # in parallel; the slowest counts. Every rank copies and updates at the same time, so on
    # shared cores these run at the fully shared speed.
    dp_comm = zero_comm = optimizer = 0.0
    edp = dp // ep
    for st in stages:
        dense_b, expert_b = st.dense_elements * b, st.expert_elements * b
        grads = (_all_reduce(dense_b, dp, links["dp"], alpha(dp))
                 + _all_reduce(expert_b, edp, links["edp"], alpha(edp)))
        packing = 4 * ((dense_b if dp > 1 else 0) + (expert_b if edp > 1 else 0)) \
            / mem_bw * full_share
        kv_group = tp // max(1, model.num_kv_heads)
        shared = (_all_reduce(st.embed_elements * b, 2, links["embed"], alpha(2))
                  + _all_reduce(st.kv_elements * b, kv_group, links["tp"], alpha(kv_group)))
        dp_comm = max(dp_comm, grads + packing + shared)
        zero_comm = max(zero_comm, zero_traffic.get(lay.zero, 0.0) * (grads + packing))
        optimizer = max(optimizer, ADAMW_BYTES_PER_ELEMENT * st.master_elements / mem_bw
                        * full_share)
    other = alpha(world) if world > 1 else 0.0
    breakdown = dict(parts, bubble=bubble, dp_comm=dp_comm, zero_comm=zero_comm,
                     optimizer=optimizer, other=other)
    step = pipeline + dp_comm + zero_comm + optimizer + other

    # Peak memory of the busiest stage.
    peak, mem, stage_acts = -1, {}, []
    for st in stages:
        grads_b = (st.dense_elements + st.expert_elements) * b
        in_flight = min(m, pp - st.index) if lay.schedule == "1f1b" else m
        saved = st.activations
        if activation_checkpointing:      # a block keeps its input; one recomputed at a time
            layers = layers_of[st.index]
            saved -= layers * (block_saved - model.hidden_size)
            acts = int((in_flight * saved + block_saved) * tokens * b)
        else:
            acts = int(in_flight * tokens * saved * b)
        stage_acts.append(acts)
        this = {"state": st.state_bytes, "grads": grads_b,
                "zero3_working": grads_b if lay.zero == 3 else 0,
                "activations": acts, "buffers": grads_b if world > 1 else 0,
                "reserved": profile.reserved_bytes}
        total = (this["state"] + this["grads"] + this["zero3_working"]
                 + max(this["activations"], this["buffers"]) + this["reserved"])
        if total > peak:
            peak, mem = total, this
    available = profile.rank_memory(world)
    return Estimate(layout=layout, tokens_per_second=global_batch_size * seq_len / step,
                    step_seconds=step, memory_bytes=peak, breakdown=breakdown,
                    fits=peak <= available, memory_breakdown=mem, available_bytes=available,
                    stage_activations=tuple(stage_acts), stage_compute=tuple(compute))

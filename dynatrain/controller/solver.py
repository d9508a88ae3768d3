"""The layout solver: which layout trains fastest on the devices at hand, within their memory.

The controller asks this module two questions. *What is the best layout for n devices?*
(:func:`solve`, :func:`best_for_devices`), and *how fast and how big is this layout?*
(:func:`estimate`). Both are answered by an analytic cost model of the reference trainer
(:mod:`dynatrain.trainer`) on a :class:`DeviceProfile`: pure arithmetic over the model spec and
the vps mapping, no torch and no processes, so the controller can weigh a hundred candidate
layouts of a 70B model in well under a second. Only :func:`measure_cpu_profile` and
:func:`measure_gloo_link` touch torch, to calibrate a profile for ranks on this machine.

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
    (:func:`_rank_state_bytes`, tested equal to summing ``rank_shards``), and cached per
    (model, layout): ``solve`` for llama-7b on 64 devices (57 candidates) takes ~0.1 s.
``grads``
    one gradient per TP/EP-local working parameter of the stage, in the param dtype.
``zero3_working``
    ZeRO-3: the reference trainer gathers the whole stage's working weights at the start of
    the step and keeps them until the optimizer has run (one more copy of ``grads``' size).
``activations``
    GPipe (the trainer's schedule, also for pp = 1) keeps every micro-batch's autograd graph
    of the stage until the backward pass: ``m * mb * seq * a_stage * act_bytes`` with ``m =
    global_batch / (dp * mb)`` micro-batches per rank. ``a_stage`` counts the elements saved
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
    logits, shifted, exp in the vocab-parallel cross-entropy).
``buffers``
    the gradient all-reduce bucket (a flat copy of all gradients); it lives after the
    backward pass, when activations are gone, so the peak is
    ``state + grads + zero3_working + max(activations, buffers) + reserved``.

Time of one optimizer step (per-stage quantities for the busiest stage)
-----------------------------------------------------------------------
Let ``T = mb * seq`` tokens per micro-batch, ``m = global_batch / (dp * mb)`` micro-batches
per rank, ``b`` the param dtype's bytes, and for one rank: ``F`` its matmul flops/s, ``A``
its fused-attention flops/s, ``E`` its rate of elementwise activation kernels and ``M`` its
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
    part, see :func:`_layer_counts` (on GPUs ~10% of the step; on CPUs, where GELU and
    friends are slow, a quarter); ``ops`` is the stage's operator count
    (:data:`BLOCK_OPS`: 118 per GPT block, counted with torch.profiler), which matters for
    small models on CPUs (~0.5 ms per block) and is 0 on GPUs; the last term is autograd
    accumulating each micro-batch's gradients of the stage's ``W`` working weights into
    the previous ones.
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
pipeline (GPipe) and ``bubble``
    with ``c_s`` = compute and ``k_s`` = tp + ep + pp communication of stage s per
    micro-batch, the schedule runs ``m + pp - 1`` slots; slot i keeps the stages
    ``max(0, i - m + 1) .. min(i, pp - 1)`` busy and lasts ``max over busy s of (c_s +
    k_s)``: on dedicated devices the textbook ``(m + pp - 1) * t`` for equal stages, and
    ``(m - 1) * max t_s + sum t_s`` in general. On shared cores (below) a slot also lasts at
    least ``max k_s + dp * tp * sum of busy c_s / (ranks that can compute at once)``: the
    busy ranks' work has to fit through the cores, and a light stage that is done leaves its
    core to a heavy one (processor sharing); with a single stage this is ``share * c + k``,
    ``share = max(1, ranks / ranks that can compute at once)``. ``compute`` and the
    communication terms are m steady-state slots; ``bubble`` is what fill and drain add.
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
until the scheduler runs the peer. :func:`measure_gloo_link` measures that per group size
(``group_latency_seconds``); ``benchmarks/solver_vs_measured.py`` found ~1-3 ms for pairs
and ~6 ms for groups of 4 on 4 ranks sharing 2 cores, against 0.3 ms with a core each.

Not modelled (see also the benchmark ``benchmarks/solver_vs_measured.py``): overlap of
communication with compute (the trainer has none, but a faster trainer would), matmul
efficiency falling with small TP shards or short sequences (``F`` is one figure per
device), latency growing with the group size on GPUs (one ``latency_seconds``) and the
oversubscription latency of a world size other than the one measured, stragglers and load
from other processes, 1F1B or interleaved schedules, activation recomputation, memory
fragmentation beyond ``reserved_bytes``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache

from dynatrain.vps.boxes import box_numel
from dynatrain.vps.layout import Layout, bind, layout_problems
from dynatrain.vps.mapping import (flat_shard_range, is_flat_sharded, model_states, rank_shards,
                                  state_itemsize, tp_box)
from dynatrain.vps.model import DTYPE_BYTES, FIRST, LAST, ModelSpec

GiB = 1 << 30

REFERENCE_ZERO_TRAFFIC = {0: 0.0, 1: 1.0, 3: 1.0}
"""Extra parameter-rebuild all-reduces per step, in units of one gradient all-reduce, for the
reference trainer (:mod:`dynatrain.trainer.optim`: a zero-padded all-reduce, which works on
gloo whose reduce-scatter and uneven all-gather are incomplete)."""
IDEAL_ZERO_TRAFFIC = {0: 0.0, 1: 0.0, 3: 0.5}
"""The same for an implementation with reduce-scatter + all-gather (ZeRO paper's volumes)."""

BLOCK_OPS = {"gpt": 118, "llama": 180, "moe": 217, "moe_per_expert": 37,
             "gpt_embed": 12, "llama_embed": 6, "gpt_head": 22, "llama_head": 36}
"""Top-level ATen operators of one forward + backward of the trainer's pieces, counted with
torch.profiler (torch 2.x): a GPT block, a Llama block, an MoE block (217 plus 37 per local
expert: the experts run one by one), the embedding and the head with the loss. Used with
``DeviceProfile.op_seconds`` for the per-operator host overhead."""

ADAMW_BYTES_PER_ELEMENT = 80
"""Memory traffic of torch's per-tensor (foreach=False) AdamW per master element: weight decay
(r4 w4), exp_avg lerp (r8 w4), exp_avg_sq mul + addcmul (r4 w4, r8 w4), sqrt, divide, add eps
(3 x r4 w4), addcdiv (r12 w4)."""


class SolverError(ValueError):
    """No layout can run: the message says why (memory needed vs available, batch divisibility,
    layout problems)."""


@dataclass(frozen=True)
class DeviceProfile:
    """What the cost model needs to know about one device (and its links)."""

    flops_per_second: float
    """Sustained dense matmul throughput of one device in the model's dtype (per core when
    ``shared_cores`` is set)."""
    memory_bytes: int
    """Usable memory per device (the whole machine's when ``shared_cores`` is set)."""
    intra_node_bytes_per_second: float
    """Achieved collective (bus) bandwidth between devices of one node."""
    inter_node_bytes_per_second: float
    """Achieved collective bandwidth per device across nodes."""
    devices_per_node: int = 8
    latency_seconds: float = 20e-6
    """Fixed cost of one collective or point-to-point message."""
    group_latency_seconds: tuple[tuple[int, float], ...] = ()
    """(group size, latency) where the latency depends on the group's size, as measured by
    :func:`measure_gloo_link` for ranks sharing cores (a group larger than the number of
    ranks that can run at once must wait for the scheduler to run each member). A group of a
    size not listed takes the entry of the largest listed size below it, else
    ``latency_seconds``."""
    name: str = ""
    memory_bytes_per_second: float = 2e12
    """Sustained memory bandwidth of streaming kernels: the optimizer, bucket copies (per core
    with ``shared_cores``)."""
    elementwise_bytes_per_second: float = 0.0
    """Bytes read + written per second by the activations' elementwise kernels (norms, GELU /
    SiLU, softmax, residual adds); 0 means ``memory_bytes_per_second``. Memory-bound on GPUs;
    on CPUs the transcendental functions make it several times slower than a copy."""
    attention_flops_per_second: float = 0.0
    """Sustained rate of fused attention (scaled_dot_product_attention forward + backward,
    causal flops); 0 means ``flops_per_second``. Flash kernels reach about half the GEMM rate
    on GPUs, CPU kernels a quarter."""
    op_seconds: float = 0.0
    """Host time per operator (dispatch, autograd bookkeeping), paid on the critical path
    when the device runs operators synchronously (CPU); 0 for GPUs, whose asynchronous
    launches overlap it with device work at the sizes this solver is for."""
    reserved_bytes: int = 0
    """Memory per device that training cannot use: runtime context, communicator buffers,
    allocator fragmentation."""
    shared_cores: int = 0
    """0 for accelerators. C > 0: the devices are worker processes sharing C CPU cores of one
    machine (see the module docstring)."""

    # -- how a world of ``world`` ranks sees this profile ---------------------------------------
    def latency(self, group_size: int) -> float:
        """Fixed cost of one collective among ``group_size`` ranks (2: point-to-point)."""
        best = None
        for n, seconds in sorted(self.group_latency_seconds):
            if n <= group_size:
                best = seconds
        return self.latency_seconds if best is None else best

    def threads_per_rank(self, world: int) -> int:
        return max(1, self.shared_cores // world) if self.shared_cores else 1

    def rank_flops(self, world: int) -> float:
        return self.flops_per_second * self.threads_per_rank(world)

    def rank_memory_bandwidth(self, world: int) -> float:
        return self.memory_bytes_per_second * self.threads_per_rank(world)

    def elementwise_rate(self) -> float:
        return self.elementwise_bytes_per_second or self.memory_bytes_per_second

    def rank_elementwise_rate(self, world: int) -> float:
        return self.elementwise_rate() * self.threads_per_rank(world)

    def rank_attention_flops(self, world: int) -> float:
        return (self.attention_flops_per_second or self.flops_per_second) \
            * self.threads_per_rank(world)

    def concurrent_ranks(self, world: int) -> float:
        """How many ranks can compute at full speed at the same time."""
        if not self.shared_cores:
            return math.inf
        return self.shared_cores / self.threads_per_rank(world)

    def rank_memory(self, world: int) -> int:
        return self.memory_bytes // world if self.shared_cores else self.memory_bytes


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _machine_memory() -> int:
    """Available memory of this machine (MemAvailable), or total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 * GiB


# Presets. Matmul rates are ~2/3 of the datasheet's dense bf16 peak, what large GEMMs sustain
# (and an upper bound for a whole model); attention rates are what FlashAttention-2 reports
# for forward + backward (Dao 2023: ~50-70% of peak on A100, ~350 TFLOPS on H100);
# collective bandwidths are NCCL bus bandwidths that nccl-tests typically report on such
# systems, below the link's nominal one-way rate; 2 GiB reserved covers the CUDA context,
# NCCL buffers and allocator fragmentation.
PROFILES: dict[str, DeviceProfile] = {
    # H100 SXM5 80 GB (NVIDIA datasheet: 989 TFLOPS dense bf16, 3.35 TB/s HBM3, NVLink 4 at
    # 450 GB/s per direction; DGX H100: one 400 Gb/s ConnectX-7 NIC per GPU = 50 GB/s).
    "h100": DeviceProfile(
        name="h100", flops_per_second=650e12, memory_bytes=80 * 10**9,
        intra_node_bytes_per_second=360e9, inter_node_bytes_per_second=40e9,
        devices_per_node=8, latency_seconds=20e-6, memory_bytes_per_second=3.0e12,
        attention_flops_per_second=350e12, reserved_bytes=2 * GiB),
    # A100 SXM4 80 GB (312 TFLOPS dense bf16, 2.04 TB/s HBM2e, NVLink 3 at 300 GB/s per
    # direction; DGX A100: one 200 Gb/s HDR NIC per GPU = 25 GB/s).
    "a100": DeviceProfile(
        name="a100", flops_per_second=205e12, memory_bytes=80 * 10**9,
        intra_node_bytes_per_second=230e9, inter_node_bytes_per_second=20e9,
        devices_per_node=8, latency_seconds=25e-6, memory_bytes_per_second=1.8e12,
        attention_flops_per_second=170e12, reserved_bytes=2 * GiB),
    # Worker processes on this machine (the local runner): a static guess per core of a
    # recent x86 server core with AVX-512, from the project's 2-core CI VM (~100 GFLOPS fp32
    # for 512^3 matmuls, ~30 GFLOPS for attention at head dim 32, ~13 GB/s through torch's
    # AdamW, ~8 GB/s for a norm/add/GELU mix, ~5 us per operator, gloo over loopback TCP
    # ~1 GB/s and ~0.3 ms per collective while no more ranks than cores). 300 MiB reserved
    # per rank: a torch process's resident baseline. Prefer measure_cpu_profile(), and pass it
    # measure_gloo_link(n) when ranks outnumber cores: then a collective costs milliseconds.
    "cpu": DeviceProfile(
        name="cpu", flops_per_second=100e9, memory_bytes=_machine_memory(),
        intra_node_bytes_per_second=1e9, inter_node_bytes_per_second=1e9,
        devices_per_node=1 << 16, latency_seconds=300e-6, memory_bytes_per_second=13e9,
        elementwise_bytes_per_second=8e9, attention_flops_per_second=30e9, op_seconds=5e-6,
        reserved_bytes=300 << 20, shared_cores=_cpu_cores()),
}


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

    def __str__(self) -> str:
        return (f"{self.layout.to_text()}: {self.tokens_per_second:,.0f} tok/s, "
                f"{self.step_seconds * 1e3:.1f} ms/step, {_gib(self.memory_bytes)} per device"
                + ("" if self.fits else f" (does not fit in {_gib(self.available_bytes)})"))


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


# -- per-stage analysis (cached per model and layout) ---------------------------------------------

@dataclass(frozen=True)
class _Stage:
    """Per-rank quantities of one pipeline stage that do not depend on batch or device."""

    index: int
    state_bytes: int
    """Exact mapping state of the stage's busiest rank (plus the fp32 ZeRO-1 master clone)."""
    dense_elements: int
    """TP-local working parameter elements of dense tensors."""
    expert_elements: int
    """TP/EP-local working parameter elements of stacked experts."""
    master_elements: int
    """Elements AdamW updates on the rank."""
    embed_elements: int
    """TP-local elements of a tied embedding shared with another stage (0 if none)."""
    kv_elements: int
    """TP-local elements of replicated kv-head weights (tp > kv heads), else 0."""
    matmul_flops: float
    """Forward weight flops per token."""
    attn_flops: float
    """Forward attention flops per token per token of sequence length."""
    elementwise: float
    """Elements read and written by non-matmul kernels per token, forward."""
    activations: float
    """Elements saved for backward per token."""
    tp_reduces: int
    """Activation-sized TP all-reduces per micro-batch (forward + backward)."""
    tp_small_reduces: int
    """All-reduces of one float per token per micro-batch."""
    moe_layers: int
    ops: int
    """Operators per micro-batch, forward + backward (see :data:`BLOCK_OPS`)."""


def _layer_counts(model: ModelSpec, tp: int) -> tuple[float, float, float, int]:
    """Per transformer block and token, on one TP rank: attention flops per unit of sequence
    length, forward elementwise elements, elements saved for backward, activation-sized TP
    all-reduces per micro-batch (forward + backward)."""
    m = model
    h, hd, nh, nkv = m.hidden_size, m.head_dim, m.num_heads, m.num_kv_heads
    attn_width = nh * hd / tp
    attn_flops = 2 * attn_width            # QK^T + AV, 2 * 2 * seq * d, halved by the causal mask
    # Replicated over TP: two norms (read + write h each), two residual adds (2 reads, 1 write),
    # the attention output's reshape copy and the row-parallel outputs (bias add or the
    # all-reduce's clone).
    elementwise = 16 * h
    saved = 4 * h + 5 * attn_width         # norm inputs/outputs; q, k, v, attention out + copy
    if m.arch == "llama":
        elementwise += 6 * (nh + nkv) * hd / tp          # RoPE on q and k
        if nkv < nh:
            elementwise += 4 * attn_width                # GQA: k, v expanded to all heads
    if m.is_moe:
        k, f, e = m.experts_top_k, m.moe_ffn_hidden_size, m.num_experts
        # routing softmax/top-k over E, token gather/scatter/weighting (~7 passes of k*h),
        # SwiGLU inside each expert (silu 2f + mul 3f per routed pair)
        elementwise += 3 * e + 7 * k * h + 5 * k * f / tp
        saved += e + k * (3 * h + 4 * f / tp)
        reduces = 3 + k                     # attention f, g; MoE input f; MoE output of k*h
    elif m.arch == "gpt":
        f = m.ffn_hidden_size
        elementwise += 2 * f / tp          # GELU
        saved += 2 * f / tp
        reduces = 4
    else:
        f = m.ffn_hidden_size
        elementwise += 5 * f / tp          # SiLU (2f) and the gate * up product (3f)
        saved += 4 * f / tp
        reduces = 4
    return attn_flops, elementwise, saved, reduces


def _rank_state_bytes(model: ModelSpec, layout: Layout, tensors, dp_index: int,
                      tp_index: int) -> int:
    """Bytes of every state that rank (dp_index, tp_index) of a stage holds of ``tensors``
    ((tensor, count) pairs: ``count`` tensors that shard like it).

    The single-rank form of :func:`dynatrain.vps.mapping.rank_shards`, built from the
    mapping's own rules (:func:`tp_box`, :func:`flat_shard_range`, :func:`is_flat_sharded`),
    because ``rank_shards`` derives every rank's shards of a tensor to find one rank's, which
    for a 64-way layout costs a second per solve. tests/test_solver.py checks that both give
    the same bytes (:func:`mapping_state_bytes`).
    """
    total = 0
    ep_rank = dp_index % layout.ep
    for t, count in tensors:
        expert = t.expert_dim is not None
        rule = t.rule
        local = box_numel(tp_box(rule, layout.tp, tp_index, layout.ep if expert else 1,
                                 ep_rank if expert else 0))
        start, stop = flat_shard_range(rule, local, layout.dp, layout.ep, dp_index)
        for state in model_states(model):
            n = stop - start if is_flat_sharded(state, layout.zero) else local
            total += count * n * state_itemsize(t, state)
    return total


def mapping_state_bytes(model: ModelSpec, layout: Layout, rank: int) -> int:
    """Bytes of all states ``rank`` holds, summed over ``rank_shards`` (slow, exact; the
    reference the solver's fast path is tested against)."""
    bound = bind(layout, model)
    return sum(math.prod(rs.local_shape) * state_itemsize(rs.tensor, rs.state)
               for rs in rank_shards(bound, rank))


@lru_cache(maxsize=64)
def _tensor_groups(model: ModelSpec):
    """The model's tensors grouped by everything the cost model looks at (sharding rule,
    dtype, tie, name class), per layer: {layer: {key: count}} and {key: a tensor}. Every
    block of a model has the same groups, so a stage is a few dozen groups, not thousands of
    tensors."""
    by_layer: dict[int, dict] = {}
    rep = {}
    for t in model.tensors:
        kind = t.name if t.name in ("embed.tokens", "embed.positions") else "weight"
        key = (t.signature, kind)
        rep.setdefault(key, t)
        counts = by_layer.setdefault(t.layer, {})
        counts[key] = counts.get(key, 0) + 1
    return by_layer, rep


def _stage_tensors(model: ModelSpec, bound, stage: int) -> list:
    """(representative tensor, count) of every tensor group on ``stage``."""
    by_layer, rep = _tensor_groups(model)
    counts: dict = {}
    layers = list(bound.stage_layers(stage))
    if stage == 0:
        layers.append(FIRST)
    if stage == bound.layout.pp - 1:
        layers.append(LAST)
    for layer in layers:
        for key, n in by_layer.get(layer, {}).items():
            counts[key] = counts.get(key, 0) + n
    if stage == bound.layout.pp - 1 and stage != 0:     # tied embedding replica
        for key, n in by_layer.get(FIRST, {}).items():
            if rep[key].tied_to_last:
                counts[key] = counts.get(key, 0) + n
    return [(rep[key], n) for key, n in counts.items()]


@lru_cache(maxsize=4096)
def _stages(model: ModelSpec, layout: Layout) -> tuple[_Stage, ...]:
    """Every pipeline stage's per-rank quantities (layout with stages resolved, no devices)."""
    bound = bind(layout, model)
    lay = bound.layout
    tp, dp, ep = lay.tp, lay.dp, lay.ep
    attn_flops, layer_ew, layer_saved, layer_reduces = _layer_counts(model, tp)
    vocab_local = model.vocab_size / tp
    h = model.hidden_size
    out, by_shape = [], {}
    for s in range(lay.pp):
        first, last = s == 0, s == lay.pp - 1
        layers = lay.stages[s]
        shape = (layers, first, last)
        if shape in by_shape:               # stages of equal shape cost the same
            out.append(replace(by_shape[shape], index=s))
            continue
        tensors = _stage_tensors(model, bound, s)
        dense = expert = masters = embed = kv = 0
        matmul = 0.0
        for t, count in tensors:
            rule = t.rule
            is_expert = t.expert_dim is not None
            local = box_numel(tp_box(rule, tp, 0, ep if is_expert else 1, 0))
            if is_expert:
                expert += count * local
                matmul += count * 2 * model.experts_top_k * local / (model.num_experts // ep)
            else:
                dense += count * local
                # a weight matrix is a matmul; the token embedding is a lookup on the first
                # stage and the (tied) head matmul on the last; position embeddings are added
                if len(t.shape) >= 2 and t.name != "embed.positions" \
                        and (t.name != "embed.tokens" or last):
                    matmul += count * 2 * local
            if lay.zero:
                a, b = flat_shard_range(rule, local, dp, ep, 0)
                masters += count * (b - a)
            else:
                masters += count * local
            if t.tied_to_last and lay.pp > 1:
                embed += count * local
            if t.tp_replicable and tp > model.num_kv_heads:
                kv += count * local
        # The busiest rank of a stage is its (dp 0, tp 0) rank: uneven ZeRO ranges give
        # their extra element to the first ranks.
        state = _rank_state_bytes(model, lay, tensors, 0, 0)
        if model.dtype == "float32" and lay.zero == 1:
            state += 4 * masters            # the trainer's fp32 master clone of its ZeRO range
        ew = layers * layer_ew
        saved = layers * layer_saved
        reduces = layers * layer_reduces
        small = 0
        if first:
            ew += 2 * h + (3 * h if model.arch == "gpt" else 0)   # lookup (+ positions add)
            saved += h
            reduces += 1                                          # vocab-parallel embedding
        if last:
            ew += 2 * h + 6 * vocab_local                         # final norm, cross-entropy
            saved += 2 * h + 3 * vocab_local
            reduces += 1                                          # head input (backward)
            small += 3                                            # max, sum-exp, target logit
        if tp == 1:
            reduces = small = 0
        if model.is_moe:
            block_ops = BLOCK_OPS["moe"] + BLOCK_OPS["moe_per_expert"] * (model.num_experts // ep)
        else:
            block_ops = BLOCK_OPS[model.arch]
        ops = (layers * block_ops + (BLOCK_OPS[f"{model.arch}_embed"] if first else 0)
               + (BLOCK_OPS[f"{model.arch}_head"] if last else 0))
        stage = _Stage(index=s, state_bytes=state, dense_elements=dense,
                       expert_elements=expert, master_elements=masters, embed_elements=embed,
                       kv_elements=kv, matmul_flops=matmul, attn_flops=layers * attn_flops,
                       elementwise=ew, activations=saved, tp_reduces=reduces,
                       tp_small_reduces=small,
                       moe_layers=layers if model.is_moe else 0, ops=ops)
        by_shape[shape] = stage
        out.append(stage)
    return tuple(out)


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

def _check_batch(model: ModelSpec, global_batch_size: int, micro_batch_size: int,
                 seq_len: int) -> None:
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
             zero_traffic: dict[int, float] | None = None) -> Estimate:
    """Throughput and peak memory of ``layout`` (see the module docstring for the formulas).

    Raises SolverError if the layout cannot run the model at all (layout problems, or a
    global batch that dp * micro_batch_size does not divide).
    """
    _check_batch(model, global_batch_size, micro_batch_size, seq_len)
    problems = layout_problems(layout, model)
    if global_batch_size % (layout.dp * micro_batch_size):
        problems.append(f"global_batch_size={global_batch_size} is not a multiple of "
                        f"dp * micro_batch_size = {layout.dp} * {micro_batch_size}")
    if problems:
        raise SolverError(f"layout {layout.to_text()!r} cannot run {model.name}: "
                          + "; ".join(problems))
    zero_traffic = REFERENCE_ZERO_TRAFFIC if zero_traffic is None else zero_traffic
    key = replace(layout, devices=None, stages=bind(layout, model).layout.stages)
    stages = _stages(model, key)
    lay = layout
    world, dp, tp, pp, ep = lay.world, lay.dp, lay.tp, lay.pp, lay.ep
    b = DTYPE_BYTES[model.dtype]
    alpha = profile.latency
    flops = profile.rank_flops(world)
    mem_bw = profile.rank_memory_bandwidth(world)
    ew_rate = profile.rank_elementwise_rate(world)
    attn_rate = profile.rank_attention_flops(world)
    concurrent = profile.concurrent_ranks(world)
    links = _group_links(lay, profile)
    m = global_batch_size // (dp * micro_batch_size)
    tokens = micro_batch_size * seq_len
    act_bytes = tokens * model.hidden_size * b

    # Per micro-batch (forward + backward) and stage: compute c_s and communication k_s.
    compute, tp_c, ep_c, pp_c = [], [], [], []
    for st in stages:
        working_b = (st.dense_elements + st.expert_elements) * b
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
    peak, mem = -1, {}
    for st in stages:
        grads_b = (st.dense_elements + st.expert_elements) * b
        acts = int(m * tokens * st.activations * b)
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
                    fits=peak <= available, memory_breakdown=mem, available_bytes=available)


# -- search -------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _raw_layouts(model: ModelSpec, num_devices: int, zero_stages, max_tp: int | None):
    """Valid layouts of ``num_devices`` ignoring the batch; ZeRO > 0 only where dp > 1 (with
    one data-parallel rank ZeRO shards nothing and only costs)."""
    zero_stages = tuple(dict.fromkeys(zero_stages))
    if not zero_stages or any(z not in (0, 1, 3) for z in zero_stages):
        raise SolverError(f"zero_stages={zero_stages!r} must list ZeRO stages from 0, 1, 3")
    for tp in _divisors(num_devices):
        if max_tp is not None and tp > max_tp:
            continue
        for pp in _divisors(num_devices // tp):
            dp = num_devices // (tp * pp)
            eps = ([e for e in _divisors(dp) if model.num_experts % e == 0] if model.is_moe
                   else [1])
            for ep in eps:
                zeros = zero_stages if dp > 1 else (min(zero_stages),)
                for zero in zeros:
                    layout = Layout(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero)
                    if not layout_problems(layout, model, num_devices):
                        yield layout


def candidate_layouts(model: ModelSpec, num_devices: int, *, global_batch_size: int,
                      micro_batch_size: int = 1, zero_stages=(0, 1, 3),
                      max_tp: int | None = None) -> list[Layout]:
    """Every layout (dp, tp, pp, ep, zero; default stages and order) of exactly
    ``num_devices`` ranks that can run ``model`` and whose dp * micro_batch_size divides the
    global batch. EP only for MoE models (dividing dp and the expert count); tp at most
    ``max_tp`` (the controller passes devices_per_node: TP across nodes never pays). ZeRO
    stages other than the smallest given are left out when dp = 1. Deterministic order:
    tp, then pp, then ep, then zero ascending."""
    if num_devices < 1:
        return []
    return [lay for lay in _raw_layouts(model, num_devices, zero_stages, max_tp)
            if global_batch_size % (lay.dp * micro_batch_size) == 0]


def _rank_key(e: Estimate):
    """Best first: throughput (to 9 significant digits, so float noise cannot outvote the
    tie-breaks), then less memory, fewer tp, fewer pp, fewer ep, lower ZeRO stage, text."""
    lay = e.layout
    return (-float(f"{e.tokens_per_second:.9g}"), e.memory_bytes, lay.tp, lay.pp, lay.ep,
            lay.zero, lay.to_text())


def _no_candidates(model, num_devices, global_batch_size, micro_batch_size, zero_stages,
                   max_tp) -> str:
    raw = list(_raw_layouts(model, num_devices, zero_stages, max_tp))
    if raw:
        dps = sorted({lay.dp for lay in raw})
        return (f"global_batch_size={global_batch_size} is not a multiple of dp * "
                f"micro_batch_size for any layout of {model.name} on {num_devices} devices: "
                f"valid dp values are {', '.join(map(str, dps))} with micro_batch_size="
                f"{micro_batch_size}; choose a global batch divisible by "
                f"{min(dps) * micro_batch_size} (or use a different number of devices)")
    tp_note = f" with tp <= {max_tp}" if max_tp is not None else ""
    return (f"no layout of {num_devices} devices{tp_note} passes validation for {model.name}: "
            + "; ".join(layout_problems(Layout(dp=1, tp=num_devices), model, num_devices)))


def _too_big(model, num_devices, ests: list[Estimate]) -> str:
    small = min(ests, key=lambda e: (e.memory_bytes, _rank_key(e)))
    mb = small.memory_breakdown
    return (f"no layout of {model.name} on {num_devices} devices fits in memory: the "
            f"smallest need is {_gib(small.memory_bytes)} per device "
            f"({small.layout.to_text()}: state {_gib(mb['state'])}, grads "
            f"{_gib(mb['grads'])}, activations {_gib(mb['activations'])}), available "
            f"{_gib(small.available_bytes)}; use more devices, a smaller micro batch or "
            "global batch, or a shorter sequence")


def solve(model: ModelSpec, num_devices: int, profile: DeviceProfile, *,
          global_batch_size: int, micro_batch_size: int = 1, seq_len: int,
          fixed: Layout | None = None, zero_stages=(0, 1, 3),
          allow=None) -> Estimate:
    """The fastest layout of exactly ``num_devices`` devices that fits in memory.

    With ``fixed``, only that layout is validated (against the model, the device count and
    the batch) and estimated. ``allow(layout)`` narrows the candidates (a job's
    ``spec.parallelism.limits``). Raises SolverError naming why when nothing fits.
    """
    _check_batch(model, global_batch_size, micro_batch_size, seq_len)
    kw = dict(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
              seq_len=seq_len)
    if fixed is not None:
        problems = layout_problems(fixed, model, None if fixed.devices else num_devices)
        if fixed.devices is not None and fixed.world != num_devices:
            problems.append(f"it has {fixed.world} ranks but {num_devices} devices are given")
        if problems:
            raise SolverError(f"layout {fixed.to_text()!r} cannot run {model.name} on "
                              f"{num_devices} devices: " + "; ".join(problems))
        est = estimate(model, fixed, profile, **kw)
        if not est.fits:
            mb = est.memory_breakdown
            raise SolverError(
                f"layout {fixed.to_text()!r} of {model.name} needs {_gib(est.memory_bytes)} "
                f"per device (state {_gib(mb['state'])}, grads {_gib(mb['grads'])}, "
                f"activations {_gib(mb['activations'])}), available "
                f"{_gib(est.available_bytes)}")
        return est
    if not isinstance(num_devices, int) or num_devices < 1:
        raise SolverError(f"num_devices={num_devices!r} must be a positive integer")
    max_tp = profile.devices_per_node
    layouts = candidate_layouts(model, num_devices, zero_stages=zero_stages, max_tp=max_tp,
                                global_batch_size=global_batch_size,
                                micro_batch_size=micro_batch_size)
    if not layouts:
        raise SolverError(_no_candidates(model, num_devices, global_batch_size,
                                         micro_batch_size, zero_stages, max_tp))
    if allow is not None:
        allowed = [lay for lay in layouts if allow(lay)]
        if not allowed:
            raise SolverError(f"none of the {len(layouts)} layouts of {num_devices} devices "
                              f"is within spec.parallelism.limits (e.g. "
                              f"{layouts[0].to_text()!r} is not)")
        layouts = allowed
    ests = [estimate(model, lay, profile, **kw) for lay in layouts]
    fitting = [e for e in ests if e.fits]
    if not fitting:
        raise SolverError(_too_big(model, num_devices, ests))
    return min(fitting, key=_rank_key)


def best_for_devices(model: ModelSpec, max_devices: int, profile: DeviceProfile, *,
                     global_batch_size: int, micro_batch_size: int = 1, seq_len: int,
                     min_devices: int = 1, zero_stages=(0, 1, 3)) -> Estimate:
    """The fastest fitting layout over every device count in ``min_devices..max_devices``
    (the controller may leave devices idle, e.g. when 5 does not divide the batch). Equal
    throughput: the fewer devices win."""
    if max_devices < max(1, min_devices):
        raise SolverError(f"max_devices={max_devices} is below min_devices={min_devices}")
    best, errors = None, []
    for n in range(max(1, min_devices), max_devices + 1):
        try:
            e = solve(model, n, profile, global_batch_size=global_batch_size,
                      micro_batch_size=micro_batch_size, seq_len=seq_len,
                      zero_stages=zero_stages)
        except SolverError as err:
            errors.append((n, str(err)))
            continue
        if best is None or float(f"{e.tokens_per_second:.9g}") > \
                float(f"{best.tokens_per_second:.9g}"):
            best = e
    if best is None:
        n, why = errors[-1]
        raise SolverError(f"no device count in {max(1, min_devices)}..{max_devices} can run "
                          f"{model.name}; with {n}: {why}")
    return best


# -- calibration on this machine ------------------------------------------------------------------

def _best_rate(fn, work: float, repeats: int, budget_s: float) -> float:
    """work / the fastest of ``repeats`` timed calls (other load only ever slows a call)."""
    fn()                                   # warm-up: allocation, kernel selection
    best, deadline = math.inf, time.perf_counter() + budget_s
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > deadline:
            break
    return work / best


@dataclass(frozen=True)
class GlooLink:
    """What :func:`measure_gloo_link` found among the ranks of one machine."""

    latency_seconds: float
    """Latency of a collective over all the ranks."""
    bytes_per_second: float
    """Ring all-reduce bandwidth over all the ranks."""
    group_latency_seconds: tuple[tuple[int, float], ...] = ()
    """(group size, latency) for every group size that divides the world (2: pairs)."""


def measure_cpu_profile(threads: int | None = None, *,
                        link: GlooLink | None = None) -> DeviceProfile:
    """A profile of this machine for ranks run by the local runner, probed in ~0.2 s.

    * flops: the best of several fp32 512 x 512 x 512 matmuls;
    * ``memory_bytes_per_second``: one step of torch's per-tensor AdamW on 1 M floats, as
      :data:`ADAMW_BYTES_PER_ELEMENT` bytes per element (the optimizer is the main
      streaming kernel of a step);
    * ``elementwise_bytes_per_second``: bytes read and written by a layer norm, a residual
      add, a GELU and a copy of 512 K floats (a transformer block's elementwise mix: the
      GELU, compute-bound on a CPU, takes most of the time);
    * ``attention_flops_per_second``: causal ``scaled_dot_product_attention`` forward +
      backward at 128 tokens, 8 heads of 32 (the tiny presets; longer sequences and wider
      heads run faster, so larger models get a pessimistic figure);
    * ``op_seconds``: one forward + backward of the trainer's GPT block at a negligible size,
      divided by its operator count.

    All run with ``threads`` threads (default 1) and are divided by it: the profile is per
    core, ``shared_cores`` is this machine's core count, and the cost model gives a rank of a
    W-rank world ``max(1, cores // W)`` threads and lets at most ``cores / threads`` ranks
    compute at once (see the module docstring). ``link`` is what :func:`measure_gloo_link`
    measured among the ranks; without it, the :data:`PROFILES` ``cpu`` preset's
    gloo-over-loopback figures are assumed.
    """
    import torch
    import torch.nn.functional as F

    cores = _cpu_cores()
    threads = threads or 1
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        flops = _best_rate(lambda: a @ b, 2 * n ** 3, repeats=10, budget_s=0.2) / threads

        p = torch.zeros(1 << 20, requires_grad=True)
        p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW([p], lr=1e-3, foreach=False)
        streaming = _best_rate(opt.step, ADAMW_BYTES_PER_ELEMENT * p.numel(), repeats=5,
                               budget_s=0.2) / threads

        x = torch.randn(2048, 256)
        w, bias = torch.ones(256), torch.zeros(256)
        y = torch.empty_like(x)

        def mix():
            u = F.layer_norm(x, (256,), w, bias)       # read n, write n
            v = torch.add(x, u)                        # read 2n, write n
            g = F.gelu(v, approximate="tanh")          # read n, write n
            y.copy_(g)                                 # read n, write n
        elementwise = _best_rate(mix, 9 * 4 * x.numel(), repeats=10, budget_s=0.2) / threads

        # the attention of the tiny presets the local runner trains: 128 tokens, head dim 32
        q, k, v = (torch.randn(1, 8, 128, 32, requires_grad=True) for _ in range(3))

        def attention():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        attn = _best_rate(attention, 3 * 2 * 128 * 128 * 8 * 32, repeats=10,
                          budget_s=0.2) / threads
        op_seconds = _probe_op_seconds()
    finally:
        torch.set_num_threads(previous)
    link = link or GlooLink(PROFILES["cpu"].latency_seconds,
                            PROFILES["cpu"].intra_node_bytes_per_second)
    latency, bandwidth = link.latency_seconds, link.bytes_per_second
    return DeviceProfile(name="cpu (measured)", flops_per_second=flops,
                         memory_bytes=_machine_memory(), intra_node_bytes_per_second=bandwidth,
                         inter_node_bytes_per_second=bandwidth, devices_per_node=1 << 16,
                         latency_seconds=latency,
                         group_latency_seconds=link.group_latency_seconds,
                         memory_bytes_per_second=streaming,
                         elementwise_bytes_per_second=elementwise,
                         attention_flops_per_second=attn, op_seconds=op_seconds,
                         reserved_bytes=PROFILES["cpu"].reserved_bytes, shared_cores=cores)


def _probe_op_seconds() -> float:
    """Host seconds per operator: one forward + backward of the trainer's own GPT block at a
    size where the arithmetic is negligible (8 tokens, width 32), divided by its
    :data:`BLOCK_OPS` count."""
    import torch

    from dynatrain.trainer.model import StageModel
    from dynatrain.trainer.weights import initial_tensor

    class _NoGroups:                     # a single rank: no TP or EP collectives
        tp = ep = None

    spec = ModelSpec(name="probe", arch="gpt", vocab_size=64, hidden_size=32, num_layers=1,
                     num_heads=4, ffn_hidden_size=128, max_seq_len=8, dtype="float32")
    weights = {t.name: initial_tensor(spec, t, 0).clone().requires_grad_(True)
               for t in spec.tensors}
    block = StageModel(spec, range(1), first=False, last=False, groups=_NoGroups, ep=1,
                       vocab_start=0)
    x = torch.randn(1, 8, 32, requires_grad=True)

    def run():
        block.blocks(x, weights).sum().backward()
    return 1 / _best_rate(run, BLOCK_OPS["gpt"], repeats=20, budget_s=0.2)


def _link_worker(rank: int, world: int, port: int, message: int, large: int, repeats: int,
                 results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, _cpu_cores() // world))     # as run_local does
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        # Groups of every size that divides the world, consecutive ranks, all of them busy at
        # once (every rank must create every group, in the same order).
        sizes = [n for n in range(2, world + 1) if world % n == 0]
        mine = {}
        for n in sizes:
            for start in range(0, world, n):
                group = dist.new_group(list(range(start, start + n)))
                if start <= rank < start + n:
                    mine[n] = group
        # ~1 ms of single-core matmul between collectives, like a small model's TP segment,
        # and a message of a small model's activation
        a = torch.randn(400, 400)
        one, big = torch.zeros(message // 4), torch.zeros(large // 4)
        for n in sizes:
            dist.all_reduce(one, group=mine[n])
        for _ in range(3):
            dist.all_reduce(big)

        def loop(tensor, group, compute: bool = True, iterations: int = repeats) -> float:
            """Seconds per iteration, the best of three loops (others' load only adds)."""
            best = math.inf
            for _ in range(3):
                dist.barrier()
                t = time.perf_counter()
                for _ in range(iterations):
                    if compute:
                        a @ a
                    if tensor is not None:
                        dist.all_reduce(tensor, group=group)
                best = min(best, (time.perf_counter() - t) / iterations)
            return best

        compute = loop(None, None)
        timings = {"compute": compute,
                   "groups": {n: loop(one, mine[n]) - compute for n in sizes},
                   "small": loop(one, None, compute=False),
                   "large": loop(big, None, compute=False, iterations=max(3, repeats // 5))}
        if rank == 0:
            results.put(timings)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_gloo_link(world: int, *, message_bytes: int = 128 << 10,
                      large_bytes: int = 4 << 20, repeats: int = 30,
                      timeout_s: float = 300.0) -> GlooLink:
    """Latency and bandwidth of gloo collectives among ``world`` processes on this machine,
    each with the threads run_local would give it. Starts processes: takes a few seconds.

    Latency, for every group size n dividing the world, is what an all-reduce of
    ``message_bytes`` (a small model's activation, 128 KiB) in groups of n adds to a loop of
    ~1 ms matmuls that every rank runs, less its bandwidth term; not its time in an otherwise
    idle loop. In training, collectives sit between compute, and when ranks outnumber cores
    (4 ranks on 2 cores) each of a ring's 2 (n - 1) steps may wait for the scheduler to run
    the peer, which costs milliseconds: ten times the idle figure, and more for larger
    groups. Bandwidth comes from a ``large_bytes`` all-reduce over the world via the ring
    formula."""
    if world < 2:
        return GlooLink(PROFILES["cpu"].latency_seconds,
                        PROFILES["cpu"].intra_node_bytes_per_second)
    import queue
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = mp.start_processes(_link_worker, args=(world, port, message_bytes, large_bytes,
                                                   repeats, results),
                               nprocs=world, join=False, start_method="spawn")
    try:
        t = results.get(timeout=timeout_s)
    except queue.Empty:
        for p in procs.processes:
            p.terminate()
        raise RuntimeError(f"gloo link probe with {world} processes did not finish in "
                           f"{timeout_s:.0f} s") from None
    procs.join(timeout=60)
    bandwidth = 2 * (world - 1) / world * (large_bytes - message_bytes) \
        / max(t["large"] - t["small"], 1e-9)
    groups = tuple((n, max(seconds - 2 * (n - 1) / n * message_bytes / bandwidth, 1e-6))
                   for n, seconds in sorted(t["groups"].items()))
    return GlooLink(dict(groups)[world], bandwidth, groups)

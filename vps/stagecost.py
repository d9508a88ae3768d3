"""What one rank of each pipeline stage holds and does, per token: the cost model's counts.

For a model and a layout, :func:`stage_costs` derives every stage's per-rank quantities that
depend on neither the batch nor the device: exact state bytes from the vps mapping, working
parameter elements, matmul / attention / elementwise work per token, elements saved for
backward, TP all-reduces and operator counts. :func:`~dynatrain.controller.costmodel.estimate`
turns them into seconds and bytes; the formulas are documented in
:mod:`dynatrain.controller.costmodel`. Pure arithmetic over the model spec and the mapping,
cached per (model, layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from dynatrain.vps.boxes import box_numel
from dynatrain.vps.layout import Layout, bind
from dynatrain.vps.mapping import (flat_shard_range, is_flat_sharded, model_states, rank_shards,
                                  state_itemsize, tp_box)
from dynatrain.vps.model import FIRST, LAST, ModelSpec

BLOCK_OPS = {"gpt": 118, "llama": 180, "moe": 217, "moe_per_expert": 37,
             "gpt_embed": 12, "llama_embed": 6, "gpt_head": 22, "llama_head": 36}
"""Top-level ATen operators of one forward + backward of the trainer's pieces, counted with
torch.profiler (torch 2.x): a GPT block, a Llama block, an MoE block (217 plus 37 per local
expert: the experts run one by one), the embedding and the head with the loss. Used with
``DeviceProfile.op_seconds`` for the per-operator host overhead."""


@dataclass(frozen=True)
class StageCost:
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
    for a 64-way layout costs a second per solve. tests/controller/test_solver.py checks that both give
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
    reference the cost model's fast path is tested against)."""
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
def stage_costs(model: ModelSpec, layout: Layout) -> tuple[StageCost, ...]:
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
        stage = StageCost(index=s, state_bytes=state, dense_elements=dense,
                       expert_elements=expert, master_elements=masters, embed_elements=embed,
                       kv_elements=kv, matmul_flops=matmul, attn_flops=layers * attn_flops,
                       elementwise=ew, activations=saved, tp_reduces=reduces,
                       tp_small_reduces=small,
                       moe_layers=layers if model.is_moe else 0, ops=ops)
        by_shape[shape] = stage
        out.append(stage)
    return tuple(out)


def training_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """FLOPs of one token's forward and backward pass through the whole model (backward = 2x
    forward): the weight matmuls (2 per weight; a routed expert's share by top-k) and causal
    attention at ``seq_len``, as :func:`stage_costs` counts them for one unsharded stage. The
    numerator of model-FLOPs utilisation (MFU): recomputation and communication are not
    counted, as in PaLM's definition."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    [stage] = stage_costs(model, Layout())
    return 3.0 * (stage.matmul_flops + stage.attn_flops * seq_len)

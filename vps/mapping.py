"""The mapping: which pieces of which tensor and state every rank of a layout holds.

Megatron-style rules (DESIGN.md): TP splits a tensor along its ``tp_dim`` in whole units
(attention heads, FFN rows/columns, vocabulary rows), replicating GQA kv heads when tp exceeds
them; norms, biases of row-parallel layers, routers and position embeddings are replicated over
TP. PP places each block's tensors on the stage holding its layer, the embedding on the first
stage and the final norm and head on the last (a tied embedding on both). EP splits stacked
experts over the ep ranks carved out of DP. ZeRO-1 shards the fp32 master and the AdamW moments
over the (expert-)DP group as contiguous flat ranges of each rank's TP/EP-local tensor; ZeRO-3
shards the working parameter the same way.

The mapping is computed once per tensor *signature* (shape, dtype, sharding metadata) and
state as a **shard pattern**: the distinct shards of one pipeline stage, each with the (dp, tp)
coordinates that hold it. All layers of a stage share a pattern, and a stage's ranks are just a
relabelling of (dp, tp); this is what lets the planner handle a 1024-device layout quickly.

Pure metadata: no torch import.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from .boxes import Box, box_extents, box_numel, even_split, flat_range_boxes, full_box, shift
from .layout import BoundLayout
from .model import DTYPE_BYTES, ModelSpec, ShardRule, TensorSpec

STATES = ("param", "master", "exp_avg", "exp_avg_sq")
"""State kinds a switch moves. Gradients are empty at a step boundary and are not moved."""


class Piece(NamedTuple):
    """Part of a tensor's state inside one rank's local tensor.

    ``box`` is in the tensor's global index space. ``local`` is where the same elements sit in
    the rank's local tensor: an N-d box of the same extents for a TP/EP shard, or a 1-d range
    of the flat local buffer for a ZeRO shard (the elements are contiguous there, in row-major
    order of ``box``). Either way ``local_tensor[local].reshape(extents(box))`` is the data.
    """

    box: Box
    local: Box


class Shard(NamedTuple):
    """One distinct shard of a tensor's state within a pipeline stage, and who holds it."""

    pieces: tuple[Piece, ...]
    holders: tuple[tuple[int, int], ...]
    """(dp index, tp index) of every rank in the stage that holds this shard."""
    local_shape: tuple[int, ...]
    """Shape of a holder's local tensor for this state (1-d for a ZeRO shard)."""
    slots: tuple[int, ...]
    """The holders as ``dp_index * tp + tp_index``: their places in a stage's device list."""


def model_states(model: ModelSpec) -> tuple[str, ...]:
    """States kept per tensor. An fp32 model's working parameter is its own master copy."""
    if model.dtype == "float32":
        return tuple(s for s in STATES if s != "master")
    return STATES


def state_itemsize(tensor: TensorSpec, state: str) -> int:
    return DTYPE_BYTES[tensor.dtype] if state == "param" else 4


def state_bytes(model: ModelSpec) -> int:
    """Bytes of one full replica of everything a switch moves."""
    per_param = sum(DTYPE_BYTES[model.dtype] if s == "param" else 4 for s in model_states(model))
    return model.num_params * per_param


def tp_box(tensor: ShardRule, tp: int, tp_index: int, ep: int, ep_rank: int) -> Box:
    """The TP/EP-local part of a tensor (given by its rule) on a rank, as a global box."""
    box = list(full_box(tensor.shape))
    if tensor.expert_dim is not None and ep > 1:
        box[tensor.expert_dim] = even_split(tensor.shape[tensor.expert_dim], ep, ep_rank)
    if tensor.tp_dim is not None and tp > 1:
        dim, units = tensor.tp_dim, tensor.tp_units
        unit = tensor.shape[dim] // units
        if units % tp == 0 or (not tensor.tp_replicable and units >= tp):
            # Equal shares; or near-equal ones where tp does not divide the units, which
            # layout validation allows only for the vocabulary's rows (32,001 tokens, say).
            lo, hi = even_split(units, tp, tp_index)
        elif tensor.tp_replicable and tp % units == 0:
            lo = tp_index // (tp // units)  # each unit (kv head) replicated on tp/units ranks
            hi = lo + 1
        else:  # layout validation rejects this before we get here
            raise ValueError(f"tp={tp} does not split {units} units of {tensor}")
        box[dim] = (lo * unit, hi * unit)
    return tuple(box)


def zero_group(rule: ShardRule, dp: int, ep: int, dp_index: int) -> tuple[int, int]:
    """(group size, index in it) of the ZeRO group that shards this tensor's flat states:
    the DP group for dense tensors, the expert-DP group (dp // ep replicas) for experts."""
    if rule.expert_dim is not None:
        return dp // ep, dp_index // ep
    return dp, dp_index


def flat_shard_range(rule: ShardRule, local_numel: int, dp: int, ep: int, dp_index: int
                     ) -> tuple[int, int]:
    """The contiguous range of the flattened TP/EP-local tensor that ZeRO gives this rank."""
    size, index = zero_group(rule, dp, ep, dp_index)
    return even_split(local_numel, size, index)


def is_flat_sharded(state: str, zero: int) -> bool:
    """Whether ZeRO shards this state as flat ranges over the (expert-)DP group."""
    return zero >= 3 or (zero >= 1 and state != "param")


@lru_cache(maxsize=8192)
def _pattern(t: ShardRule, state: str, dp: int, tp: int, ep: int, zero: int
             ) -> tuple[Shard, ...]:
    expert = t.expert_dim is not None
    flat = is_flat_sharded(state, zero)
    by_pieces: dict[tuple[Piece, ...], list] = {}
    local_shapes: dict[tuple[Piece, ...], tuple[int, ...]] = {}
    for j in range(dp):
        ep_rank = j % ep if expert else 0
        for ti in range(tp):
            box = tp_box(t, tp, ti, ep if expert else 1, ep_rank)
            if flat:
                extents = box_extents(box)
                start, stop = flat_shard_range(t, box_numel(box), dp, ep, j)
                pieces, off = [], 0
                origin = tuple(lo for lo, _ in box)
                for rel in flat_range_boxes(extents, start, stop):
                    n = box_numel(rel)
                    pieces.append(Piece(shift(rel, origin), ((off, off + n),)))
                    off += n
                key = tuple(pieces)
                local_shape = (stop - start,)
            else:
                key = (Piece(box, full_box(box_extents(box))),)
                local_shape = box_extents(box)
            by_pieces.setdefault(key, []).append((j, ti))
            local_shapes[key] = local_shape
    return tuple(Shard(k, tuple(v), local_shapes[k], tuple(j * tp + ti for j, ti in v))
                 for k, v in by_pieces.items())


def shard_pattern(tensor: TensorSpec, state: str, layout) -> tuple[Shard, ...]:
    """Distinct shards of ``tensor``'s ``state`` within one stage of ``layout``."""
    return _pattern(tensor.rule, state, layout.dp, layout.tp, layout.ep, layout.zero)


class RankShard(NamedTuple):
    """What one rank holds of one tensor's state."""

    tensor: TensorSpec
    state: str
    pieces: tuple[Piece, ...]
    local_shape: tuple[int, ...]


def rank_shards(bound: BoundLayout, rank: int) -> list[RankShard]:
    """Everything ``rank`` holds under ``bound``: one entry per tensor and state, model order."""
    return list(_rank_shards(bound.layout, bound.model, rank))


@lru_cache(maxsize=64)
def _rank_shards(layout, model, rank: int) -> tuple[RankShard, ...]:
    # Cached: a switch asks for the new layout's shards in the background (preallocation) and
    # again in the pause (the engine, the new trainer); the second time must cost nothing.
    bound = BoundLayout(layout, model)
    stage, j, ti = bound.coords(rank)
    out = []
    for t in model.tensors:
        if stage not in bound.stages_of(t.layer, t.tied_to_last):
            continue
        for state in model_states(model):
            for shard in shard_pattern(t, state, layout):
                if (j, ti) in shard.holders:
                    out.append(RankShard(t, state, shard.pieces, shard.local_shape))
                    break
    return tuple(out)


def counts_once(bound: BoundLayout, tensor: TensorSpec, state: str, rank: int) -> bool:
    """Whether ``rank`` stands for its shard of ``tensor``'s ``state`` in a sum over every
    element of the logical model taken exactly once (the global gradient norm).

    Every replica of a shard holds the same values: DP and expert-DP copies without ZeRO, the
    TP ranks of a tensor TP does not split or of one replicated GQA kv head, the tied
    embedding's copy on the last stage. The distinct shards of a stage are disjoint and cover
    the tensor, so letting only the first holder (lowest dp, then tp index) of each distinct
    shard, on the first stage that holds the tensor, count it sees every element once, in
    every layout, and needs no communication to decide. A rank that does not hold the tensor
    at all does not count it either.
    """
    layout = bound.layout
    stage, j, ti = layout.coords(rank)
    if stage != bound.stages_of(tensor.layer, tensor.tied_to_last)[0]:
        return False
    for shard in shard_pattern(tensor, state, layout):
        if (j, ti) in shard.holders:
            return shard.holders[0] == (j, ti)
    return False


def shards(bound: BoundLayout) -> dict[int, list[RankShard]]:
    """The full mapping rank → shards (fine for tests and small layouts)."""
    return {r: rank_shards(bound, r) for r in range(bound.world)}

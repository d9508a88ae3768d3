"""Megatron's tensor-parallel operators, as small autograd functions.

``copy_to_tp`` (Megatron's *f*): identity forward, all-reduce backward; it sits where a
replicated activation enters column-parallel weights, whose input gradients are partial sums.
``reduce_from_tp`` (Megatron's *g*): all-reduce forward, identity backward; it sums the partial
outputs of row-parallel weights into the replicated activation. We write these two rather than
use ``torch.distributed.nn.functional.all_reduce`` because that one's backward all-reduces the
gradient again, which is right when every rank's output feeds a different loss but multiplies
the gradient by the group size here, where every TP rank computes the same loss.

Vocabulary-parallel embedding and cross-entropy build on them, so no rank ever materialises
logits for the whole vocabulary.

Masked targets (:data:`IGNORE_INDEX`, e.g. an SFT conversation's user turns) add nothing to the
loss. The loss of a micro-batch is the mean over its unmasked targets (0 when it has none);
the step's loss and gradient are the mean of its micro-batches' losses, over every micro-batch
of every DP rank. The micro-batches of a step are the same under any layout (the global batch
and ``micro_batch_size`` are fixed, and each DP rank cuts its contiguous share into them), so
this equals single-process training with the same micro-batch size, and a live switch changes
nothing. It is *not* the mean over all unmasked tokens of the global batch: micro-batches with
few assistant tokens weigh as much as those with many (``transformers``' per-batch
``F.cross_entropy(ignore_index=-100)`` convention, applied per micro-batch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dynatrain.vps.abandon import wait

IGNORE_INDEX = -100
"""A target the loss skips (PyTorch's and Hugging Face's convention)."""


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        wait(dist.all_reduce(grad, group=ctx.group, async_op=True))
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        wait(dist.all_reduce(x, group=group, async_op=True))
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def vocab_parallel_embedding(tokens: torch.Tensor, weight: torch.Tensor, vocab_start: int,
                             group) -> torch.Tensor:
    """Embedding lookup when this rank holds rows [vocab_start, vocab_start + len(weight))."""
    if group is None:
        return F.embedding(tokens, weight)
    local = tokens - vocab_start
    inside = (local >= 0) & (local < weight.shape[0])
    out = F.embedding(local.clamp(0, weight.shape[0] - 1), weight) * inside.unsqueeze(-1)
    return reduce_from_tp(out, group)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 group, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy when this rank holds the logits of one vocabulary slice: the mean over
    the targets that are not :data:`IGNORE_INDEX` (0 if every one is), or with
    ``reduction="none"`` each row's, 0 for an ignored one (evaluation sums them over the rows
    it counts).

    logits: (N, V_local) for vocabulary rows [vocab_start, vocab_start + V_local).
    """
    keep = targets != IGNORE_INDEX
    if group is None:
        if reduction == "mean" and not keep.any():
            return logits.sum() * 0.0                      # no NaN, and a (zero) gradient
        return F.cross_entropy(logits, targets, reduction=reduction, ignore_index=IGNORE_INDEX)
    with torch.no_grad():
        top = logits.max(dim=-1).values
        wait(dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group, async_op=True))
    shifted = logits - top.unsqueeze(-1)
    sum_exp = reduce_from_tp(shifted.exp().sum(dim=-1), group)
    local = targets - vocab_start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_tp(picked * inside, group)
    losses = (sum_exp.log() - target_logit) * keep
    if reduction != "mean":
        return losses
    return losses.sum() / keep.sum().clamp(min=1)

"""Mixture-of-experts layer: dropless top-k routing and expert-parallel token dispatch.

Routing is dropless (no capacity factor), so which tokens an expert sees never depends on how
the batch is split across ranks: the layer computes the same function under every layout. With
ep > 1 each rank owns ``E / ep`` consecutive experts; tokens travel to their experts' owners and
back through ``dist.all_to_all_single`` grouped by destination, wrapped in a two-line autograd
function (the backward is the same exchange with the splits swapped). torch's differentiable
versions (``torch.distributed.nn`` is deprecated; the functional collectives) need groups
registered with the default world, and the elastic device manager's per-generation groups are
not.

Under TP every rank holds a slice of every local expert's FFN width, so expert outputs are
partial sums. They are summed across TP *before* being weighted by the routing probabilities:
that way every TP rank sees the full expert output and computes the same router gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dynatrain.vps.abandon import wait

from .tp import copy_to_tp, reduce_from_tp


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        wait(dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group,
                                    async_op=True))
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        wait(dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits,
                                    group=ctx.group, async_op=True))
        return back, None, None, None


def _expert_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def moe_forward(h: torch.Tensor, router: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                down: torch.Tensor, *, top_k: int, num_experts: int, tp_group, ep_group,
                ep: int, normalize: bool = True, tally: torch.Tensor | None = None
                ) -> torch.Tensor:
    """h: (B, T, H) replicated over TP; gate/up: (E_local, F_local, H); down: (E_local, H, F_local).
    ``tally`` (E,) int64, if given, gains the tokens routed to each expert (the measured load
    the controller reads: which experts, so which EP ranks, are hot)."""
    B, T, H = h.shape
    x = h.reshape(-1, H)                                             # (N, H)
    N, k = x.shape[0], top_k
    probs = F.softmax(F.linear(x, router).float(), dim=-1)           # (N, E)
    weights, experts = probs.topk(k, dim=-1)                         # (N, k)
    if normalize:                                                    # Mixtral; Qwen3-MoE by config
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(h.dtype)

    pair_expert = experts.reshape(-1)                                # (N*k,), token-major
    if tally is not None:
        tally += torch.bincount(pair_expert, minlength=num_experts)
    order = torch.argsort(pair_expert, stable=True)
    sorted_expert = pair_expert[order]
    tokens = copy_to_tp(x, tp_group)[order // k]                     # (P, H) sorted by expert
    e_local = num_experts // ep

    if ep > 1:
        counts = torch.bincount(sorted_expert, minlength=num_experts)            # (E,)
        recv_counts = torch.empty_like(counts)
        wait(dist.all_to_all_single(recv_counts, counts, group=ep_group, async_op=True))
        send_splits = counts.view(ep, e_local).sum(dim=1).tolist()
        recv_splits = recv_counts.view(ep, e_local).sum(dim=1).tolist()
        received = _AllToAll.apply(tokens, recv_splits, send_splits, ep_group)
        local_expert = torch.repeat_interleave(
            torch.arange(e_local, device=h.device).repeat(ep), recv_counts)
    else:
        received, local_expert = tokens, sorted_expert

    by_expert = torch.argsort(local_expert, stable=True)
    sizes = torch.bincount(local_expert, minlength=e_local).tolist()
    segments = received[by_expert].split(sizes)
    outputs = torch.cat([_expert_ffn(seg, gate[e], up[e], down[e])
                         for e, seg in enumerate(segments)])
    outputs = outputs[torch.argsort(by_expert)]                      # back to arrival order

    if ep > 1:
        outputs = _AllToAll.apply(outputs, send_splits, recv_splits, ep_group)
    outputs = reduce_from_tp(outputs[torch.argsort(order)], tp_group)  # (N*k, H), pair order
    return (outputs.view(N, k, H) * weights.unsqueeze(-1)).sum(dim=1).view(B, T, H)

"""One pipeline stage of a GPT- or Llama-family transformer, over TP-local weights.

``StageModel`` computes what its stage owns: the embedding on the first stage, its blocks,
and the final norm, head and loss on the last. Weights are the rank's TP/EP-local tensors,
keyed by logical tensor name; column-parallel weights are split by output rows, row-parallel
ones by input columns (see :mod:`dynatrain.vps.mapping`), and the collectives of :mod:`.tp`
join the pieces. With tp = ep = pp = 1 this is ordinary single-device training.

RoPE tables follow the spec's :class:`~dynatrain.vps.model.RopeScaling` (linear, dynamic NTK,
YaRN, Llama 3), with the semantics of transformers' ``rope_type``s; grouped-query attention is
SDPA's own (``enable_gqa``), without copies of the key/value heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dynatrain.vps.model import ModelSpec

from .moe import moe_forward
from .tp import copy_to_tp, reduce_from_tp, vocab_parallel_cross_entropy, vocab_parallel_embedding


def rope_frequencies(m: ModelSpec, seq_len: int, device) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies (head_dim/2,) in float32 for a sequence of ``seq_len`` tokens,
    and the factor on cos and sin, as ``m.rope_scaling`` says (the semantics of transformers'
    ``rope_type``s, see :class:`~dynatrain.vps.model.RopeScaling`)."""
    d, theta, s = m.head_dim, m.rope_theta, m.rope_scaling
    if s is not None and s.type == "dynamic" and seq_len > m.max_seq_len:
        # NTK: a larger base for a longer sequence, recomputed per forward length.
        theta = theta * (s.factor * seq_len / m.max_seq_len - (s.factor - 1)) ** (d / (d - 2))
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=device).float() / d))
    if s is None or s.type == "dynamic":
        return inv_freq, 1.0
    if s.type == "linear":                      # positions / factor, folded into the frequencies
        return inv_freq / s.factor, 1.0
    if s.type == "llama3":
        wavelen = 2 * math.pi / inv_freq
        # Long waves (> original / low_freq_factor) slowed by the factor, short ones
        # (< original / high_freq_factor) kept, and a linear blend in ratio between.
        blend = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        mixed = (1 - blend) * inv_freq / s.factor + blend * inv_freq
        long = wavelen > s.original_max_seq_len / s.low_freq_factor
        short = wavelen < s.original_max_seq_len / s.high_freq_factor
        return torch.where(long, inv_freq / s.factor, torch.where(short, inv_freq, mixed)), 1.0
    # yarn: pair i is interpolated by a ramp from 0 (the dims making more than beta_fast
    # rotations over the original context: kept) to 1 (fewer than beta_slow: divided by factor).
    def dim_at(rotations: float) -> float:     # the (fractional) dim making that many rotations
        return d * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (
            2 * math.log(m.rope_theta))
    lo, hi = dim_at(s.beta_fast), dim_at(s.beta_slow)
    if s.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001                             # a step, not a division by zero
    ramp = ((torch.arange(d // 2, device=device).float() - lo) / (hi - lo)).clamp(0, 1)
    return inv_freq / s.factor * ramp + inv_freq * (1 - ramp), s.attention_factor


def rope_tables(m: ModelSpec, seq_len: int, device,
                dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, head_dim) of positions 0..T-1, computed in float32 then cast."""
    inv_freq, scale = rope_frequencies(m, seq_len, device)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)                     # (T, hd)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, heads, hd); rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


class StageModel:
    def __init__(self, model: ModelSpec, layers: range, *, first: bool, last: bool, groups,
                 ep: int, vocab_start: int, recompute: bool = False):
        self.m, self.layers, self.first, self.last = model, layers, first, last
        self.g, self.ep, self.vocab_start = groups, ep, vocab_start
        self.recompute = recompute
        """Activation checkpointing: recompute each block in the backward pass instead of
        keeping its activations."""
        self.tally: torch.Tensor | None = None
        """(num_experts,) int64 the MoE layers add their routed tokens to while the trainer
        counts (a training step), or None."""
        self._forward = False
        """Inside :meth:`blocks`: a block's recomputation in the backward pass is not, so
        activation checkpointing does not count a step's tokens twice."""
        self._rope = None

    # -- pieces ------------------------------------------------------------------------------
    def _norm(self, x, w: dict, name: str):
        if self.m.arch == "gpt":
            return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"],
                                self.m.norm_eps)
        return F.rms_norm(x, x.shape[-1:], w[f"{name}.weight"], self.m.norm_eps)

    def _attention(self, h, w: dict, p: str):
        B, T, _ = h.shape
        m, tp = self.m, self.g.tp
        x = copy_to_tp(h, tp)
        q = F.linear(x, w[f"{p}.q.weight"], w.get(f"{p}.q.bias")).view(B, T, -1, m.head_dim)
        k = F.linear(x, w[f"{p}.k.weight"], w.get(f"{p}.k.bias")).view(B, T, -1, m.head_dim)
        v = F.linear(x, w[f"{p}.v.weight"], w.get(f"{p}.v.bias")).view(B, T, -1, m.head_dim)
        if m.qk_norm:
            q = F.rms_norm(q, q.shape[-1:], w[f"{p}.q_norm.weight"], m.norm_eps)
            k = F.rms_norm(k, k.shape[-1:], w[f"{p}.k_norm.weight"], m.norm_eps)
        if m.arch == "llama":
            if (self._rope is None or self._rope[0].shape[0] != T
                    or self._rope[0].dtype != h.dtype or self._rope[0].device != h.device):
                self._rope = rope_tables(m, T, h.device, h.dtype)
            q, k = apply_rope(q, *self._rope), apply_rope(k, *self._rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))              # (B, heads, T, hd)
        # GQA without copying k and v per query head: query head i reads kv head
        # i // (q heads / kv heads), as repeat_interleave would give it.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=k.shape[1] != q.shape[1])
        y = y.transpose(1, 2).reshape(B, T, -1)
        out = reduce_from_tp(F.linear(y, w[f"{p}.o.weight"]), tp)
        return out + w[f"{p}.o.bias"] if f"{p}.o.bias" in w else out

    def _mlp(self, h, w: dict, p: str):
        tp = self.g.tp
        if self.m.is_moe:
            return moe_forward(h, w[f"{p}.moe.router.weight"], w[f"{p}.moe.experts.gate"],
                               w[f"{p}.moe.experts.up"], w[f"{p}.moe.experts.down"],
                               top_k=self.m.experts_top_k, num_experts=self.m.num_experts,
                               normalize=self.m.moe_norm_topk,
                               tp_group=tp, ep_group=self.g.ep, ep=self.ep,
                               tally=self.tally if self._forward else None)
        x = copy_to_tp(h, tp)
        if self.m.arch == "gpt":
            a = F.gelu(F.linear(x, w[f"{p}.mlp.fc1.weight"], w[f"{p}.mlp.fc1.bias"]),
                       approximate="tanh")
            return reduce_from_tp(F.linear(a, w[f"{p}.mlp.fc2.weight"]), tp) + w[f"{p}.mlp.fc2.bias"]
        a = F.silu(F.linear(x, w[f"{p}.mlp.gate.weight"])) * F.linear(x, w[f"{p}.mlp.up.weight"])
        return reduce_from_tp(F.linear(a, w[f"{p}.mlp.down.weight"]), tp)

    # -- the stage -----------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, w: dict) -> torch.Tensor:
        x = vocab_parallel_embedding(tokens, w["embed.tokens"], self.vocab_start, self.g.tp)
        if "embed.positions" in w:
            x = x + w["embed.positions"][: tokens.shape[1]]
        return x

    def block(self, x: torch.Tensor, w: dict, i: int) -> torch.Tensor:
        p = f"layers.{i}"
        x = x + self._attention(self._norm(x, w, f"{p}.attn_norm"), w, f"{p}.attn")
        return x + self._mlp(self._norm(x, w, f"{p}.mlp_norm"), w, p)

    def blocks(self, x: torch.Tensor, w: dict) -> torch.Tensor:
        self._forward = True
        try:
            return self._blocks(x, w)
        finally:
            self._forward = False

    def _blocks(self, x: torch.Tensor, w: dict) -> torch.Tensor:
        for i in self.layers:
            if self.recompute and torch.is_grad_enabled():
                # The reentrant variant keeps the block input through save_for_backward, so
                # saved-tensor hooks (the trainer's activation meter) see it, and the
                # recomputation's own saved tensors while they live. The model draws no
                # random numbers, so there is no RNG state to replay.
                x = torch.utils.checkpoint.checkpoint(self.block, x, w, i, use_reentrant=True,
                                                      preserve_rng_state=False)
            else:
                x = self.block(x, w, i)
        return x

    def loss(self, x: torch.Tensor, targets: torch.Tensor, w: dict,
             reduction: str = "mean") -> torch.Tensor:
        """Next-token cross-entropy: the mean, or (``reduction="none"``) one per token,
        flattened (B*T,)."""
        x = self._norm(x, w, "final_norm")
        head = w["embed.tokens"] if self.m.tie_embeddings else w["head.weight"]
        # (B, T, V_local); the softmax in fp32 whatever the compute dtype, as transformers
        # and Megatron do: bf16 logits would move the loss itself by ~1e-3.
        logits = F.linear(copy_to_tp(x, self.g.tp), head).float()
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                            self.vocab_start, self.g.tp, reduction)

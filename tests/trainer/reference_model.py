"""An independent single-process reference: plain torch.nn modules over full tensors.

Written separately from dynatrain.trainer (no shared forward code): nn.Linear, nn.Embedding,
nn.LayerNorm/nn.RMSNorm, a loop over experts, F.cross_entropy. It shares only the initial
values (dynatrain.trainer.weights) and the data stream, which are inputs, not the computation
under test. The distributed trainer under every layout must follow this model's losses.

The training loop is torch's own too: gradient clipping is ``torch.nn.utils.clip_grad_norm_``
over the full parameters (its two halves, ``get_total_norm`` and ``clip_grads_with_norm_``, with
the norm taken over float64 copies: torch's float32 norm on CPU is measurably low, ~2e-6
relative on a 256x1024 gradient, which is the reference's rounding, not the trainer's), and the
learning-rate schedule is built from
``torch.optim.lr_scheduler`` (LinearLR warmup, then CosineAnnealingLR or LinearLR decay, joined
by SequentialLR), not from dynatrain.trainer.schedule, so neither is checked against itself.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from typing import NamedTuple

from dynatrain.trainer.data import micro_batches, token_source
from dynatrain.trainer.weights import initial_tensor


class Block(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
        H, hd = m.hidden_size, m.head_dim
        bias = m.arch == "gpt"
        eps = m.norm_eps
        Norm = (lambda n: nn.LayerNorm(n, eps=eps)) if m.arch == "gpt" else \
            (lambda n: nn.RMSNorm(n, eps=eps))
        self.attn_norm, self.mlp_norm = Norm(H), Norm(H)
        self.q = nn.Linear(H, m.num_heads * hd, bias=bias)
        self.k = nn.Linear(H, m.num_kv_heads * hd, bias=bias)
        self.v = nn.Linear(H, m.num_kv_heads * hd, bias=bias)
        self.o = nn.Linear(m.num_heads * hd, H, bias=bias)
        if m.qk_norm:
            self.q_norm, self.k_norm = nn.RMSNorm(hd, eps=eps), nn.RMSNorm(hd, eps=eps)
        if m.is_moe:
            E, Fe = m.num_experts, m.moe_ffn_hidden_size
            self.router = nn.Linear(H, E, bias=False)
            self.gate = nn.Parameter(torch.empty(E, Fe, H))
            self.up = nn.Parameter(torch.empty(E, Fe, H))
            self.down = nn.Parameter(torch.empty(E, H, Fe))
        elif m.arch == "gpt":
            self.fc1 = nn.Linear(H, m.ffn_hidden_size)
            self.fc2 = nn.Linear(m.ffn_hidden_size, H)
        else:
            self.w_gate = nn.Linear(H, m.ffn_hidden_size, bias=False)
            self.w_up = nn.Linear(H, m.ffn_hidden_size, bias=False)
            self.w_down = nn.Linear(m.ffn_hidden_size, H, bias=False)

    def rope(self, x):  # x: (B, T, heads, hd)
        T, hd = x.shape[1], x.shape[-1]
        freqs = 1.0 / (self.m.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.arange(T).float()[:, None] * freqs[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def attention(self, h):
        B, T, _ = h.shape
        m = self.m
        q = self.q(h).view(B, T, m.num_heads, m.head_dim)
        k = self.k(h).view(B, T, m.num_kv_heads, m.head_dim)
        v = self.v(h).view(B, T, m.num_kv_heads, m.head_dim)
        if m.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if m.arch == "llama":
            q, k = self.rope(q), self.rope(k)
        rep = m.num_heads // m.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))

    def mlp(self, h):
        m = self.m
        if m.is_moe:
            x = h.reshape(-1, h.shape[-1])
            probs = self.router(x).float().softmax(-1)
            w, idx = probs.topk(m.experts_top_k, -1)
            w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
            out = torch.zeros(x.shape[0], m.experts_top_k, x.shape[1])
            for e in range(m.num_experts):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                if len(tok):
                    xe = x[tok]
                    ye = F.linear(F.silu(F.linear(xe, self.gate[e])) * F.linear(xe, self.up[e]),
                                  self.down[e])
                    out = out.index_put((tok, slot), ye)
            return (out * w.unsqueeze(-1)).sum(1).view_as(h)
        if m.arch == "gpt":
            return self.fc2(F.gelu(self.fc1(h), approximate="tanh"))
        return self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))

    def forward(self, x):
        x = x + self.attention(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class ReferenceLM(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
        self.tok = nn.Embedding(m.vocab_size, m.hidden_size)
        if m.arch == "gpt":
            self.pos = nn.Embedding(m.max_seq_len, m.hidden_size)
        self.blocks = nn.ModuleList(Block(m) for _ in range(m.num_layers))
        self.norm = (nn.LayerNorm(m.hidden_size, eps=m.norm_eps) if m.arch == "gpt"
                     else nn.RMSNorm(m.hidden_size, eps=m.norm_eps))
        if not m.tie_embeddings:
            self.head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)

    def forward(self, tokens, targets):
        x = self.tok(tokens)
        if self.m.arch == "gpt":
            x = x + self.pos(torch.arange(tokens.shape[1]))
        for b in self.blocks:
            x = b(x)
        x = self.norm(x)
        w = self.tok.weight if self.m.tie_embeddings else self.head.weight
        return F.cross_entropy(F.linear(x, w).flatten(0, 1), targets.flatten())

    def named_logical(self):
        """Our parameters under the logical tensor names of dynatrain.vps.model."""
        out = {"embed.tokens": self.tok.weight, "final_norm.weight": self.norm.weight}
        if self.m.arch == "gpt":
            out["embed.positions"] = self.pos.weight
            out["final_norm.bias"] = self.norm.bias
        if not self.m.tie_embeddings:
            out["head.weight"] = self.head.weight
        for i, b in enumerate(self.blocks):
            p = f"layers.{i}"
            mods = {"attn_norm": b.attn_norm, "mlp_norm": b.mlp_norm, "attn.q": b.q,
                    "attn.k": b.k, "attn.v": b.v, "attn.o": b.o}
            if self.m.is_moe:
                out.update({f"{p}.moe.router.weight": b.router.weight,
                            f"{p}.moe.experts.gate": b.gate, f"{p}.moe.experts.up": b.up,
                            f"{p}.moe.experts.down": b.down})
            elif self.m.arch == "gpt":
                mods.update({"mlp.fc1": b.fc1, "mlp.fc2": b.fc2})
            else:
                mods.update({"mlp.gate": b.w_gate, "mlp.up": b.w_up, "mlp.down": b.w_down})
            if self.m.qk_norm:
                mods.update({"attn.q_norm": b.q_norm, "attn.k_norm": b.k_norm})
            for name, mod in mods.items():
                out[f"{p}.{name}.weight"] = mod.weight
                if getattr(mod, "bias", None) is not None:
                    out[f"{p}.{name}.bias"] = mod.bias
        return out


def torch_schedule(opt, config):
    """A torch.optim.lr_scheduler object for ``config``'s schedule (``lr`` is the peak):
    stepped once after each optimizer step, it gives the next step's rate."""
    from torch.optim.lr_scheduler import (ConstantLR, CosineAnnealingLR, LinearLR,
                                          SequentialLR)

    sched = config.lr_schedule
    peak, floor, warmup = config.lr, sched.min_lr, sched.warmup_steps
    end = sched.decay_steps or max(config.total_steps, warmup + 1)
    parts = []
    if warmup:
        # Step s of the warmup trains at peak * (s + 1) / warmup: factor 1/warmup at the
        # first step, 1 at step warmup - 1.
        parts.append(LinearLR(opt, start_factor=1.0 / warmup, end_factor=1.0,
                              total_iters=max(warmup - 1, 1)))
    if sched.decay == "cosine":
        parts.append(CosineAnnealingLR(opt, T_max=end - warmup, eta_min=floor))
    elif sched.decay == "linear":
        parts.append(LinearLR(opt, start_factor=1.0, end_factor=floor / peak,
                              total_iters=end - warmup))
    else:
        parts.append(ConstantLR(opt, factor=1.0, total_iters=0))
    if len(parts) == 1:
        return parts[0]
    return SequentialLR(opt, parts, milestones=[warmup])


class Reference(NamedTuple):
    losses: list[float]
    params: dict[str, torch.Tensor]
    """Final parameters by logical name."""
    grad_norms: list[float]
    """Each step's gradient norm before clipping (float64, over the full parameters)."""


def train_reference(config, steps: int) -> Reference:
    """Single-process training of ``config``'s model with its batch, optimizer, schedule and
    clipping."""
    m = config.model
    model = ReferenceLM(m)
    params = model.named_logical()
    specs = {t.name: t for t in m.tensors}
    assert set(params) == set(specs), set(params) ^ set(specs)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(initial_tensor(m, specs[name], config.seed))
    decay = [p for n, p in params.items() if p.dim() >= 2]
    no_decay = [p for n, p in params.items() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=config.lr, betas=config.betas, eps=config.eps, foreach=False)
    schedule = torch_schedule(opt, config)
    source = token_source(config)
    losses, norms, position = [], [], 0
    for _ in range(steps):
        opt.zero_grad()
        batches = micro_batches(source, position, config.global_batch_size, 1, 0,
                                config.micro_batch_size)
        total = 0.0
        for inputs, targets in batches:
            loss = model(inputs, targets)
            (loss / len(batches)).backward()
            total += loss.item()
        grads = [p.grad for p in params.values()]
        norm = torch.nn.utils.get_total_norm([g.double() for g in grads])
        if config.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(list(params.values()), config.grad_clip, norm)
        norms.append(float(norm))
        opt.step()
        schedule.step()
        losses.append(total / len(batches))
        position += config.global_batch_size
    return Reference(losses, {n: p.detach().clone() for n, p in params.items()}, norms)

"""An independent single-process reference: plain torch.nn modules over full tensors.

Written separately from dynatrain.trainer (no shared forward code): nn.Linear, nn.Embedding,
nn.LayerNorm/nn.RMSNorm, a loop over experts, F.cross_entropy. It shares only the initial
values (dynatrain.trainer.weights) and the data stream, which are inputs, not the computation
under test. The distributed trainer under every layout must follow this model's losses.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynatrain.trainer.data import micro_batches, token_source
from dynatrain.trainer.weights import initial_tensor


class Block(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
        H, hd = m.hidden_size, m.head_dim
        bias = m.arch == "gpt"
        Norm = (lambda n: nn.LayerNorm(n, eps=1e-5)) if m.arch == "gpt" else \
            (lambda n: nn.RMSNorm(n, eps=1e-5))
        self.attn_norm, self.mlp_norm = Norm(H), Norm(H)
        self.q = nn.Linear(H, m.num_heads * hd, bias=bias)
        self.k = nn.Linear(H, m.num_kv_heads * hd, bias=bias)
        self.v = nn.Linear(H, m.num_kv_heads * hd, bias=bias)
        self.o = nn.Linear(m.num_heads * hd, H, bias=bias)
        if m.qk_norm:
            self.q_norm, self.k_norm = nn.RMSNorm(hd, eps=1e-5), nn.RMSNorm(hd, eps=1e-5)
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
        freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
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
        self.norm = (nn.LayerNorm(m.hidden_size, eps=1e-5) if m.arch == "gpt"
                     else nn.RMSNorm(m.hidden_size, eps=1e-5))
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


def train_reference(config, steps: int):
    """(losses, final params by logical name) of single-process training."""
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
    source = token_source(config.data, m.vocab_size, config.seq_len, config.seed)
    losses, position = [], 0
    for _ in range(steps):
        opt.zero_grad()
        batches = micro_batches(source, position, config.global_batch_size, 1, 0,
                                config.micro_batch_size)
        total = 0.0
        for inputs, targets in batches:
            loss = model(inputs, targets)
            (loss / len(batches)).backward()
            total += loss.item()
        opt.step()
        losses.append(total / len(batches))
        position += config.global_batch_size
    return losses, {n: p.detach().clone() for n, p in params.items()}

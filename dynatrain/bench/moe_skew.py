"""A tiny Mixtral checkpoint whose routers send every token of chosen layers to the experts of
expert-parallel rank 0: MoE routing skew made by the weights, for the MoE rebalance's test and
figure (``benchmarks/moe_rebalance.py``).

``transformers`` makes a random ``MixtralForCausalLM`` with moe-tiny's shapes (hidden 128,
4 heads, 2 key/value heads, 8 experts of width 256, top-2, vocabulary 2,048), then:

- the token embeddings get a constant ``+EMBED_OFFSET`` in their dimension 0, so every token's
  hidden state has one large positive coordinate (the random weights add ~0.02 per layer);
- each skewed layer's router (``gate.weight``, experts x hidden) gets ``+ROUTER_PULL`` in that
  coordinate for the first half of the experts and ``-ROUTER_PULL`` for the second half, so
  their logits differ by tens and the top-2 always lands in the first half: with ``ep=2``,
  rank 0 computes every routed token of those layers and rank 1 none;
- every other weight that reads a layer's input (the projections, the experts, the other
  routers) gets 0 in that coordinate, so the offset never spreads into the rest of the state
  and the other layers route by it, about evenly.

Nothing in the product is told about it: the skew is in the weights, and the run measures it.
Needs ``transformers`` (the ``hf``/``test`` extras).
"""

from __future__ import annotations

import json
from pathlib import Path

EMBED_OFFSET = 1.0
ROUTER_PULL = 4.0
SHAPES = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
              num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False,
              sliding_window=None)


def write_skewed_moe(out: Path, skewed_layers: tuple[int, ...] = (2, 3), *, layers: int = 4,
                     hidden: int = 128, ffn: int = 256, seed: int = 0) -> Path:
    """Save the checkpoint to ``out`` (config.json + safetensors); returns ``out``.
    ``hidden``/``ffn``: the hidden and expert widths (larger ones make the experts' share of
    a step, and so the skew's cost, stand out over the per-operator overheads)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    bad = [i for i in skewed_layers if not 0 <= i < layers]
    if bad:
        raise ValueError(f"skewed layers {bad} are not among the model's {layers} layers")
    torch.manual_seed(seed)
    config = MixtralConfig(**{**SHAPES, "num_hidden_layers": layers, "hidden_size": hidden,
                              "intermediate_size": ffn})
    model = MixtralForCausalLM(config).float()
    half = config.num_local_experts // 2
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] += EMBED_OFFSET
        for i in range(layers):
            params = {n: p for n, p in model.named_parameters()
                      if n.startswith(f"model.layers.{i}.") and "norm" not in n}
            # Every weight that reads the layer's input ignores coordinate 0, so the offset
            # never spreads into the other coordinates (a common component there would make
            # every token route alike in the layers after it).
            for p in params.values():
                if p.shape[-1] == config.hidden_size:
                    p[..., 0] = 0.0
            (gate,) = [p for n, p in params.items() if n.endswith("gate.weight")
                       and tuple(p.shape) == (config.num_local_experts, config.hidden_size)]
            if i in skewed_layers:    # ... except a skewed layer's router, which reads it
                gate[:half, 0] = ROUTER_PULL
                gate[half:, 0] = -ROUTER_PULL
    out = Path(out)
    model.save_pretrained(out)
    note = {"skewed_layers": list(skewed_layers), "embed_offset": EMBED_OFFSET,
            "router_pull": ROUTER_PULL, "seed": seed}
    (out / "skew.json").write_text(json.dumps(note, indent=2) + "\n")
    return out

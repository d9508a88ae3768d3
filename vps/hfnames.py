"""Hugging Face weight names by rule: where each VPS tensor lives among a checkpoint's tensors.

The names are data: per architecture (:class:`~.hf.HFArch`), each VPS tensor has a list of
*sources*, the first being the split names ``save_pretrained`` of transformers 5.23 writes, the
others the fused forms some checkpoints hold (``qkv_proj``, a dense ``gate_up_proj``, stacked
``mlp.experts.gate_up_proj``). A :class:`HFSource` maps any box of the VPS tensor to the boxes
of the HF tensor(s) holding it, so a reader fetches exactly one rank's share and nothing more;
:func:`export_names` lists what export writes. The config side (config.json to
:class:`~.model.ModelSpec` and back) is :mod:`.hf`.

Pure metadata, like :mod:`.model`: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from .boxes import Box, full_box
from .model import ModelSpec

if TYPE_CHECKING:
    from .hf import HFArch


@dataclass(frozen=True)
class HFSource:
    """Where one VPS tensor lives in a checkpoint.

    Either one HF tensor, of which the VPS tensor is the slab ``[offset, offset + n)`` along
    ``dim`` (all of it when unfused), or (``per_expert``) one HF tensor per expert, expert ``e``
    being row ``e`` of the VPS tensor's dim 0, each again possibly a slab of a fused tensor.
    """

    names: tuple[str, ...]
    """One HF tensor name; or, per expert, one name per expert in order."""
    hf_shape: tuple[int, ...]
    """Shape of each named HF tensor."""
    per_expert: bool = False
    dim: int = 0
    """The HF tensor's dim along which the VPS tensor is a slab (fused tensors)."""
    offset: int = 0
    extent: int = 0
    """The slab's length along ``dim``; 0: the whole dim."""

    @property
    def fused(self) -> bool:
        return self.offset != 0 or self.extent not in (0, self.hf_shape[self.dim])

    def hf_boxes(self, box: Box) -> list[tuple[str, Box]]:
        """The (HF tensor, box in it) that hold ``box`` of the VPS tensor, in order: one, or
        one per expert of ``box``'s dim 0 (to be stacked)."""
        if self.per_expert:
            (e0, e1), inner = box[0], box[1:]
            return [(self.names[e], self._shift(inner)) for e in range(e0, e1)]
        return [(self.names[0], self._shift(box))]

    def _shift(self, box: Box) -> Box:
        if not self.offset:
            return tuple(box)
        out = list(box)
        a, b = out[self.dim]
        out[self.dim] = (a + self.offset, b + self.offset)
        return tuple(out)

    def parts(self, vps_shape: tuple[int, ...]) -> list[tuple[str, Box]]:
        """(HF tensor, the VPS box it holds): the inverse, for writing an unfused source."""
        if self.fused:
            raise ValueError(f"{self.names[0]} is fused; export writes split tensors only")
        if self.per_expert:
            inner = full_box(vps_shape[1:])
            return [(n, ((e, e + 1),) + inner) for e, n in enumerate(self.names)]
        return [(self.names[0], full_box(vps_shape))]


@dataclass(frozen=True)
class _Whole:
    template: str


@dataclass(frozen=True)
class _Experts:
    template: str
    """With ``{e}`` for the expert index."""


@dataclass(frozen=True)
class _Fused:
    template: str
    group: str
    """``qkv`` (q, k, v rows) or ``gate_up`` (gate, then up)."""
    index: int
    dim: int = 0


# Per layer, relative to ``model.layers.{i}.``. The first source of each is what export writes
# (the names save_pretrained writes); the rest are fused forms a reader also accepts.
_LAYER_RULES: dict[str, tuple] = {
    "attn_norm.weight": (_Whole("input_layernorm.weight"),),
    "mlp_norm.weight": (_Whole("post_attention_layernorm.weight"),),
    "attn.q.weight": (_Whole("self_attn.q_proj.weight"),
                      _Fused("self_attn.qkv_proj.weight", "qkv", 0)),
    "attn.k.weight": (_Whole("self_attn.k_proj.weight"),
                      _Fused("self_attn.qkv_proj.weight", "qkv", 1)),
    "attn.v.weight": (_Whole("self_attn.v_proj.weight"),
                      _Fused("self_attn.qkv_proj.weight", "qkv", 2)),
    "attn.q.bias": (_Whole("self_attn.q_proj.bias"),
                    _Fused("self_attn.qkv_proj.bias", "qkv", 0)),
    "attn.k.bias": (_Whole("self_attn.k_proj.bias"),
                    _Fused("self_attn.qkv_proj.bias", "qkv", 1)),
    "attn.v.bias": (_Whole("self_attn.v_proj.bias"),
                    _Fused("self_attn.qkv_proj.bias", "qkv", 2)),
    "attn.q_norm.weight": (_Whole("self_attn.q_norm.weight"),),
    "attn.k_norm.weight": (_Whole("self_attn.k_norm.weight"),),
    "attn.o.weight": (_Whole("self_attn.o_proj.weight"),),
    "mlp.gate.weight": (_Whole("mlp.gate_proj.weight"),
                        _Fused("mlp.gate_up_proj.weight", "gate_up", 0)),
    "mlp.up.weight": (_Whole("mlp.up_proj.weight"),
                      _Fused("mlp.gate_up_proj.weight", "gate_up", 1)),
    "mlp.down.weight": (_Whole("mlp.down_proj.weight"),),
}
# transformers 5 keeps both MoE families' experts in memory as stacked ``mlp.experts.gate_up_proj``
# (E, 2F, H: gate rows, then up rows) and ``mlp.experts.down_proj`` (E, H, F), with the router at
# ``mlp.gate.weight``; checkpoints written from that layout hold those names.
_STACKED = {
    "moe.router.weight": (_Whole("mlp.gate.weight"),),
    "moe.experts.gate": (_Fused("mlp.experts.gate_up_proj", "gate_up", 0, dim=1),),
    "moe.experts.up": (_Fused("mlp.experts.gate_up_proj", "gate_up", 1, dim=1),),
    "moe.experts.down": (_Whole("mlp.experts.down_proj"),),
}
_MOE_RULES: dict[str, dict[str, tuple]] = {
    "mixtral": {
        "moe.router.weight": (_Whole("block_sparse_moe.gate.weight"),),
        "moe.experts.gate": (_Experts("block_sparse_moe.experts.{e}.w1.weight"),),
        "moe.experts.up": (_Experts("block_sparse_moe.experts.{e}.w3.weight"),),
        "moe.experts.down": (_Experts("block_sparse_moe.experts.{e}.w2.weight"),),
    },
    "qwen3_moe": {
        "moe.router.weight": (),
        "moe.experts.gate": (_Experts("mlp.experts.{e}.gate_proj.weight"),),
        "moe.experts.up": (_Experts("mlp.experts.{e}.up_proj.weight"),),
        "moe.experts.down": (_Experts("mlp.experts.{e}.down_proj.weight"),),
    },
}
_GLOBAL_RULES = {
    "embed.tokens": (_Whole("model.embed_tokens.weight"),),
    "final_norm.weight": (_Whole("model.norm.weight"),),
    "head.weight": (_Whole("lm_head.weight"),),
}


def _group_sizes(model: ModelSpec, group: str, vps_name: str) -> tuple[int, ...]:
    if group == "qkv":
        return (model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim,
                model.num_kv_heads * model.head_dim)
    f = model.moe_ffn_hidden_size if ".experts." in vps_name else model.ffn_hidden_size
    return (f, f)


def _rules_for(arch: HFArch, vps_name: str) -> tuple[str, tuple]:
    """(HF name prefix, rules) of one VPS tensor."""
    if vps_name in _GLOBAL_RULES:
        return "", _GLOBAL_RULES[vps_name]
    _, layer, rest = vps_name.split(".", 2)
    prefix = f"model.layers.{layer}."
    if rest.startswith("moe."):
        return prefix, _MOE_RULES[arch.moe][rest] + _STACKED[rest]
    return prefix, _LAYER_RULES[rest]


@lru_cache(maxsize=8)
def _shapes(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in model.tensors}


def hf_sources(arch: HFArch, model: ModelSpec, vps_name: str) -> tuple[HFSource, ...]:
    """Every way a checkpoint may hold ``vps_name``: the split (written) form first."""
    shape = _shapes(model).get(vps_name)
    if shape is None:
        raise KeyError(f"{model.name} has no tensor {vps_name!r}")
    prefix, rules = _rules_for(arch, vps_name)
    out = []
    for rule in rules:
        name = prefix + rule.template
        if isinstance(rule, _Whole):
            out.append(HFSource((name,), shape))
        elif isinstance(rule, _Experts):
            out.append(HFSource(tuple(name.format(e=e) for e in range(model.num_experts)),
                                shape[1:], per_expert=True))
        else:
            sizes = _group_sizes(model, rule.group, vps_name)
            hf_shape = list(shape)
            hf_shape[rule.dim] = sum(sizes)
            out.append(HFSource((name,), tuple(hf_shape), dim=rule.dim,
                                offset=sum(sizes[:rule.index]), extent=sizes[rule.index]))
    return tuple(out)


def export_names(arch: HFArch, model: ModelSpec
                 ) -> list[tuple[str, str, Box, tuple[int, ...]]]:
    """(HF tensor, VPS tensor, VPS box, HF shape) for every tensor export writes, in model
    order: the first (split) source of each VPS tensor."""
    out = []
    for t in model.tensors:
        src = hf_sources(arch, model, t.name)[0]
        for hf_name, box in src.parts(t.shape):
            out.append((hf_name, t.name, box, src.hf_shape))
    return out


"""Model specs: the logical, unsharded model that every layout is a mapping of.

A :class:`ModelSpec` holds a transformer's hyper-parameters; :func:`model_tensors` turns it into
the exact list of logical tensors (:class:`TensorSpec`), each carrying the metadata the mapping
needs to shard it Megatron-style: which dim TP splits and in what indivisible units (heads, or
single rows), which dim stacks experts (for EP), and which layer it belongs to (for PP).
Two families are described: ``gpt`` (GPT-2: LayerNorm with bias, GELU MLP, learned positions,
tied embeddings) and ``llama`` (RMSNorm, SwiGLU, RoPE, optionally scaled as :class:`RopeScaling`
says, optional GQA, optional MoE, optional QK-norm as in Qwen3).

This module is pure metadata: no torch import, so a 235B model can be described on a laptop.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from math import prod
from pathlib import Path
from typing import Any

ARCHS = ("gpt", "llama")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Pseudo layer indices for tensors that live outside the transformer blocks: the embedding
# sits on the first pipeline stage, the final norm and LM head on the last.
FIRST = -1
LAST = 1 << 30


class ModelSpecError(ValueError):
    """A model spec (preset name, file or field) is not valid; the message names the value."""


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """One logical model tensor in full, unsharded form."""

    name: str
    """Dotted name, e.g. ``layers.3.attn.q.weight``."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: str
    """Dtype of the working parameter (master copy and moments are always float32)."""
    layer: int
    """Transformer block index, or :data:`FIRST` (embedding) / :data:`LAST` (final norm, head)."""
    tp_dim: int | None = None
    """The dim that tensor parallelism splits, or None if every TP rank holds it whole."""
    tp_units: int = 0
    """Indivisible units along ``tp_dim`` (heads for attention, rows otherwise)."""
    tp_replicable: bool = False
    """TP may exceed ``tp_units`` by replicating units (GQA key/value heads, Megatron-style)."""
    expert_dim: int | None = None
    """The dim along which experts are stacked (split by EP), or None for dense tensors."""
    tied_to_last: bool = False
    """Also used by the last pipeline stage (tied input/output embedding): a replica lives there."""

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def rule(self) -> "ShardRule":
        return ShardRule(shape=self.shape, tp_dim=self.tp_dim, tp_units=self.tp_units,
                         tp_replicable=self.tp_replicable, expert_dim=self.expert_dim)

    @property
    def signature(self) -> tuple:
        """Everything about the tensor except its name and layer: tensors with the same
        signature on the same pipeline stages shard identically, which the planner exploits."""
        return (self.rule, self.dtype, self.tied_to_last)


@dataclass(frozen=True)
class ShardRule:
    """The part of a TensorSpec that decides how it is cut into TP/EP shards.

    Many tensors share one rule (every layer's q projection, say), so per-rule results are
    cached by the mapping.
    """

    shape: tuple[int, ...]
    tp_dim: int | None
    tp_units: int
    tp_replicable: bool
    expert_dim: int | None


ROPE_SCALINGS = ("linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """How a ``llama``-family model's RoPE frequencies are stretched for contexts longer than it
    was pretrained on: transformers' ``rope_type`` values other than ``default``, same names.

    ``linear`` divides every frequency by ``factor`` (positions interpolated). ``dynamic``
    (NTK) raises the base to ``theta * (factor * T / max_seq_len - factor + 1) ** (d / (d - 2))``
    for a sequence of T > ``max_seq_len`` tokens, and is plain RoPE up to ``max_seq_len``.
    ``llama3`` divides the frequencies whose wavelength exceeds ``original_max_seq_len /
    low_freq_factor`` by ``factor``, keeps those shorter than ``original_max_seq_len /
    high_freq_factor``, and blends in between. ``yarn`` blends interpolated and original
    frequencies over the dims between ``beta_fast`` and ``beta_slow`` rotations in
    ``original_max_seq_len``, and multiplies cos and sin by ``attention_factor``.
    """

    type: str
    """One of ``linear``, ``dynamic``, ``yarn``, ``llama3``."""
    factor: float
    """How many times longer a context the scaled RoPE is meant for (>= 1)."""
    original_max_seq_len: int = 0
    """The pretraining context (transformers' ``original_max_position_embeddings``); needed by
    ``llama3`` and ``yarn``, 0 for the others."""
    low_freq_factor: float = 0.0
    """``llama3`` only."""
    high_freq_factor: float = 0.0
    """``llama3`` only; greater than ``low_freq_factor``."""
    beta_fast: float = 32.0
    """``yarn`` only: rotations in ``original_max_seq_len`` above which a dim is unscaled."""
    beta_slow: float = 1.0
    """``yarn`` only: rotations below which a dim is fully interpolated."""
    attention_factor: float = 0.0
    """``yarn`` only: the factor on cos and sin; 0 means the YaRN paper's ``0.1 ln(factor) + 1``
    (1 for ``factor`` <= 1), filled in on construction."""
    truncate: bool = True
    """``yarn`` only: round the blended range of dims outwards to whole dims."""

    def __post_init__(self) -> None:
        p = []
        if self.type not in ROPE_SCALINGS:
            raise ModelSpecError(f"rope_scaling.type={self.type!r} is not one of "
                                 f"{', '.join(ROPE_SCALINGS)} (no scaling: rope_scaling null)")
        if not _number(self.factor) or self.factor < 1:
            p.append(f"factor={self.factor!r} must be a number >= 1")
        needs_original = self.type in ("llama3", "yarn")
        if needs_original and not (isinstance(self.original_max_seq_len, int)
                                   and self.original_max_seq_len >= 1):
            p.append(f"original_max_seq_len={self.original_max_seq_len!r} must be a positive "
                     f"integer for type={self.type!r}")
        if not needs_original and self.original_max_seq_len:
            p.append(f"original_max_seq_len={self.original_max_seq_len!r} is not a setting of "
                     f"type={self.type!r} (leave it 0)")
        if self.type == "llama3":
            if not (_number(self.low_freq_factor) and _number(self.high_freq_factor)
                    and 0 < self.low_freq_factor < self.high_freq_factor):
                p.append(f"low_freq_factor={self.low_freq_factor!r} and high_freq_factor="
                         f"{self.high_freq_factor!r} must be numbers with 0 < low < high")
        elif self.low_freq_factor or self.high_freq_factor:
            p.append(f"low_freq_factor/high_freq_factor are settings of type='llama3' only, "
                     f"not {self.type!r}")
        yarn_defaults = (32.0, 1.0, 0.0, True)
        yarn = (self.beta_fast, self.beta_slow, self.attention_factor, self.truncate)
        if self.type == "yarn":
            if not (_number(self.beta_fast) and _number(self.beta_slow)
                    and 0 < self.beta_slow <= self.beta_fast):
                p.append(f"beta_fast={self.beta_fast!r} and beta_slow={self.beta_slow!r} must be "
                         "numbers with 0 < beta_slow <= beta_fast")
            if not _number(self.attention_factor) or self.attention_factor < 0:
                p.append(f"attention_factor={self.attention_factor!r} must be a number > 0 "
                         "(0: derived from factor)")
            elif self.attention_factor == 0 and not p:
                object.__setattr__(self, "attention_factor", yarn_mscale(self.factor))
            if not isinstance(self.truncate, bool):
                p.append(f"truncate={self.truncate!r} must be true or false")
        elif yarn != yarn_defaults:
            p.append("beta_fast, beta_slow, attention_factor and truncate are settings of "
                     f"type='yarn' only, not {self.type!r}")
        if p:
            raise ModelSpecError(f"rope_scaling (type={self.type!r}): " + "; ".join(p))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context ``factor`` times longer (1 when not longer)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Hyper-parameters of a GPT- or Llama-family transformer (dense or MoE)."""

    name: str
    """Preset or user-chosen name."""
    arch: str
    """``gpt`` or ``llama``."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden_size: int
    """Dense MLP width (unused by MoE layers)."""
    max_seq_len: int = 2048
    num_kv_heads: int = 0
    """Key/value heads for GQA; 0 means equal to ``num_heads``."""
    head_dim: int = 0
    """0 means ``hidden_size // num_heads``."""
    num_experts: int = 0
    """0 for a dense model; otherwise every layer is an MoE layer with this many experts."""
    experts_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    tie_embeddings: bool = False
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before RoPE (Qwen3)."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections of an ``llama``-family model (Qwen2); ``gpt`` models
    always have every bias."""
    rope_theta: float = 10000.0
    """RoPE base frequency (``llama`` family)."""
    rope_scaling: RopeScaling | None = None
    """Scaled RoPE (``llama`` family), or None for plain RoPE. A mapping of
    :class:`RopeScaling`'s fields is accepted and converted."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm/RMSNorm."""
    moe_norm_topk: bool = True
    """Renormalise the top-k routing probabilities to sum to one (Mixtral: yes; Qwen3-MoE:
    its ``norm_topk_prob``)."""
    dtype: str = "bfloat16"
    """Dtype of the working parameters."""
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        problems = []
        if self.arch not in ARCHS:
            problems.append(f"arch={self.arch!r} is not one of {', '.join(ARCHS)}")
        if self.dtype not in DTYPE_BYTES:
            problems.append(f"dtype={self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size",
                     "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer")
        if problems:
            raise ModelSpecError(f"model {self.name!r}: " + "; ".join(problems))
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                problems.append(f"hidden_size={self.hidden_size} is not divisible by "
                                f"num_heads={self.num_heads}; set head_dim explicitly")
            else:
                object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} is not a multiple of "
                            f"num_kv_heads={self.num_kv_heads}")
        if self.num_experts:
            if not 1 <= self.experts_top_k <= self.num_experts:
                problems.append(f"experts_top_k={self.experts_top_k} must be in "
                                f"1..num_experts={self.num_experts}")
            if self.moe_ffn_hidden_size < 1:
                problems.append(f"moe_ffn_hidden_size={self.moe_ffn_hidden_size} must be "
                                "positive for an MoE model")
        if self.arch == "gpt" and (self.num_experts or self.qk_norm or self.qkv_bias):
            problems.append("arch='gpt' supports neither experts, qk_norm nor qkv_bias (it has "
                            "every bias already); use arch='llama'")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            problems.append(f"rope_theta={self.rope_theta!r} must be a positive number")
        if isinstance(self.rope_scaling, dict):
            try:
                object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
            except TypeError as e:      # an unknown key, or type/factor missing
                problems.append(f"rope_scaling={self.rope_scaling!r}: {e}; valid keys: "
                                f"{', '.join(f.name for f in fields(RopeScaling))}")
            except ModelSpecError as e:
                problems.append(str(e))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            problems.append(f"rope_scaling={self.rope_scaling!r} must be a mapping or null")
        if self.rope_scaling is not None and self.arch != "llama":
            problems.append(f"rope_scaling is a setting of arch='llama' only (arch="
                            f"{self.arch!r} has learned positions)")
        if not (isinstance(self.norm_eps, (int, float)) and 0 < self.norm_eps < 1):
            problems.append(f"norm_eps={self.norm_eps!r} must be a number in (0, 1)")
        if problems:
            raise ModelSpecError(f"model {self.name!r}: " + "; ".join(problems))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @cached_property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """Every logical tensor of the model, in a fixed order."""
        return tuple(model_tensors(self))

    @cached_property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "description"}
        if self.rope_scaling is not None:
            out["rope_scaling"] = asdict(self.rope_scaling)
        return out


def model_tensors(m: ModelSpec) -> list[TensorSpec]:
    """The model's tensors, with Megatron-style sharding metadata."""
    h, hd, nh, nkv = m.hidden_size, m.head_dim, m.num_heads, m.num_kv_heads
    bias = m.arch == "gpt"
    qkv_bias = bias or m.qkv_bias
    out: list[TensorSpec] = []

    def add(name, shape, layer, **kw):
        out.append(TensorSpec(name=name, shape=tuple(shape), dtype=m.dtype, layer=layer, **kw))

    def norm(prefix, layer, width=h):
        add(f"{prefix}.weight", (width,), layer)
        if bias:
            add(f"{prefix}.bias", (width,), layer)

    # The vocabulary is split across TP ranks (VocabParallelEmbedding).
    add("embed.tokens", (m.vocab_size, h), FIRST, tp_dim=0, tp_units=m.vocab_size,
        tied_to_last=m.tie_embeddings)
    if m.arch == "gpt":
        add("embed.positions", (m.max_seq_len, h), FIRST)

    for i in range(m.num_layers):
        p = f"layers.{i}"
        norm(f"{p}.attn_norm", i)
        # Column-parallel q/k/v split by heads; GQA kv heads replicate when tp > kv heads.
        add(f"{p}.attn.q.weight", (nh * hd, h), i, tp_dim=0, tp_units=nh)
        add(f"{p}.attn.k.weight", (nkv * hd, h), i, tp_dim=0, tp_units=nkv, tp_replicable=True)
        add(f"{p}.attn.v.weight", (nkv * hd, h), i, tp_dim=0, tp_units=nkv, tp_replicable=True)
        if qkv_bias:
            add(f"{p}.attn.q.bias", (nh * hd,), i, tp_dim=0, tp_units=nh)
            add(f"{p}.attn.k.bias", (nkv * hd,), i, tp_dim=0, tp_units=nkv, tp_replicable=True)
            add(f"{p}.attn.v.bias", (nkv * hd,), i, tp_dim=0, tp_units=nkv, tp_replicable=True)
        if m.qk_norm:
            add(f"{p}.attn.q_norm.weight", (hd,), i)
            add(f"{p}.attn.k_norm.weight", (hd,), i)
        # Row-parallel output projection: split along its input (heads) dim.
        add(f"{p}.attn.o.weight", (h, nh * hd), i, tp_dim=1, tp_units=nh)
        if bias:
            add(f"{p}.attn.o.bias", (h,), i)
        norm(f"{p}.mlp_norm", i)
        if m.is_moe:
            e, f = m.num_experts, m.moe_ffn_hidden_size
            add(f"{p}.moe.router.weight", (e, h), i)
            # Stacked experts: EP splits dim 0, TP splits each expert's FFN width.
            add(f"{p}.moe.experts.gate", (e, f, h), i, tp_dim=1, tp_units=f, expert_dim=0)
            add(f"{p}.moe.experts.up", (e, f, h), i, tp_dim=1, tp_units=f, expert_dim=0)
            add(f"{p}.moe.experts.down", (e, h, f), i, tp_dim=2, tp_units=f, expert_dim=0)
        elif m.arch == "gpt":
            f = m.ffn_hidden_size
            add(f"{p}.mlp.fc1.weight", (f, h), i, tp_dim=0, tp_units=f)
            add(f"{p}.mlp.fc1.bias", (f,), i, tp_dim=0, tp_units=f)
            add(f"{p}.mlp.fc2.weight", (h, f), i, tp_dim=1, tp_units=f)
            add(f"{p}.mlp.fc2.bias", (h,), i)
        else:
            f = m.ffn_hidden_size
            add(f"{p}.mlp.gate.weight", (f, h), i, tp_dim=0, tp_units=f)
            add(f"{p}.mlp.up.weight", (f, h), i, tp_dim=0, tp_units=f)
            add(f"{p}.mlp.down.weight", (h, f), i, tp_dim=1, tp_units=f)

    norm("final_norm", LAST)
    if not m.tie_embeddings:
        add("head.weight", (m.vocab_size, h), LAST, tp_dim=0, tp_units=m.vocab_size)
    return out


def model_from_dict(data: dict[str, Any], *, source: str = "model spec") -> ModelSpec:
    """Build a ModelSpec from a mapping (e.g. parsed YAML), naming unknown or bad fields."""
    if not isinstance(data, dict):
        raise ModelSpecError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    known = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ModelSpecError(f"{source}: unknown field(s) {', '.join(unknown)}; "
                             f"valid fields: {', '.join(sorted(known))}")
    missing = [n for n in ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads",
                           "ffn_hidden_size") if n not in data]
    if missing:
        raise ModelSpecError(f"{source}: missing required field(s) {', '.join(missing)}")
    data = dict(data)
    data.setdefault("name", Path(source).stem if source != "model spec" else "custom")
    try:
        return ModelSpec(**data)
    except TypeError as e:  # e.g. a list where an int belongs
        raise ModelSpecError(f"{source}: {e}") from None

"""Hugging Face checkpoints by rule: config.json to :class:`ModelSpec` and back, and where each
VPS tensor lives among a checkpoint's tensors.

This module and :mod:`.hfnames` are the only ones that know Hugging Face's names (DESIGN.md,
"outside formats by rule, in one place"). :func:`model_from_hf` reads a ``config.json`` of the
architectures the trainer computes exactly (Llama, Qwen2, Qwen3, Mixtral, Qwen3-MoE) and
refuses, naming the field, every setting whose math the trainer does not have (RoPE scalings
other than linear, dynamic, yarn and llama3, partial rotary dims, sliding windows, an
output-projection or MLP bias, another activation, dense layers among MoE ones, ...), because a
model that loads but computes something else is worse than one that does not load.
:func:`hf_config` goes the other way, for export.

The weight names are data, in :mod:`.hfnames`: per architecture, each VPS tensor has a list of
*sources*, the first being the split names ``save_pretrained`` of transformers 5.23 writes
(Mixtral's legacy ``block_sparse_moe.experts.{e}.w1``, say), the others the fused forms some
checkpoints hold (``qkv_proj``, a dense ``gate_up_proj``, stacked ``mlp.experts.gate_up_proj``
as transformers keeps them in memory). A :class:`~.hfnames.HFSource` maps any box of the VPS
tensor to the boxes of the HF tensor(s) holding it, so a reader fetches exactly one rank's share
and nothing more.

Pure metadata, like :mod:`.model`: no torch import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .model import ROPE_SCALINGS, ModelSpec, ModelSpecError, RopeScaling, yarn_mscale

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}
"""Checkpoint dtype -> working dtype. float16 trains as bfloat16: the trainer has no loss
scaling, without which float16 gradients underflow; the master copy read from the file is
float32 and holds every float16 value exactly."""


class HFCheckpointError(ModelSpecError):
    """A checkpoint's files do not hold what its config.json says (a missing tensor, a wrong
    shape, no weights file); the message names the HF tensor and the file."""


@dataclass(frozen=True)
class HFArch:
    """What one supported Hugging Face architecture is, in the trainer's terms."""

    architecture: str
    """``architectures[0]`` of its config.json, e.g. ``LlamaForCausalLM``."""
    model_type: str
    moe: str = ""
    """``mixtral`` or ``qwen3_moe`` naming of the MoE block; empty for a dense model."""
    qk_norm: bool = False
    qkv_bias: bool = False
    """q/k/v biases always present (Qwen2), independent of any config field."""
    attention_bias_field: bool = True
    """``attention_bias`` exists and, when true, also puts a bias on o_proj (refused)."""
    sliding: str = ""
    """How the config says sliding-window attention is on: ``use_sliding_window`` (Qwen),
    ``sliding_window`` (Mixtral: any value), or empty (never)."""
    defaults: tuple[tuple[str, Any], ...] = ()
    """The config class's defaults that differ from Llama's, for fields a config.json omits."""


_COMMON_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                    "hidden_act": "silu", "max_position_embeddings": 2048,
                    "num_key_value_heads": None, "head_dim": None}

ARCHS: dict[str, HFArch] = {a.architecture: a for a in (
    HFArch(architecture="LlamaForCausalLM", model_type="llama"),
    HFArch(architecture="Qwen2ForCausalLM", model_type="qwen2", qkv_bias=True,
           attention_bias_field=False, sliding="use_sliding_window",
           defaults=(("num_key_value_heads", 32), ("max_position_embeddings", 32768))),
    HFArch(architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True,
           sliding="use_sliding_window",
           defaults=(("num_key_value_heads", 32), ("head_dim", 128),
                     ("max_position_embeddings", 32768))),
    HFArch(architecture="MixtralForCausalLM", model_type="mixtral", moe="mixtral",
           attention_bias_field=False, sliding="sliding_window",
           defaults=(("rms_norm_eps", 1e-5), ("rope_theta", 1e6), ("num_key_value_heads", 8),
                     ("max_position_embeddings", 4096 * 32), ("num_local_experts", 8),
                     ("num_experts_per_tok", 2))),
    HFArch(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", moe="qwen3_moe",
           qk_norm=True, sliding="use_sliding_window",
           defaults=(("num_key_value_heads", 4), ("max_position_embeddings", 32768),
                     ("num_experts", 128), ("num_experts_per_tok", 8),
                     ("moe_intermediate_size", 768), ("norm_topk_prob", False))),
)}
MODEL_TYPES = {a.model_type: a for a in ARCHS.values()}


# -- config.json -> ModelSpec -------------------------------------------------------------------

def read_hf_config(directory) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory."""
    path = Path(directory)
    if not path.is_dir():
        raise ModelSpecError(f"Hugging Face checkpoint directory {str(directory)!r} does not "
                             "exist")
    cfg = path / CONFIG
    if not cfg.is_file():
        raise ModelSpecError(f"{str(directory)!r} is not a Hugging Face checkpoint directory: "
                             f"it has no {CONFIG}")
    try:
        data = json.loads(cfg.read_text())
    except ValueError as e:
        raise ModelSpecError(f"{cfg} could not be parsed: {e}") from None
    if not isinstance(data, dict):
        raise ModelSpecError(f"{cfg}: expected a JSON object, got {type(data).__name__}")
    return data


def model_from_hf(directory) -> ModelSpec:
    """The ModelSpec of a Hugging Face checkpoint directory, from its ``config.json``."""
    path = Path(directory)
    name = path.resolve().name or "hf"
    return model_from_hf_config(read_hf_config(path), name=name, source=str(path / CONFIG))


def hf_arch(config: dict[str, Any], *, source: str = CONFIG) -> HFArch:
    """The supported architecture a config names, or a ModelSpecError naming what it names."""
    archs = config.get("architectures")
    supported = ", ".join(ARCHS)
    if archs is None:
        model_type = config.get("model_type")
        if model_type in MODEL_TYPES:
            return MODEL_TYPES[model_type]
        raise ModelSpecError(f"{source}: no 'architectures' and model_type={model_type!r} is not "
                             f"supported; supported architectures: {supported}")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHS:
        raise ModelSpecError(f"{source}: architectures={archs!r} is not supported; supported "
                             f"(exactly one of): {supported}")
    return ARCHS[archs[0]]


_ROPE_TYPES = ("default",) + ROPE_SCALINGS
_ROPE_KEYS = {  # the keys each rope_type reads (transformers ignores any other, and so do we)
    "linear": ("factor",), "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
}


def _rope(config: dict, get) -> tuple[float, RopeScaling | None, list[str]]:
    """RoPE base, scaling and the problems with the config's RoPE settings.

    transformers 5 writes ``rope_parameters: {rope_theta, rope_type, ...}``; older configs (Llama
    3.1's, Qwen2.5's) have a top-level ``rope_theta`` and ``rope_scaling: {rope_type or type,
    factor, ...}``, which transformers prefers when both are there, as here. A missing
    ``original_max_position_embeddings`` is the top-level one, else ``max_position_embeddings``,
    and yarn's unset values are derived, all as transformers does.
    """
    problems = []
    where = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    params = config.get(where)
    if params is not None and not isinstance(params, dict):
        problems.append(f"{where}={params!r} must be a mapping")
        params = None
    params = params or {}
    nested = sorted(k for k, v in params.items() if isinstance(v, dict))
    if nested:       # per layer type (Gemma-style): one RoPE for every layer is all we compute
        problems.append(f"{where} nested by layer type ({', '.join(nested)}) is not supported "
                        "(one RoPE for every layer)")
        return 10000.0, None, problems
    rope_type = params.get("rope_type", params.get("type", "default"))
    for key, value in (("partial_rotary_factor", config.get("partial_rotary_factor")),
                       (f"{where}.partial_rotary_factor", params.get("partial_rotary_factor"))):
        if value not in (None, 1, 1.0):
            problems.append(f"{key}={value!r} is not supported (RoPE over the whole head)")
    theta = params.get("rope_theta")
    if theta is None:
        theta = get("rope_theta")                  # top-level (transformers 4), or the default
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        problems.append(f"rope_theta={theta!r} must be a positive number")
        theta = 10000.0
    if rope_type not in _ROPE_TYPES:
        problems.append(f"{where}.rope_type={rope_type!r} is not supported (one of "
                        f"{', '.join(_ROPE_TYPES)})")
    if rope_type not in ROPE_SCALINGS or problems:
        return float(theta), None, problems

    p = {k: params.get(k) for k in _ROPE_KEYS[rope_type]}
    original = p.pop("original_max_position_embeddings", None)
    if rope_type in ("llama3", "yarn"):
        top = config.get("original_max_position_embeddings")
        if top is not None and original is not None and top != original:
            problems.append(f"original_max_position_embeddings={top!r} and {where}."
                            f"original_max_position_embeddings={original!r} disagree")
        original = original or top or get("max_position_embeddings")
        p["original_max_seq_len"] = original
    if rope_type == "yarn":
        if p["factor"] is None and isinstance(original, int) and original > 0:
            p["factor"] = get("max_position_embeddings") / original
        mscale, mscale_all = p.pop("mscale"), p.pop("mscale_all_dim")
        factor = p["factor"]
        if p["attention_factor"] is None and mscale and mscale_all and isinstance(
                factor, (int, float)):
            p["attention_factor"] = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        if p["attention_factor"] is None:
            p["attention_factor"] = 0.0                          # derived from factor
        elif p["attention_factor"] == 0:
            problems.append(f"{where}.attention_factor=0 is not supported (it zeroes every "
                            "attention logit; omit it to derive it from factor)")
            return float(theta), None, problems
        p["beta_fast"] = p["beta_fast"] or 32.0                  # transformers: `or` defaults
        p["beta_slow"] = p["beta_slow"] or 1.0
        p["truncate"] = True if p["truncate"] is None else p["truncate"]
    missing = sorted(k for k, v in p.items() if v is None)
    if missing:
        problems.append(f"{where} of rope_type={rope_type!r} lacks {', '.join(missing)}")
        return float(theta), None, problems
    try:
        return float(theta), RopeScaling(type=rope_type, **p), problems
    except ModelSpecError as e:
        return float(theta), None, problems + [f"{where}: {e}"]


def model_from_hf_config(config: dict[str, Any], *, name: str = "hf",
                         source: str = CONFIG) -> ModelSpec:
    """The ModelSpec a ``config.json`` (parsed) describes; every unsupported setting is named
    in one ModelSpecError."""
    arch = hf_arch(config, source=source)
    defaults = {**_COMMON_DEFAULTS, **dict(arch.defaults)}

    def get(key):
        value = config.get(key)
        return defaults.get(key) if value is None else value

    problems = []
    required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"]
    missing = [k for k in required if config.get(k) is None]
    if missing:
        raise ModelSpecError(f"{source}: missing required field(s) {', '.join(missing)} "
                             f"({arch.architecture})")
    for key in required + ["num_key_value_heads", "head_dim", "max_position_embeddings"]:
        value = get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            problems.append(f"{key}={value!r} must be a positive integer")
    if problems:
        raise ModelSpecError(f"{source}: " + "; ".join(problems))

    act = config.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act={act!r} is not supported (only 'silu': SwiGLU MLPs)")
    if config.get("mlp_bias"):
        problems.append("mlp_bias=true is not supported (MLP projections without bias)")
    if config.get("attention_bias"):
        problems.append(
            f"attention_bias=true is not supported for {arch.architecture} (it also puts a bias "
            "on o_proj, which the trainer does not have; q/k/v-only biases are Qwen2's)"
            if arch.attention_bias_field else
            f"attention_bias=true is not a setting of {arch.architecture}")
    dropout = config.get("attention_dropout") or 0.0
    if dropout:
        problems.append(f"attention_dropout={dropout!r} is not supported (the trainer has no "
                        "dropout; set 0.0)")
    theta, rope_scaling, rope = _rope(config, get)
    problems += rope

    max_pos = get("max_position_embeddings")
    window = config.get("sliding_window")
    # A window at least as long as any sequence never masks anything: that is full attention.
    short_window = isinstance(window, int) and window < max_pos
    if arch.sliding == "use_sliding_window" and config.get("use_sliding_window") and (
            window is None or short_window):
        problems.append(f"use_sliding_window=true (sliding_window={window!r}) is not supported "
                        f"(full causal attention only; max_position_embeddings={max_pos})")
    if arch.sliding == "sliding_window" and window is not None and short_window:
        problems.append(f"sliding_window={window!r} is not supported (full causal attention "
                        f"only: null, or >= max_position_embeddings={max_pos})")
    if not arch.sliding and window is not None:
        problems.append(f"sliding_window={window!r} is not a setting of {arch.architecture}")
    layer_types = config.get("layer_types")
    if layer_types is not None:
        other = sorted({str(t) for t in layer_types if t != "full_attention"}) \
            if isinstance(layer_types, list) else [layer_types]
        if other:
            problems.append(f"layer_types with {other} is not supported (every layer "
                            "'full_attention')")

    heads = config["num_attention_heads"]
    kv = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or config["hidden_size"] // heads
    eps = get("rms_norm_eps")
    dtype_name = config.get("dtype", config.get("torch_dtype")) or "float32"
    if dtype_name not in DTYPES:
        problems.append(f"dtype={dtype_name!r} is not supported (one of {', '.join(DTYPES)}; "
                        "float16 trains as bfloat16)")
        dtype_name = "float32"

    moe: dict[str, Any] = {}
    if arch.moe == "mixtral":
        if config.get("router_jitter_noise"):
            problems.append(f"router_jitter_noise={config['router_jitter_noise']!r} is not "
                            "supported (the router has no noise; set 0.0)")
        moe = dict(num_experts=get("num_local_experts"), experts_top_k=get("num_experts_per_tok"),
                   moe_ffn_hidden_size=config["intermediate_size"], moe_norm_topk=True)
    elif arch.moe == "qwen3_moe":
        if config.get("mlp_only_layers"):
            problems.append(f"mlp_only_layers={config['mlp_only_layers']!r} is not supported "
                            "(every layer an MoE layer: [] )")
        if get("decoder_sparse_step") not in (None, 1):
            problems.append(f"decoder_sparse_step={config['decoder_sparse_step']!r} is not "
                            "supported (every layer an MoE layer: 1)")
        if config.get("shared_expert_intermediate_size"):
            problems.append("shared experts (shared_expert_intermediate_size) are not supported")
        # transformers saves Qwen3-MoE's num_experts under its attribute_map alias.
        experts = config.get("num_experts", config.get("num_local_experts")) \
            or get("num_experts")
        moe = dict(num_experts=experts, experts_top_k=get("num_experts_per_tok"),
                   moe_ffn_hidden_size=get("moe_intermediate_size"),
                   moe_norm_topk=bool(get("norm_topk_prob")))
    if problems:
        raise ModelSpecError(f"{source} ({arch.architecture}): " + "; ".join(problems))
    try:
        return ModelSpec(
            name=name, arch="llama", vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
            num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
            ffn_hidden_size=config["intermediate_size"], max_seq_len=max_pos,
            tie_embeddings=bool(get("tie_word_embeddings")), qk_norm=arch.qk_norm,
            qkv_bias=arch.qkv_bias, rope_theta=theta, rope_scaling=rope_scaling,
            norm_eps=float(eps),
            dtype=DTYPES[dtype_name], description=f"{arch.architecture} from {source}", **moe)
    except TypeError as e:  # a list where a number belongs, say
        raise ModelSpecError(f"{source}: {e}") from None


# -- ModelSpec -> config.json -------------------------------------------------------------------

def arch_for(model: ModelSpec) -> HFArch:
    """The Hugging Face architecture that computes ``model`` exactly, or a ModelSpecError."""
    why = None
    if model.arch != "llama":
        why = f"arch={model.arch!r} has no Hugging Face export (only 'llama'-family models)"
    elif model.is_moe:
        if model.qkv_bias:
            why = "an MoE model with qkv_bias has no matching architecture"
        elif model.qk_norm:
            return ARCHS["Qwen3MoeForCausalLM"]
        elif not model.moe_norm_topk:
            why = ("an MoE model without qk_norm is Mixtral, which always renormalises the "
                   "top-k weights (moe_norm_topk=False is Qwen3-MoE's, with qk_norm)")
        else:
            return ARCHS["MixtralForCausalLM"]
    elif model.qk_norm and model.qkv_bias:
        why = "qk_norm together with qkv_bias has no matching architecture"
    elif model.qk_norm:
        return ARCHS["Qwen3ForCausalLM"]
    elif model.qkv_bias:
        return ARCHS["Qwen2ForCausalLM"]
    else:
        return ARCHS["LlamaForCausalLM"]
    raise ModelSpecError(f"model {model.name!r}: {why}; supported: {', '.join(ARCHS)}")


def hf_config(model: ModelSpec, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` that transformers loads as ``model``.

    ``base`` (the config the model was imported from) is kept, with every field the spec
    decides set from the spec, so token ids and other fields the trainer does not use survive.
    """
    arch = hf_arch(base) if base else arch_for(model)
    out: dict[str, Any] = dict(base or {})
    out.pop("torch_dtype", None)          # transformers 5 writes `dtype`; two would disagree
    out.pop("rope_theta", None)
    out.pop("rope_scaling", None)
    out.pop("original_max_position_embeddings", None)   # written inside rope_parameters
    out.update(
        architectures=[arch.architecture], model_type=arch.model_type,
        vocab_size=model.vocab_size, hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size, num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads, num_key_value_heads=model.num_kv_heads,
        head_dim=model.head_dim, hidden_act="silu", max_position_embeddings=model.max_seq_len,
        rms_norm_eps=model.norm_eps, tie_word_embeddings=model.tie_embeddings,
        rope_parameters=_rope_parameters(model),
        dtype=model.dtype)
    if arch.attention_bias_field:
        out["attention_bias"] = False
    if arch.model_type == "llama":
        out["mlp_bias"] = False
    if arch.sliding == "use_sliding_window":
        out.setdefault("use_sliding_window", False)
    if arch.moe == "mixtral":
        out.update(intermediate_size=model.moe_ffn_hidden_size,
                   num_local_experts=model.num_experts,
                   num_experts_per_tok=model.experts_top_k)
    elif arch.moe == "qwen3_moe":
        out.pop("num_local_experts", None)
        out.update(num_experts=model.num_experts, num_experts_per_tok=model.experts_top_k,
                   moe_intermediate_size=model.moe_ffn_hidden_size,
                   norm_topk_prob=model.moe_norm_topk, decoder_sparse_step=1,
                   mlp_only_layers=[])
    problems = _mismatch(model, out)
    if problems:
        raise ModelSpecError(f"model {model.name!r} cannot be written as {arch.architecture}: "
                             + "; ".join(problems))
    return out


def _rope_parameters(model: ModelSpec) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` for the model's RoPE, every derived value explicit."""
    out: dict[str, Any] = {"rope_theta": float(model.rope_theta), "rope_type": "default"}
    s = model.rope_scaling
    if s is None:
        return out
    out.update(rope_type=s.type, factor=float(s.factor))
    if s.type == "llama3":
        out.update(low_freq_factor=float(s.low_freq_factor),
                   high_freq_factor=float(s.high_freq_factor),
                   original_max_position_embeddings=s.original_max_seq_len)
    elif s.type == "yarn":
        out.update(original_max_position_embeddings=s.original_max_seq_len,
                   attention_factor=float(s.attention_factor), beta_fast=float(s.beta_fast),
                   beta_slow=float(s.beta_slow), truncate=s.truncate)
    return out


def _mismatch(model: ModelSpec, config: dict) -> list[str]:
    """Differences between ``model`` and what ``config`` reads back as (dtype aside)."""
    try:
        back = model_from_hf_config(config, name=model.name)
    except ModelSpecError as e:
        return [str(e)]
    return [f"{k}={getattr(model, k)!r} would read back as {getattr(back, k)!r}"
            for k in model.to_dict() if k not in ("name", "dtype")
            and getattr(model, k) != getattr(back, k)]

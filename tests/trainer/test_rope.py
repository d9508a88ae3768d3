"""Scaled RoPE (``linear``, ``dynamic``, ``yarn``, ``llama3``), with transformers as the reference.

What is shown:

- the cos/sin tables the trainer computes from a config.json equal those of transformers' own
  rotary embedding for every scaling, over the three frequency bands of ``llama3``, YaRN's
  ``mscale``/``mscale_all_dim``/``truncate`` and dynamic NTK both within and beyond
  ``max_position_embeddings`` (recomputed per forward length, as transformers does);
- ``dynatrain eval`` of tiny random Llama-3.1-style (llama3 RoPE, config.json in the
  transformers-4 form of the published files), Llama-3.2-style (llama3 RoPE, tied embeddings),
  Qwen2.5-style (qkv biases, tied embeddings, the YaRN ``rope_scaling`` Qwen documents) and
  linear/dynamic Llama checkpoints equals transformers' loss within 1e-5 relative in float32,
  under dp=1 and tp=2,pp=2; and the scaling matters: plain RoPE on the same weights is far off;
- export writes ``rope_parameters`` that transformers turns into the same frequencies.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from dynatrain.cli.app import main  # noqa: E402
from dynatrain.trainer.model import rope_tables  # noqa: E402
from dynatrain.vps.hf import hf_config, model_from_hf_config  # noqa: E402
from dynatrain.vps.model import ModelSpecError, RopeScaling, model_from_dict  # noqa: E402
from test_eval import save_random_model  # noqa: E402

SEQ_LEN, SEQUENCES, REL = 64, 4, 1e-5
# head_dim 16, theta 1e4: wavelengths 2*pi*1e4**(i/8) = 6.3, 20, 63, 199, ... so with an
# original context of 64, llama3 (low 1, high 4) keeps the first, blends the next two and slows
# the rest; YaRN (beta 32/1) ramps over dims 2..5.
SHAPES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.15)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 64}


def _rotary(config):
    """transformers' rotary embedding of a config, as its models build it."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    return LlamaRotaryEmbedding(config)


def _hf_tables(config, seq_len: int):
    x = torch.zeros(1, seq_len, 1)
    cos, sin = _rotary(config)(x, torch.arange(seq_len)[None])
    return cos[0], sin[0]


TABLE_CASES = {
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0},
    "llama3": LLAMA3,
    "yarn": YARN,
    "yarn-mscale": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0,
                    "beta_slow": 2.0},
    "yarn-untruncated": {**YARN, "truncate": False, "attention_factor": 1.25},
    "yarn-factor-from-lengths": {"rope_type": "yarn", "rope_theta": 5e5, "factor": None,
                                 "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("name", TABLE_CASES)
@pytest.mark.parametrize("seq_len", [48, 400])        # within, and beyond, max_position (256)
def test_tables_equal_transformers(name, seq_len):
    params = dict(TABLE_CASES[name])        # factor None: the lengths decide (yarn)
    config = transformers.LlamaConfig(vocab_size=32, intermediate_size=32, **SHAPES,
                                      rope_parameters=params)
    spec = model_from_hf_config(config.to_dict())
    assert spec.rope_scaling.type == params["rope_type"]
    want_cos, want_sin = _hf_tables(config, seq_len)
    cos, sin = rope_tables(spec, seq_len, "cpu", torch.float32)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=2e-6)
    # ... and the scaling is not a no-op (dynamic only acts beyond max_position_embeddings).
    plain, _ = rope_tables(spec.__class__(**{**spec.to_dict(), "rope_scaling": None}),
                           seq_len, "cpu", torch.float32)
    acts = name != "dynamic" or seq_len > SHAPES["max_position_embeddings"]
    assert (plain - cos).abs().max().item() > 1e-3 if acts else torch.equal(plain, cos)


@pytest.mark.parametrize("name", ["llama3", "yarn-mscale", "dynamic", "linear"])
def test_export_gives_transformers_the_same_frequencies(name):
    params = dict(TABLE_CASES[name])
    original = transformers.LlamaConfig(vocab_size=32, intermediate_size=32, **SHAPES,
                                        rope_parameters=params)
    spec = model_from_hf_config(original.to_dict())
    exported = hf_config(spec)
    assert model_from_hf_config(exported) == spec
    again = transformers.LlamaConfig(**{k: v for k, v in exported.items()
                                        if k not in ("architectures", "model_type")})
    a, b = _rotary(original), _rotary(again)
    assert torch.equal(a.inv_freq, b.inv_freq) and a.attention_scaling == b.attention_scaling


def test_export_of_a_transformers4_config_reads_back_the_same():
    config = transformers.LlamaConfig(vocab_size=32, intermediate_size=32, **SHAPES,
                                      rope_parameters=dict(LLAMA3)).to_dict()
    legacy = _as_transformers4(config)
    spec = model_from_hf_config(legacy)
    out = hf_config(spec, base=legacy)
    assert "rope_scaling" not in out and "rope_theta" not in out
    assert out["rope_parameters"] == LLAMA3 and model_from_hf_config(out) == spec


SPEC = dict(arch="llama", vocab_size=32, hidden_size=64, num_layers=1, num_heads=4,
            ffn_hidden_size=32)


def test_model_spec_takes_rope_scaling_as_a_mapping_and_derives_yarn_attention():
    spec = model_from_dict({**SPEC, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                     "original_max_seq_len": 64}})
    assert spec.rope_scaling == RopeScaling(type="yarn", factor=4.0, original_max_seq_len=64,
                                            attention_factor=0.1 * math.log(4.0) + 1)
    assert model_from_dict(spec.to_dict()) == spec          # as checkpoints record it


@pytest.mark.parametrize("scaling, fragment", [
    ({"type": "longrope", "factor": 2.0}, "rope_scaling.type='longrope' is not one of"),
    ({"type": "linear", "factor": 0.5}, "factor=0.5 must be a number >= 1"),
    ({"type": "llama3", "factor": 8.0, "original_max_seq_len": 64},
     "low_freq_factor=0.0 and high_freq_factor=0.0 must be"),
    ({"type": "yarn", "factor": 4.0}, "original_max_seq_len=0 must be a positive integer"),
    ({"type": "linear", "factor": 2.0, "beta_fast": 8.0}, "settings of type='yarn' only"),
    ({"type": "linear", "factor": 2.0, "scale": 2}, "unexpected keyword argument 'scale'"),
    ("yarn", "must be a mapping or null"),
])
def test_bad_rope_scaling_is_named(scaling, fragment):
    with pytest.raises(ModelSpecError, match=re.escape(fragment)):
        model_from_dict({**SPEC, "rope_scaling": scaling})


def test_rope_scaling_is_refused_for_gpt():
    with pytest.raises(ModelSpecError, match="rope_scaling is a setting of arch='llama' only"):
        model_from_dict({**SPEC, "arch": "gpt", "rope_scaling": {"type": "linear",
                                                                 "factor": 2.0}})


# -- dynatrain eval against transformers' loss ------------------------------------------------

def _llama(rope, **kw):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1001, intermediate_size=96, rms_norm_eps=1e-6, rope_parameters=rope,
        **SHAPES, **kw))


def _as_transformers4(config: dict) -> dict:
    """The config.json layout of the published Llama 3.1 / Qwen2.5 files: a top-level
    rope_theta and a ``rope_scaling`` mapping (Qwen's with the legacy ``type`` key)."""
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    if rope["rope_type"] == "yarn":
        rope["type"] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    return config


MODELS = {
    # name: (make the transformers model, rewrite its saved config.json or None)
    "llama3.1": (lambda: _llama(LLAMA3, tie_word_embeddings=False), _as_transformers4),
    "llama3.2": (lambda: _llama(LLAMA3, tie_word_embeddings=True), None),
    "qwen2.5": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=1000, intermediate_size=96, tie_word_embeddings=True, use_sliding_window=False,
        sliding_window=256, max_window_layers=1, rms_norm_eps=1e-6,
        rope_parameters={**YARN, "rope_theta": 1e6}, **SHAPES)), _as_transformers4),
    "linear": (lambda: _llama({"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}), None),
    "dynamic": (lambda: _llama({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}), None),
}


def _loss(model, windows: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, token file, transformers' loss, its loss with plain RoPE)."""
    out = {}
    for seed, (name, (make, rewrite)) in enumerate(MODELS.items()):
        root = tmp_path_factory.mktemp(name)
        model = save_random_model(make, seed, root)
        if rewrite:
            path = root / "ckpt" / "config.json"
            path.write_text(json.dumps(rewrite(json.loads(path.read_text()))))
        vocab = model.config.vocab_size
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, vocab, SEQUENCES * SEQ_LEN + 1).astype(np.uint16)
        tokens.tofile(root / "tokens.bin")
        windows = torch.from_numpy(np.stack(
            [tokens[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1] for i in range(SEQUENCES)])).long()
        want = _loss(model, windows)
        assert abs(want - math.log(vocab)) > 0.05, (name, want)
        # The same weights under plain RoPE: how far off ignoring the scaling would be.
        model.config.rope_parameters = {"rope_type": "default",
                                        "rope_theta": model.config.rope_parameters["rope_theta"]}
        model.model.rotary_emb = _rotary(model.config)
        out[name] = (root / "ckpt", root / "tokens.bin", want, _loss(model, windows))
    return out


def _eval(capsys, ckpt, data, layout: str) -> float:
    rc = main(["eval", "--model", f"hf:{ckpt}", "--layout", layout, "--data", str(data),
               "--seq-len", str(SEQ_LEN), "--sequences", str(SEQUENCES), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)["loss"]


CASES = [(name, "dp=1") for name in MODELS] + [("llama3.1", "tp=2,pp=2"),
                                                ("qwen2.5", "tp=2,pp=2")]


@pytest.mark.parametrize("name, layout", CASES)
def test_eval_matches_transformers(checkpoints, capsys, name, layout):
    ckpt, data, want, plain = checkpoints[name]
    got = _eval(capsys, ckpt, data, layout)
    rel = abs(got - want) / want
    print(f"{name} {layout}: eval {got!r} transformers {want!r} rel {rel:.2e} "
          f"(plain RoPE: rel {abs(plain - want) / want:.2e})")
    assert rel <= REL, (got, want)
    if name != "dynamic":      # dynamic is plain RoPE up to max_position_embeddings
        assert abs(plain - want) / want > 100 * REL, (name, plain, want)

import json

import pytest

from dynatrain.vps.model import ModelSpecError
from dynatrain.vps.presets import load_model
from dynatrain.vps.presets import PRESETS

PUBLISHED = {  # parameter counts of the published models
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "llama-70b": 68_976_648_192,
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-235b-a22b": 235_090_000_000,
    "gpt-125m": 124_439_808,
    "gpt-350m": 354_823_168,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published_models(name):
    assert abs(PRESETS[name].num_params - PUBLISHED[name]) <= 0.005 * PUBLISHED[name]


def test_exact_counts_where_the_shapes_are_unpadded():
    assert PRESETS["llama-7b"].num_params == 6_738_415_616
    assert PRESETS["llama-70b"].num_params == 68_976_648_192
    assert PRESETS["mixtral-8x7b"].num_params == 46_702_792_704


def test_tiny_presets_are_small_and_moe_tiny_is_top2():
    for name in ("gpt-tiny", "moe-tiny"):
        assert 1_000_000 < PRESETS[name].num_params < 10_000_000
    moe = PRESETS["moe-tiny"]
    assert 4 <= moe.num_experts <= 8 and moe.experts_top_k == 2


def test_tensor_names_are_unique():
    for m in PRESETS.values():
        names = [t.name for t in m.tensors]
        assert len(names) == len(set(names)), m.name


def test_gqa_shapes_of_llama_70b():
    t = {t.name: t for t in PRESETS["llama-70b"].tensors}
    assert t["layers.0.attn.q.weight"].shape == (8192, 8192)
    assert t["layers.0.attn.k.weight"].shape == (1024, 8192)


def test_spec_from_yaml_and_json(tmp_path):
    spec = {"arch": "llama", "vocab_size": 64, "hidden_size": 32, "num_layers": 2,
            "num_heads": 4, "ffn_hidden_size": 64}
    (tmp_path / "m.json").write_text(json.dumps(spec))
    (tmp_path / "m.yaml").write_text("\n".join(f"{k}: {v}" for k, v in spec.items()))
    a = load_model(str(tmp_path / "m.json"))
    b = load_model(str(tmp_path / "m.yaml"))
    assert a.num_params == b.num_params == 64 * 32 * 2 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 64) + 32


@pytest.mark.parametrize("text, fragment", [
    ("arch: llama\nvocab_size: 64\nhidden_size: 32\nnum_layers: 2\nnum_heads: 4\n"
     "ffn_hidden_size: 64\nwidth: 3\n", "unknown field(s) width"),
    ("arch: llama\nvocab_size: 64\n", "missing required field(s) hidden_size"),
    ("arch: rnn\nvocab_size: 64\nhidden_size: 32\nnum_layers: 2\nnum_heads: 4\n"
     "ffn_hidden_size: 64\n", "arch='rnn' is not one of gpt, llama"),
    ("arch: llama\nvocab_size: 64\nhidden_size: 32\nnum_layers: 0\nnum_heads: 4\n"
     "ffn_hidden_size: 64\n", "num_layers=0 must be a positive integer"),
    ("arch: llama\nvocab_size: 64\nhidden_size: 32\nnum_layers: 2\nnum_heads: 4\n"
     "num_kv_heads: 3\nffn_hidden_size: 64\n", "num_heads=4 is not a multiple of num_kv_heads=3"),
    ("[1, 2", "could not be parsed"),
])
def test_bad_spec_files_are_named(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ModelSpecError, match=None) as e:
        load_model(str(path))
    assert fragment in str(e.value)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ModelSpecError) as e:
        load_model("gpt-9000")
    assert "gpt-9000" in str(e.value) and "qwen3-235b-a22b" in str(e.value)

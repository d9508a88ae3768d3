"""Hugging Face weights in and out, with ``transformers`` itself as the reference.

Tiny random models are built by transformers from a config (nothing is downloaded), every
parameter (norms included) drawn at random so that any mix-up of names, halves of a fused
tensor or experts shows. Odd sizes throughout: GQA, a head_dim that is not hidden/heads (Qwen3),
a vocabulary of 1001 rows that tp=2 splits unevenly. What is shown:

- config.json -> ModelSpec for Llama, Qwen2, Qwen3, Mixtral and Qwen3-MoE, with the parameter
  count transformers has, and back (``hf_config``) to a config that reads as the same spec;
- every box of every tensor reads as the files' values, through split and fused names alike;
- a rank reads its own pieces and nothing more (bytes counted, no whole sharded tensor);
- import then export (``train --steps 0 --save-hf`` under tp=2,pp=2 and dp=2,tp=2,ep=2,zero=1;
  ``export-hf`` of a checkpoint) reproduces every tensor bit for bit, and transformers loads
  the output unchanged;
- unsupported architectures and settings are refused with the field named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from dynatrain.cli.app import main  # noqa: E402
from dynatrain.trainer.checkpoint import save_checkpoint, save_state  # noqa: E402
from dynatrain.trainer.config import make_config  # noqa: E402
from dynatrain.trainer.groups import ParallelGroups  # noqa: E402
from dynatrain.trainer.hf import HFReader, read_local  # noqa: E402
from dynatrain.trainer.hf_export import ExportError, export_hf, parse_size  # noqa: E402
from dynatrain.trainer.trainer import Trainer  # noqa: E402
from dynatrain.vps.boxes import box_numel, full_box  # noqa: E402
from dynatrain.vps.hf import (HFCheckpointError, arch_for, hf_config, model_from_hf,  # noqa: E402
                              model_from_hf_config, read_hf_config)
from dynatrain.vps.layout import bind, parse_layout  # noqa: E402
from dynatrain.vps.mapping import rank_shards  # noqa: E402
from dynatrain.vps.model import ModelSpecError  # noqa: E402
from dynatrain.vps.presets import PRESETS  # noqa: E402

SHAPES = dict(vocab_size=1001, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SHAPES, intermediate_size=80,
                                              rope_parameters={"rope_type": "default",
                                                               "rope_theta": 5e5},
                                              rms_norm_eps=1e-5),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPES, intermediate_size=80),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPES, intermediate_size=80, head_dim=16,
                                              tie_word_embeddings=True),
    "mixtral": lambda: transformers.MixtralConfig(**SHAPES, intermediate_size=40,
                                                  num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SHAPES, intermediate_size=80,
                                                     moe_intermediate_size=24, head_dim=16,
                                                     num_experts=4, num_experts_per_tok=2),
}
DTYPES = {"mixtral": torch.bfloat16, "qwen3_moe": torch.bfloat16}   # the rest float32


def _build(name: str, directory: Path, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model = model.to(DTYPES.get(name, torch.float32))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """name -> (directory, transformers model) of every tiny model."""
    root = tmp_path_factory.mktemp("hf")
    return {name: (root / name, _build(name, root / name)) for name in CONFIGS}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same_files(a: Path, b: Path) -> None:
    """The same tensor names, dtypes, shapes and bytes (bit for bit: -0.0 is not 0.0)."""
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and ta[name].shape == tb[name].shape, name
        assert torch.equal(_bits(ta[name]), _bits(tb[name])), name


def _assert_loads_unchanged(out: Path, original) -> None:
    """transformers loads ``out`` as the original model: same class, every tensor equal,
    same logits."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is type(original)
    want, got = original.state_dict(), loaded.state_dict()
    assert sorted(want) == sorted(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    if original.dtype == torch.float32:
        # (In bfloat16 transformers' own save_pretrained/from_pretrained round trip already
        # changes MoE logits by a rounding step; equal tensors are the check there.)
        ids = torch.randint(0, SHAPES["vocab_size"], (1, 12),
                            generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(original.eval()(ids).logits, loaded(ids).logits)


# -- config.json ------------------------------------------------------------------------------

def test_configs_import_with_transformers_parameter_counts(hf):
    want = {
        "llama": dict(qkv_bias=False, qk_norm=False, tie_embeddings=False, head_dim=8,
                      rope_theta=5e5, norm_eps=1e-5, num_experts=0, dtype="float32"),
        "qwen2": dict(qkv_bias=True, qk_norm=False, tie_embeddings=False, head_dim=8,
                      rope_theta=10000.0, norm_eps=1e-6),
        "qwen3": dict(qkv_bias=False, qk_norm=True, tie_embeddings=True, head_dim=16),
        "mixtral": dict(num_experts=4, experts_top_k=2, moe_ffn_hidden_size=40,
                        moe_norm_topk=True, rope_theta=1e6, dtype="bfloat16"),
        "qwen3_moe": dict(num_experts=4, experts_top_k=2, moe_ffn_hidden_size=24,
                          moe_norm_topk=False, qk_norm=True, head_dim=16, dtype="bfloat16"),
    }
    for name, (directory, model) in hf.items():
        spec = model_from_hf(directory)
        assert spec.num_kv_heads == 2 and spec.vocab_size == 1001 and spec.max_seq_len == 64
        for field, value in want[name].items():
            assert getattr(spec, field) == value, (name, field)
        assert spec.num_params == sum(p.numel() for p in model.parameters()), name
        # back to a config.json, with and without the original as the base
        base = read_hf_config(directory)
        assert model_from_hf_config(hf_config(spec, base), name=spec.name) == spec
        scratch = hf_config(spec)
        assert scratch["architectures"] == base["architectures"]
        assert model_from_hf_config(scratch, name=spec.name) == spec


def test_float16_checkpoints_train_as_bfloat16(hf):
    config = {**read_hf_config(hf["llama"][0]), "dtype": "float16"}
    assert model_from_hf_config(config).dtype == "bfloat16"
    legacy = {**read_hf_config(hf["llama"][0]), "torch_dtype": "bfloat16"}
    legacy.pop("dtype")
    legacy.pop("rope_parameters")
    legacy["rope_theta"] = 2e4                                       # transformers 4 style
    spec = model_from_hf_config(legacy)
    assert spec.dtype == "bfloat16" and spec.rope_theta == 2e4


REFUSED = [
    ("llama", {"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "low_freq_factor"),
    ("llama", {"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type"),
    ("llama", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
     "rope_parameters.rope_type"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama", {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
     "nested by layer type"),
    ("llama", {"rope_scaling": {"type": "yarn", "factor": 4.0, "attention_factor": 0}},
     "attention_factor"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"dtype": "float64"}, "dtype"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("mixtral", {"sliding_window": 16}, "sliding_window"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
]


@pytest.mark.parametrize("name,change,field", REFUSED,
                         ids=[f"{n}-{f}" for n, _, f in REFUSED])
def test_unsupported_settings_are_refused_by_name(hf, name, change, field):
    config = {**read_hf_config(hf[name][0]), **change}
    with pytest.raises(ModelSpecError, match=field):
        model_from_hf_config(config)


def test_harmless_settings_are_accepted(hf):
    # A window no shorter than any sequence never masks: full attention.
    mixtral = {**read_hf_config(hf["mixtral"][0]), "sliding_window": 64}
    assert model_from_hf_config(mixtral).num_experts == 4
    qwen2 = {**read_hf_config(hf["qwen2"][0]), "sliding_window": 4096}  # use_sliding_window off
    assert model_from_hf_config(qwen2).qkv_bias


def test_missing_directory_config_or_weights_are_named(tmp_path, hf, capsys):
    with pytest.raises(ModelSpecError, match="does not exist"):
        model_from_hf(tmp_path / "nowhere")
    with pytest.raises(ModelSpecError, match="no config.json"):
        model_from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(read_hf_config(hf["llama"][0])))
    with pytest.raises(HFCheckpointError, match="neither model.safetensors nor"):
        HFReader(tmp_path)
    bad = {**read_hf_config(hf["llama"][0]), "hidden_act": "relu"}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    # the command line: one line naming the field, exit code 2, before any process starts
    assert main(["train", "--model", f"hf:{tmp_path}", "--layout", "dp=1", "--steps", "1"]) == 2
    assert "hidden_act='relu'" in capsys.readouterr().err
    with pytest.raises(ModelSpecError, match="arch='gpt'"):
        arch_for(PRESETS["gpt-tiny"])


# -- reading boxes ----------------------------------------------------------------------------

def _expected(reader: HFReader, files: dict, tensor) -> torch.Tensor:
    """The VPS tensor assembled straight from the HF tensors, by the split names."""
    src = reader.source(tensor)
    parts = [files[n] for n in src.names]
    full = torch.stack(parts) if src.per_expert else parts[0]
    if src.fused:
        full = full.narrow(src.dim, src.offset, src.extent)
    return full


def _boxes(shape, rng):
    """The whole tensor, and a few random sub-boxes."""
    yield full_box(shape)
    for _ in range(3):
        box = []
        for n in shape:
            a = int(torch.randint(0, n, (1,), generator=rng))
            b = int(torch.randint(a + 1, n + 1, (1,), generator=rng))
            box.append((a, b))
        yield tuple(box)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_box_reads_the_files_values(hf, name):
    directory, _ = hf[name]
    files = _tensors(directory)
    rng = torch.Generator().manual_seed(0)
    with HFReader(directory) as reader:
        for t in reader.model.tensors:
            full = _expected(reader, files, t)
            for box in _boxes(t.shape, rng):
                got = reader.read_box(t, box)
                assert torch.equal(got, full[tuple(slice(a, b) for a, b in box)]), (t.name, box)
            assert reader.read_box(t, full_box(t.shape), torch.float32).dtype == torch.float32


def _fuse_llama(files: dict, spec) -> dict:
    """The Llama checkpoint with fused ``qkv_proj`` and ``gate_up_proj`` (q, k, v rows; gate,
    then up rows), as some checkpoints hold them."""
    out = dict(files)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [out.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [out.pop(p + "mlp.gate_proj.weight"), out.pop(p + "mlp.up_proj.weight")])
    return out


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen3_moe"])
def test_fused_checkpoints_read_as_the_split_ones(hf, tmp_path, name):
    """Llama with qkv_proj/gate_up_proj; the MoE models as transformers holds them in memory
    (router at mlp.gate, stacked mlp.experts.gate_up_proj / down_proj)."""
    directory, model = hf[name]
    split = HFReader(directory)
    if name == "llama":
        fused = _fuse_llama(_tensors(directory), split.model)
    else:
        fused = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    reader = HFReader(tmp_path)
    rng = torch.Generator().manual_seed(1)
    halves = (("attn.q.", "attn.k.", "attn.v.", "mlp.gate.", "mlp.up.") if name == "llama"
              else ("experts.gate", "experts.up"))
    for t in split.model.tensors:
        if any(h in t.name for h in halves):            # read as a slab of a fused tensor
            assert reader.source(t).fused and not split.source(t).fused, t.name
        for box in _boxes(t.shape, rng):
            assert torch.equal(reader.read_box(t, box), split.read_box(t, box)), (t.name, box)


def test_missing_tensor_and_wrong_shape_name_the_hf_tensor_and_file(hf, tmp_path):
    directory, _ = hf["llama"]
    files = _tensors(directory)
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    spec = model_from_hf(directory)
    k = next(t for t in spec.tensors if t.name == "layers.1.attn.k.weight")
    files.pop("model.layers.1.self_attn.k_proj.weight")
    files["model.layers.0.mlp.down_proj.weight"] = torch.zeros(48, 81)
    save_file(files, str(tmp_path / "model.safetensors"))
    reader = HFReader(tmp_path)
    with pytest.raises(HFCheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight "
                       r"or model\.layers\.1\.self_attn\.qkv_proj\.weight in model\.safetensors"):
        reader.read_box(k, full_box(k.shape))
    down = next(t for t in spec.tensors if t.name == "layers.0.mlp.down.weight")
    with pytest.raises(HFCheckpointError, match=r"down_proj\.weight in .*model\.safetensors has "
                       r"shape \(48, 81\).*needs \(48, 80\)"):
        reader.read_box(down, full_box(down.shape))


@pytest.mark.parametrize("name,layout", [("llama", "tp=2,pp=2"), ("qwen3", "dp=2,tp=2,zero=1"),
                                         ("mixtral", "dp=2,tp=2,ep=2,zero=1")])
def test_each_rank_reads_only_its_pieces(hf, name, layout):
    """What the trainer does per rank at start-up (read_local for param and master): the bytes
    read are exactly those of the rank's pieces, no rank reads a TP/EP-sharded tensor whole,
    and what lands in the local tensor is the files' values."""
    directory, _ = hf[name]
    spec = model_from_hf(directory)
    bound = bind(parse_layout(layout), spec)
    files = _tensors(directory)
    model_bytes = sum(v.numel() * v.element_size() for v in files.values())
    for rank in range(bound.world):
        reader = HFReader(directory)
        expected_bytes = 0
        for rs in rank_shards(bound, rank):
            if rs.state not in ("param", "master"):
                continue
            before = reader.bytes_read
            local = read_local(reader, rs, torch.float32)
            itemsize = 2 if spec.dtype == "bfloat16" else 4
            piece_bytes = sum(box_numel(p.box) for p in rs.pieces) * itemsize
            assert reader.bytes_read - before == piece_bytes, (rank, rs.tensor.name, rs.state)
            expected_bytes += piece_bytes
            full = _expected(reader, files, rs.tensor).float()
            for p in rs.pieces:
                got = local[tuple(slice(a, b) for a, b in p.local)]
                want = full[tuple(slice(a, b) for a, b in p.box)]
                assert torch.equal(got.reshape(want.shape), want)
            if rs.tensor.tp_dim is not None or rs.tensor.expert_dim is not None:
                assert sum(box_numel(p.box) for p in rs.pieces) < rs.tensor.numel
        assert reader.bytes_read == expected_bytes
        assert reader.bytes_read < model_bytes, (rank, reader.bytes_read, model_bytes)


# -- import, then export ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name,layout", [("llama", "tp=2,pp=2"), ("qwen3", "tp=2,pp=2"),
                                         ("mixtral", "dp=2,tp=2,ep=2,zero=1")])
def test_save_hf_after_zero_steps_is_bit_exact(hf, tmp_path, capsys, name, layout):
    directory, model = hf[name]
    out = tmp_path / "out"
    args = ["train", "--model", f"hf:{directory}", "--layout", layout, "--steps", "0",
            "--global-batch-size", "2", "--seq-len", "8", "--save-hf", str(out)]
    if name == "llama":
        args += ["--max-shard-size", "200KB"]
    assert main(args) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed
    _assert_same_files(directory, out)
    if name == "llama":
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) == 3
        assert all(f.stat().st_size < 250_000 for f in out.glob("*.safetensors"))
        assert "copied generation_config.json" in printed
    else:
        assert [f.name for f in out.glob("*.safetensors")] == ["model.safetensors"]
    assert model_from_hf(out) == model_from_hf(directory).__class__(
        **{**model_from_hf(directory).to_dict(), "name": "out"})
    assert read_hf_config(out)["eos_token_id"] == read_hf_config(directory)["eos_token_id"]
    assert not list(tmp_path.glob(".*"))                 # the DCP checkpoint is gone
    _assert_loads_unchanged(out, model)


def _single_rank_trainer(directory):
    cfg = make_config(f"hf:{directory}", "dp=1", global_batch_size=1, seq_len=8)
    return cfg, Trainer(cfg, ParallelGroups(rank=0, pp_index=0, dp_index=0, tp_index=0))


@pytest.mark.parametrize("name", ["qwen2", "qwen3_moe"])
def test_export_of_a_checkpoint_that_records_its_model(hf, tmp_path, capsys, name):
    directory, model = hf[name]
    cfg, trainer = _single_rank_trainer(directory)
    root = tmp_path / "ckpt"
    saved = save_checkpoint(trainer.local_state(), cfg.model, root, hf_source=str(directory))
    assert json.loads((Path(saved.path) / "model.json").read_text())["hf_config"] == \
        read_hf_config(directory)
    out = tmp_path / "out"
    assert main(["export-hf", str(root), str(out)]) == 0, capsys.readouterr().err
    assert "model.safetensors: " in capsys.readouterr().out
    _assert_same_files(directory, out)
    _assert_loads_unchanged(out, model)
    # From the spec alone (no Hugging Face config to start from): a config written from scratch
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(cfg.model.to_dict()))
    plain = tmp_path / "plain"
    assert main(["export-hf", saved.path, str(plain), "--model", str(spec_file), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(plain)
    _assert_same_files(directory, plain)
    _assert_loads_unchanged(plain, model)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_refuses_what_it_cannot_write(hf, tmp_path, capsys):
    directory, _ = hf["qwen2"]
    cfg, trainer = _single_rank_trainer(directory)
    bare = tmp_path / "bare"
    save_state(trainer.local_state(), cfg.model, str(bare))          # no model record
    with pytest.raises(ExportError, match="does not record its model"):
        export_hf(bare, tmp_path / "o1")
    with pytest.raises(ExportError, match=r"does not hold model 'qwen3': layers.0.attn.q.weight "
                       r"is \(48, 48\), the model says \(96, 48\)"):
        export_hf(bare, tmp_path / "o2", model=model_from_hf(hf["qwen3"][0]))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ExportError, match="not an empty directory"):
        export_hf(bare, tmp_path / "full", model=cfg.model)
    assert main(["export-hf", str(tmp_path / "nothing"), str(tmp_path / "o3")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--model", "gpt-tiny", "--layout", "dp=1", "--steps", "0"]) == 2
    assert "0 only with --save-hf" in capsys.readouterr().err
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1GiB") == 2**30
    with pytest.raises(ExportError, match="size"):
        parse_size("two gigs")

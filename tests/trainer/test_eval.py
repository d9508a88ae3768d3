"""`dynatrain eval`: the parallel model's loss equals transformers' on the same windows.

Tiny random Llama (GQA, a vocabulary of 1001 that no TP degree divides, untied head), Qwen3
(q/k norms, an explicit head_dim, tied embeddings) and Mixtral (4 experts, top-2) models are
made here with transformers itself, saved as float32 checkpoints, and evaluated by the command
under several layouts, one process per rank. The reference is transformers' own forward and
torch's cross-entropy, nothing from this project. Their weights are drawn wider than
transformers' default (std 0.02 leaves the logits nearly uniform, and every model's loss near
ln(vocab) whatever it computes), and the norms are perturbed from one, so the comparison sees
every tensor.
"""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dynatrain.cli.app import main
from dynatrain.trainer.evaluate import dp_share

SEQ_LEN, SEQUENCES = 16, 8
REL = 1e-5


def _tokens(path, vocab: int, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, count).astype(np.uint16)
    tokens[count // 2] = vocab - 1            # the last vocabulary row is read too
    tokens.tofile(path)
    return tokens


def eval_cli(capsys, model: str, layout: str, data, *extra) -> float:
    rc = main(["eval", "--model", model, "--layout", layout, "--data", str(data),
               "--seq-len", str(SEQ_LEN), "--sequences", str(SEQUENCES), "--json", *extra])
    out = capsys.readouterr()
    assert rc == 0, out.err
    result = json.loads(out.out)
    assert result["sequences"] == SEQUENCES
    return result["loss"]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# -- pure ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, dp", [(8, 1), (8, 3), (2, 4), (13, 4)])
def test_dp_shares_are_contiguous_and_cover_every_sample_once(n, dp):
    shares = [dp_share(n, dp, j) for j in range(dp)]
    assert [i for s in shares for i in s] == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


# -- transformers as the reference -------------------------------------------------------------

def _hf_models():
    from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.15)
    return {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(
            vocab_size=1001, intermediate_size=96, tie_word_embeddings=False, rms_norm_eps=1e-6,
            **common)),
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(
            vocab_size=1000, intermediate_size=96, head_dim=24, tie_word_embeddings=True,
            rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, **common)),
        "mixtral": lambda: MixtralForCausalLM(MixtralConfig(
            vocab_size=998, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=None, **common)),
    }


def save_random_model(make, seed: int, root):
    """A tiny random transformers model (``make()``), its norms away from 1 so that they
    matter, saved to ``root/ckpt`` in fp32; returns the model."""
    torch.manual_seed(seed)
    model = make().float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(root / "ckpt")
    return model


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, token file, transformers' mean loss over the windows)."""
    out = {}
    for seed, (name, make) in enumerate(_hf_models().items()):
        root = tmp_path_factory.mktemp(name)
        model = save_random_model(make, seed, root)
        vocab = model.config.vocab_size
        tokens = _tokens(root / "tokens.bin", vocab, SEQUENCES * SEQ_LEN + 1 + 7, seed)
        windows = torch.from_numpy(np.stack(
            [tokens[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1] for i in range(SEQUENCES)])).long()
        with torch.no_grad():
            logits = model(input_ids=windows[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, vocab), windows[:, 1:].reshape(-1)).item()
        # The models compute something: their loss is far from a uniform guess's.
        assert abs(loss - math.log(vocab)) > 0.05, (name, loss)
        out[name] = (root / "ckpt", root / "tokens.bin", loss)
    return out


HF_CASES = [
    ("llama", "dp=1"), ("qwen3", "dp=1"), ("mixtral", "dp=1"),
    pytest.param("llama", "tp=2,pp=2", marks=pytest.mark.slow),
    pytest.param("qwen3", "tp=2,pp=2", marks=pytest.mark.slow),
    pytest.param("mixtral", "tp=2,pp=2", marks=pytest.mark.slow),
    pytest.param("mixtral", "dp=2,ep=2", marks=pytest.mark.slow),
    # EP ranks are carved out of DP, so expert parallelism with TP needs dp >= ep.
    pytest.param("mixtral", "dp=2,tp=2,ep=2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name, layout", HF_CASES)
def test_eval_matches_transformers(hf_checkpoints, capsys, name, layout):
    ckpt, data, want = hf_checkpoints[name]
    got = eval_cli(capsys, f"hf:{ckpt}", layout, data)
    print(f"{name} {layout}: eval {got!r} transformers {want!r} rel {_rel(got, want):.2e}")
    assert _rel(got, want) <= REL, (got, want)


# -- presets: layout independence and errors --------------------------------------------------

@pytest.fixture(scope="module")
def preset_tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("preset") / "tokens.bin"
    _tokens(path, 2048, SEQUENCES * SEQ_LEN + 1, seed=7)     # exactly SEQUENCES windows
    return path


@pytest.mark.slow
def test_preset_loss_is_the_same_under_every_layout(preset_tokens, capsys):
    base = eval_cli(capsys, "gpt-tiny", "dp=1", preset_tokens)
    for layout, extra in [("tp=2", ()), ("pp=2", ()),
                          # 8 sequences over 3 DP ranks (3+3+2) in micro-batches of 2: the
                          # last rank pads its second micro-batch and does not count the pad.
                          ("dp=3", ("--micro-batch-size", "2"))]:
        got = eval_cli(capsys, "gpt-tiny", layout, preset_tokens, *extra)
        assert _rel(got, base) <= REL, (layout, got, base)


@pytest.mark.slow
def test_uneven_dp_shares_under_expert_parallelism(preset_tokens, capsys):
    # 7 sequences on dp=2,ep=2: rank 1 runs a padded micro-batch so that it still takes part
    # in every expert all-to-all of rank 0's four.
    args = ["--sequences", "7"]
    base = main(["eval", "--model", "moe-tiny", "--data", str(preset_tokens), "--seq-len",
                 str(SEQ_LEN), "--json", *args])
    want = json.loads(capsys.readouterr().out)
    assert base == 0 and want["sequences"] == 7
    rc = main(["eval", "--model", "moe-tiny", "--layout", "dp=2,ep=2", "--data",
               str(preset_tokens), "--seq-len", str(SEQ_LEN), "--json", *args])
    got = json.loads(capsys.readouterr().out)
    assert rc == 0 and _rel(got["loss"], want["loss"]) <= REL, (got, want)


@pytest.mark.parametrize("args, fragment", [
    (["--layout", "dp=1", "--sequences", str(SEQUENCES + 1)],
     f"sequences={SEQUENCES + 1} is more than"),
    (["--layout", "dp=1", "--sequences", str(SEQUENCES + 1)], f"holds: {SEQUENCES} windows"),
    (["--layout", "tp=3", "--sequences", "2"], "tp=3 must divide the attention heads (8)"),
    (["--layout", "dp=1", "--sequences", "0"], "--sequences=0 must be >= 1"),
    (["--layout", "dp=1", "--sequences", "2", "--seq-len", "4096"], "seq_len=4096 must be in"),
])
def test_errors_name_the_value_and_what_is_valid(preset_tokens, capsys, args, fragment):
    rc = main(["eval", "--model", "gpt-tiny", "--data", str(preset_tokens),
               "--seq-len", str(SEQ_LEN), *args])
    err = capsys.readouterr().err
    assert rc == 2 and fragment in err, err

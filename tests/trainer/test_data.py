"""Real token data: uint16/uint32 token files, text corpora tokenised once into a cache, and a
151,936-token vocabulary trained from ids that only uint32 can hold.

Tokenizers are trained here, on a few sentences, by the ``tokenizers`` package itself, so
nothing is downloaded and the expected ids come from the same library's ``Tokenizer.encode``.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dynatrain.cli.app import main
from dynatrain.trainer import textdata
from dynatrain.trainer.config import ConfigError, make_config
from dynatrain.trainer.data import FileTokens, micro_batches, token_source
from dynatrain.trainer.textdata import DataError, prepare_data, prepare_text

SENTENCES = [
    "the wind turns west before the rain",
    "a worker joins the job and the layout grows",
    "clouds gather over the hills in the evening",
    "every shard moves once when the layout changes",
    "the rain stops and the wind turns north",
    "a node is preempted and its worker leaves the job",
]
BIG_VOCAB = 151_936


def small_tokenizer(d: Path) -> Path:
    """A word-level tokenizer trained on SENTENCES, with ``</s>`` as its EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "</s>"], show_progress=False))
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return d


def huge_tokenizer(d: Path, size: int = 70_000) -> Path:
    """A word-level tokenizer whose vocabulary (``w0`` .. ``w{size-1}``) needs uint32."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<|endoftext|>": 1, **{f"w{i}": i + 2 for i in range(size - 2)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))    # no tokenizer_config.json: EOS found by its name
    return d


def expected_ids(tok_dir: Path, docs: list[str], eos: str = "</s>") -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids = []
    for d in docs:
        ids += tok.encode(d).ids + [tok.token_to_id(eos)]
    return np.array(ids)


def write_jsonl(path: Path, docs) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def spec_file(tmp_path: Path, vocab: int = BIG_VOCAB) -> str:
    path = tmp_path / "big-vocab.json"
    path.write_text(json.dumps({
        "name": "big-vocab", "arch": "llama", "vocab_size": vocab, "hidden_size": 64,
        "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 128, "max_seq_len": 64}))
    return str(path)


# -- token files -------------------------------------------------------------------------------
def test_uint32_file_round_trip(tmp_path):
    tokens = (np.arange(1000, dtype=np.uint32) * 151) % BIG_VOCAB   # most ids above 65,535
    assert (tokens > 65_535).sum() > 500
    path = tmp_path / "t.u32"
    tokens.tofile(path)
    src = FileTokens(str(path), BIG_VOCAB, 16, "uint32")
    assert src.windows == (1000 - 1) // 16
    for i in (0, 1, 7, src.windows - 1, src.windows, 3 * src.windows + 5):
        start = (i % src.windows) * 16
        got = src.sample(i)
        assert got.dtype == torch.int64 and got.shape == (17,)
        assert got.tolist() == tokens[start:start + 17].astype(np.int64).tolist()


def test_token_file_checks(tmp_path):
    path = tmp_path / "t.u32"
    np.array([1, 2, 3, 70_000, 5] * 10, dtype=np.uint32).tofile(path)
    with pytest.raises(DataError, match=r"token id 70000 at token 3, outside the model's "
                       r"vocabulary of 65,000"):
        FileTokens(str(path), 65_000, 4, "uint32")
    odd = tmp_path / "odd.u32"
    odd.write_bytes(b"\0" * 42)
    with pytest.raises(DataError, match=r"42 bytes, not a whole number of uint32 tokens"):
        FileTokens(str(odd), 100, 4, "uint32")
    short = tmp_path / "short.u16"
    np.arange(4, dtype=np.uint16).tofile(short)
    with pytest.raises(DataError, match=r"holds 4 tokens, fewer than seq_len\+1 = 9"):
        FileTokens(str(short), 100, 8, "uint16")
    # a uint16 file read as uint32 makes large ids: the error says what to check
    u16 = tmp_path / "u16.bin"
    np.full(64, 3, dtype=np.uint16).tofile(u16)
    with pytest.raises(DataError, match=r"196611 .*dtype is 'uint16'"):
        FileTokens(str(u16), 1000, 4, "uint32")


def test_uint32_samples_do_not_depend_on_layout(tmp_path):
    """Exactly-once reading across a switch rests on this: the rows of a step are the same
    samples whatever dp and micro-batch size cut them up."""
    tokens = (np.arange(5000, dtype=np.uint32) * 7919 + 65_536) % BIG_VOCAB
    path = tmp_path / "t.u32"
    tokens.tofile(path)
    src = FileTokens(str(path), BIG_VOCAB, 16, "uint32")
    gbs, position = 12, 36

    def rows(dp, mb, shares=None):
        out = []
        for j in range(dp):
            for inputs, targets in micro_batches(src, position, gbs, dp, j, mb, shares):
                assert torch.equal(inputs[:, 1:], targets[:, :-1])
                out += [torch.cat([i, t[-1:]]) for i, t in zip(inputs, targets)]
        return torch.stack(out)

    want = torch.stack([src.sample(position + k) for k in range(gbs)])
    assert int(want.max()) > 65_535
    for dp, mb in ((1, 1), (1, 4), (2, 3), (3, 2), (4, 1), (6, 2), (12, 1)):
        assert torch.equal(rows(dp, mb), want), (dp, mb)
    # Uneven shares (micro-batches per DP rank) cut the same rows, in the same order.
    for dp, mb, shares in ((2, 1, (9, 3)), (4, 1, (5, 5, 1, 1)), (3, 2, (1, 2, 3)), (5, 1, (1, 2, 3, 4, 2))):
        assert torch.equal(rows(dp, mb, shares), want), (dp, mb, shares)


def test_uint16_refused_for_a_large_vocabulary(tmp_path):
    path = tmp_path / "t.u16"
    np.arange(100, dtype=np.uint16).tofile(path)
    with pytest.raises(ConfigError, match=r"data_dtype='uint16' cannot hold the ids of "
                       r"big-vocab's 151,936-token vocabulary; use 'uint32'"):
        make_config(spec_file(tmp_path), "dp=1", seq_len=16, data=str(path),
                    data_dtype="uint16")


@pytest.mark.timeout(120)
def test_large_vocabulary_trains_from_uint32_ids(tmp_path):
    from dynatrain.trainer.launch import run_local

    # A learnable stream over ids that uint16 cannot hold: a fixed cycle of 24 tokens.
    cycle = np.array([65_536 + 3_001 * k for k in range(23)] + [BIG_VOCAB - 1], dtype=np.uint32)
    path = tmp_path / "big.u32"
    np.tile(cycle, 200).tofile(path)
    config = make_config(spec_file(tmp_path), "tp=2", seq_len=16, global_batch_size=4,
                         lr=1e-2, data=str(path), data_dtype="uint32")
    losses = run_local(config, 6, backend="gloo").losses
    assert all(np.isfinite(losses)), losses
    assert abs(losses[0] - np.log(BIG_VOCAB)) < 1.0, losses     # starts near uniform
    assert losses[-1] < losses[0] - 1.0 and losses[-1] < losses[2], losses


# -- text ------------------------------------------------------------------------------------------
def test_jsonl_is_tokenised_like_encode_and_cached(tmp_path):
    tok = small_tokenizer(tmp_path / "tok")
    docs = [{"text": SENTENCES[0], "id": 1}, SENTENCES[1], {"text": ""},   # empty: skipped
            {"text": SENTENCES[2]}]
    text = write_jsonl(tmp_path / "corpus.jsonl", docs)
    with open(text, "a") as f:
        f.write("\n   \n")                                     # blank lines are skipped
    first = prepare_text(text, tok, "uint16", progress=None)
    assert not first.cached and first.documents == 3 and first.dtype == "uint16"
    assert first.path.parent == tmp_path and first.path.name.startswith("corpus.jsonl.tok-")
    want = expected_ids(tok, SENTENCES[:3])
    got = np.fromfile(first.path, dtype=np.uint16)
    assert got.tolist() == want.tolist() and first.tokens == len(want)
    mtime = first.path.stat().st_mtime_ns

    again = prepare_text(text, tok, "uint16", progress=None)
    assert again.cached and again.path == first.path and again.tokens == first.tokens
    assert first.path.stat().st_mtime_ns == mtime                   # not written again

    time.sleep(0.01)
    write_jsonl(text, [SENTENCES[3], SENTENCES[4]])                 # the corpus changes
    changed = prepare_text(text, tok, "uint16", progress=None)
    assert not changed.cached and changed.path != first.path
    assert (np.fromfile(changed.path, np.uint16).tolist()
            == expected_ids(tok, SENTENCES[3:5]).tolist())
    assert not first.path.exists()                                  # the stale cache is gone

    # another tokenizer (here: another EOS) is another cache
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[UNK]"}))
    other = prepare_text(text, tok, "uint16", progress=None)
    assert not other.cached and other.path != changed.path and changed.path.exists()
    assert other.tokens == changed.tokens


def test_txt_is_one_document_per_line(tmp_path):
    tok = small_tokenizer(tmp_path / "tok")
    text = tmp_path / "corpus.txt"
    text.write_text(f"{SENTENCES[0]}\n\n{SENTENCES[1]}\r\n{SENTENCES[2]}")
    p = prepare_text(text, tok, "uint32", progress=None)
    assert p.dtype == "uint32"                                       # as asked
    assert np.fromfile(p.path, np.uint32).tolist() == expected_ids(tok, SENTENCES[:3]).tolist()


def test_a_large_vocabulary_gets_uint32_automatically(tmp_path):
    tok = huge_tokenizer(tmp_path / "huge")
    text = tmp_path / "c.jsonl"
    write_jsonl(text, ["w1 w65600 w69997", "w5 w70001"])            # w70001: unknown
    path, dtype = prepare_data(type("Opts", (), {"data": str(text), "data_dtype": "uint16",
                                                 "tokenizer": str(tok)})())
    assert dtype == "uint32"
    assert np.fromfile(path, np.uint32).tolist() == [3, 65_602, 69_999, 1, 7, 0, 1]


def test_bad_text_names_the_line_and_the_field(tmp_path):
    tok = small_tokenizer(tmp_path / "tok")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: the object has no \"text\" field \(its "
                       r"fields: body\)"):
        prepare_text(bad, tok, progress=None)
    bad.write_text('{"text": "fine"}\n\n[1, 2]\n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: a JSON array; each line must be"):
        prepare_text(bad, tok, progress=None)
    bad.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: \"text\" is a JSON number, not a "
                       r"string"):
        prepare_text(bad, tok, progress=None)
    bad.write_text('{"text": "unterminated\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: not JSON"):
        prepare_text(bad, tok, progress=None)
    with pytest.raises(DataError, match=r"is not a directory with a tokenizer.json"):
        prepare_text(write_jsonl(bad, ["x"]), tmp_path, progress=None)
    assert not list(tmp_path.glob("*.tokens")) and not list(tmp_path.glob(".*.tmp"))


def test_training_reads_text_through_the_cache(tmp_path):
    tok = small_tokenizer(tmp_path / "tok")
    text = write_jsonl(tmp_path / "c.jsonl", SENTENCES * 3)
    config = make_config(spec_file(tmp_path, vocab=BIG_VOCAB), "dp=1", seq_len=8,
                         data=str(text), tokenizer=str(tok))     # uint16: the tokenizer's ids fit
    src = token_source(config)
    want = expected_ids(tok, SENTENCES * 3)
    assert src.dtype == "uint16" and src.sample(2).tolist() == want[16:25].tolist()
    assert prepare_text(text, tok, progress=None).cached


def test_a_tokenizer_too_large_for_the_model_is_named(tmp_path, capsys):
    tok = small_tokenizer(tmp_path / "tok")
    text = write_jsonl(tmp_path / "c.jsonl", SENTENCES)
    spec = spec_file(tmp_path, vocab=10)                      # the tokenizer has ~40 tokens
    config = make_config(spec, "dp=1", seq_len=8, data=str(text), tokenizer=str(tok))
    with pytest.raises(DataError, match=r"holds token id \d+ at token \d+, outside the model's "
                       r"vocabulary of 10 \(tokenised from .*c.jsonl with .*tok: is that the "
                       r"model's own tokenizer\?\)"):
        token_source(config)
    # `dynatrain train` says so before starting any process
    assert main(["train", "--model", spec, "--layout", "dp=1", "--seq-len", "8", "--data",
                 str(text), "--tokenizer", str(tok)]) == 2
    assert "is that the model's own tokenizer?" in capsys.readouterr().err


def test_workers_starting_together_tokenise_once(tmp_path):
    tok = small_tokenizer(tmp_path / "tok")
    text = write_jsonl(tmp_path / "c.jsonl", SENTENCES * 2000)
    code = ("import sys; from dynatrain.trainer.textdata import prepare_text; "
            "p = prepare_text(sys.argv[1], sys.argv[2], progress=None); "
            "print(p.cached, p.path, p.tokens)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(text), str(tok)],
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(o[0] for o in outs) == ["False", "True", "True"]   # one tokenised
    assert len({o[1] for o in outs}) == 1 and len({o[2] for o in outs}) == 1
    want = expected_ids(tok, SENTENCES * 2000)
    assert np.fromfile(outs[0][1], np.uint16).tolist() == want.tolist()


def test_cache_falls_back_where_the_text_directory_is_read_only(tmp_path, monkeypatch):
    tok = small_tokenizer(tmp_path / "tok")
    text = write_jsonl(tmp_path / "c.jsonl", SENTENCES)
    # (chmod would not do: tests may run as root, who writes anywhere)
    monkeypatch.setattr(textdata, "_writable", lambda d: d != tmp_path)
    monkeypatch.setenv("DYNATRAIN_CACHE", str(tmp_path / "cache"))
    p = prepare_text(text, tok, progress=None)
    assert p.path.parent == tmp_path / "cache" / "tokens" and not p.cached
    assert prepare_text(text, tok, progress=None).cached
    assert not list(tmp_path.glob("c.jsonl.*"))


def test_tokenize_command(tmp_path, capsys):
    tok = small_tokenizer(tmp_path / "tok")
    text = write_jsonl(tmp_path / "c.jsonl", SENTENCES)
    assert main(["tokenize", str(text), "--tokenizer", str(tok), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == len(expected_ids(tok, SENTENCES)) and out["dtype"] == "uint16"
    assert not out["cached"] and Path(out["path"]).is_file()
    assert main(["tokenize", str(text), "--tokenizer", str(tok)]) == 0
    printed = capsys.readouterr().out
    assert out["path"] in printed and "cache reused" in printed and "dtype uint16" in printed
    dest = tmp_path / "out" / "c.u32"
    assert main(["tokenize", str(text), "--tokenizer", str(tok), "--out", str(dest),
                 "--dtype", "uint32", "--quiet"]) == 0
    assert np.fromfile(dest, np.uint32).tolist() == expected_ids(tok, SENTENCES).tolist()
    assert main(["tokenize", str(dest), "--tokenizer", str(tok)]) == 2
    assert "must be a .jsonl or .txt file" in capsys.readouterr().err


def test_progress_lines_for_long_tokenisation(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(textdata, "PROGRESS_BYTES", 1000)
    monkeypatch.setattr(textdata, "BATCH_CHARS", 500)
    tok = small_tokenizer(tmp_path / "tok")
    text = write_jsonl(tmp_path / "c.jsonl", SENTENCES * 20)
    prepare_text(text, tok)
    err = capsys.readouterr().err
    assert "tokenising" in err and "MiB" in err and "tokenised" in err

"""Shuffled and blended data, Parquet/Arrow tables and Hugging Face ``datasets`` directories,
SFT conversations with their loss mask.

The references are independent where one exists: ``transformers``' ``apply_chat_template``
(token ids, and its assistant mask from a template with ``{% generation %}`` markers) for the
SFT rendering; the ``tokenizers`` package's ``encode`` for tables' text; a hand-written list of
trained positions and a hand computation of the masked loss; the plain-PyTorch reference model
(``F.cross_entropy(ignore_index=-100)``) for training under layouts with DP and TP.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dynatrain.trainer.config import ConfigError, DataSource, make_config
from dynatrain.trainer.data import (IGNORE_INDEX, Blend, BlendSchedule, FileTokens, Permutation,
                                    Shuffled, micro_batches, token_source)
from dynatrain.trainer.sft import SFTWindows, conversations, pack
from dynatrain.trainer.tables import prepare_table
from dynatrain.trainer.textdata import DataError, prepare_text
from dynatrain.trainer.tp import vocab_parallel_cross_entropy

from test_data import SENTENCES, expected_ids, small_tokenizer, write_jsonl

# -- shuffling ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1000, 4097])
def test_permutation_is_a_bijection(n):
    for key in (0, 1, 12345):
        assert sorted(Permutation(n, key)(i) for i in range(n)) == list(range(n))


def test_permutation_depends_on_the_key_and_nothing_else():
    a = [Permutation(1000, 7)(i) for i in range(1000)]
    assert a == [Permutation(1000, 7)(i) for i in range(1000)]
    assert a != [Permutation(1000, 8)(i) for i in range(1000)]
    assert a != list(range(1000))
    # a shuffle, not a rotation: about half the elements land in the other half
    assert 400 < sum((a[i] < 500) != (i < 500) for i in range(1000)) < 600


def token_file(path: Path, tokens: np.ndarray, dtype="uint16") -> str:
    tokens.astype(dtype).tofile(path)
    return str(path)


def windows_file(path: Path, windows: int, seq_len: int, offset: int = 0) -> str:
    """A token file whose window w holds tokens offset + w (then the shared last token), so a
    sample names the window it came from."""
    tokens = np.repeat(np.arange(windows) + offset, seq_len)
    return token_file(path, np.concatenate([tokens, [offset]]))


def which(sample: torch.Tensor) -> int:
    return int(sample[0])


def test_shuffled_reads_every_window_once_per_epoch_in_a_new_order(tmp_path):
    src = FileTokens(windows_file(tmp_path / "w.bin", 50, 4), 1000, 4)
    s = Shuffled(src, seed=3)
    epochs = [[which(s.example(e * 50 + i)[0]) for i in range(50)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(50))
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(50))
    assert [which(Shuffled(src, seed=4).example(i)[0]) for i in range(50)] != epochs[0]


@pytest.mark.parametrize("dp,mbs", [(2, 1), (4, 1), (2, 2), (8, 1)])
def test_a_step_reads_the_same_samples_under_any_layout(tmp_path, dp, mbs):
    config = make_config("gpt-tiny", "dp=1", seq_len=4, global_batch_size=8,
                         data_blend=(DataSource(path=windows_file(tmp_path / "a.bin", 30, 4)),
                                     DataSource(path=windows_file(tmp_path / "b.bin", 7, 4, 500),
                                                weight=0.5)),
                         shuffle=True)
    src = token_source(config)
    for position in (0, 8, 64):
        whole = torch.cat([t for t, _ in micro_batches(src, position, 8, 1, 0, 1)])
        split = torch.cat([t for j in range(dp) for t, _ in
                           micro_batches(src, position, 8, dp, j, mbs)])
        assert torch.equal(whole, split)


# -- blending -------------------------------------------------------------------------------------


def test_blend_schedule_honours_weights_and_reads_each_source_in_order():
    sched = BlendSchedule([0.7, 0.2, 0.1])
    assert sched.counts == [7, 2, 1] and sched.period == 10
    picks = [sched(i) for i in range(1000)]
    for s, share in enumerate((700, 200, 100)):
        mine = [k for src, k in picks if src == s]
        assert mine == list(range(share))              # its own stream, in order, no gaps
    # smooth: source 0 never waits long, the others are spread over the period
    first = [src for src, _ in picks[:10]]
    assert first.count(0) == 7 and max(len(run) for run in "".join(
        str(x) for x in first).split("0")) <= 1
    assert BlendSchedule([3, 1]).counts == [3, 1] and BlendSchedule([2, 2]).counts == [1, 1]


@pytest.mark.parametrize("weights,needle", [([1, 0], "positive"), ([1, -2], "positive"),
                                            ([1, 1e-5], "1/1000")])
def test_bad_blend_weights_are_named(weights, needle):
    with pytest.raises(DataError, match=needle):
        BlendSchedule(weights)


def test_a_blend_of_shuffled_sources_is_what_the_rule_says(tmp_path):
    a = windows_file(tmp_path / "a.bin", 10, 4)
    b = windows_file(tmp_path / "b.bin", 3, 4, 100)
    config = make_config("gpt-tiny", "dp=1", seq_len=4, shuffle=True, shuffle_seed=11,
                         data_blend=(DataSource(path=a, weight=2), DataSource(path=b, weight=1)))
    src = token_source(config)
    assert isinstance(src, Blend)
    sa = Shuffled(FileTokens(a, 1000, 4), 11, salt=0)
    sb = Shuffled(FileTokens(b, 1000, 4), 11, salt=1)
    got = [which(src.example(i)[0]) for i in range(60)]
    want = []
    ka = kb = 0
    for i in range(60):
        if i % 3 in (0, 2):                  # counts [2, 1]: a, b, a in every period
            want.append(which(sa.example(ka)[0]))
            ka += 1
        else:
            want.append(which(sb.example(kb)[0]))
            kb += 1
    assert got == want
    from_a = [x for i, x in enumerate(got) if i % 3 != 1]
    assert sorted(from_a[:10]) == sorted(from_a[10:20]) == list(range(10))   # whole epochs
    assert from_a[:10] != from_a[10:20] != list(range(10))                   # new orders
    from_b = [x for i, x in enumerate(got) if i % 3 == 1]
    assert sorted(from_b[:3]) == sorted(from_b[3:6]) == [100, 101, 102]


def test_data_config_problems_are_named(tmp_path):
    f = windows_file(tmp_path / "a.bin", 10, 4)
    with pytest.raises(ConfigError, match=r"data\[1\]: 'missing.bin' is neither"):
        make_config("gpt-tiny", "dp=1", seq_len=4, data_blend=(
            DataSource(path=f), DataSource(path="missing.bin")))
    with pytest.raises(ConfigError, match="format='csv' is not one of"):
        make_config("gpt-tiny", "dp=1", seq_len=4, data=f, data_format="csv")
    with pytest.raises(ConfigError, match="give one or the other"):
        make_config("gpt-tiny", "dp=1", seq_len=4, data=f, data_blend=(DataSource(path=f),))
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        make_config("gpt-tiny", "dp=1", seq_len=4, data=f, data_format="sft")


# -- tables ---------------------------------------------------------------------------------------


def test_parquet_arrow_and_datasets_text_read_like_jsonl(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = small_tokenizer(tmp_path / "tok")
    want = expected_ids(tok, SENTENCES)
    table = pa.table({"id": list(range(len(SENTENCES))), "text": SENTENCES})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as f, \
            pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    datasets.Dataset.from_dict({"text": SENTENCES}).save_to_disk(str(tmp_path / "ds"))
    for path in ("t.parquet", "file.arrow", "stream.arrow", "ds"):
        p = prepare_table(tmp_path / path, tok)
        assert not p.cached and p.documents == len(SENTENCES)
        assert np.array_equal(np.fromfile(p.path, np.uint16), want), path
        assert prepare_table(tmp_path / path, tok).cached
    # a dataset's own order (after shuffle/select) is the order read
    ds = datasets.Dataset.from_dict({"text": SENTENCES}).select([5, 0, 3])
    ds.save_to_disk(str(tmp_path / "picked"))
    p = prepare_table(tmp_path / "picked", tok)
    assert np.array_equal(np.fromfile(p.path, np.uint16),
                          expected_ids(tok, [SENTENCES[5], SENTENCES[0], SENTENCES[3]]))


def test_input_ids_tables_are_written_as_they_are(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [[5, 6, 7], [8], [9, 10, 11, 12]]
    pq.write_table(pa.table({"input_ids": rows}), tmp_path / "ids.parquet")
    p = prepare_table(tmp_path / "ids.parquet", "", "uint32")
    assert np.fromfile(p.path, np.uint32).tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "ids"))
    assert np.fromfile(prepare_table(tmp_path / "ids").path, np.uint16).tolist() == \
        [5, 6, 7, 8, 9, 10, 11, 12]
    # through the trainer's config: a table is found by its suffix
    config = make_config("gpt-tiny", "dp=1", seq_len=3, data=str(tmp_path / "ids.parquet"),
                         data_dtype="uint32")
    assert token_source(config).sample(1).tolist() == [8, 9, 10, 11]


def test_table_problems_are_named(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "no.parquet")
    with pytest.raises(DataError, match=r"no text or input_ids column \(its columns: body\)"):
        prepare_table(tmp_path / "no.parquet")
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "text.parquet")
    with pytest.raises(DataError, match="needs a tokenizer"):
        prepare_table(tmp_path / "text.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 70000]]}), tmp_path / "big.parquet")
    with pytest.raises(DataError, match="70000, which uint16 cannot hold; use dtype 'uint32'"):
        prepare_table(tmp_path / "big.parquet")
    d = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]}),
                              "test": datasets.Dataset.from_dict({"text": ["y"]})})
    d.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="DatasetDict with splits train, test"):
        prepare_table(tmp_path / "dd", small_tokenizer(tmp_path / "tok"))


# -- SFT ------------------------------------------------------------------------------------------

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
# The same rendering, with transformers' markers of the assistant's text, for its mask.
MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> "
          "{% generation %}{{ m['content'] }} <|end|>\n{% endgeneration %}"
          "{% else %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|> {% endif %}")
CHAT = [{"role": "user", "content": "the wind turns"},
        {"role": "assistant", "content": "west before rain"},
        {"role": "user", "content": "and then"},
        {"role": "assistant", "content": "north"}]
WORDS = "the wind turns west before rain and then north a node leaves".split()
SPECIAL = ["[UNK]", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]


def chat_tokenizer(d: Path, template: str = TEMPLATE) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL[1:])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>",
                                                         "chat_template": template}))
    return d


def sft_file(path: Path, chats) -> str:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return str(path)


def test_sft_rendering_and_mask_match_transformers(tmp_path):
    from transformers import AutoTokenizer

    tok = chat_tokenizer(tmp_path / "tok", MARKED)
    chats = [CHAT, CHAT[:2], [{"role": "user", "content": "a node"},
                              {"role": "assistant", "content": "leaves"}]]
    ours = conversations(sft_file(tmp_path / "c.jsonl", chats), tok)
    hf = AutoTokenizer.from_pretrained(tok)
    for (ids, trained), chat in zip(ours, chats):
        ref = hf.apply_chat_template(chat, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert ids.tolist() == ref["input_ids"]
        assert trained.astype(int).tolist() == ref["assistant_masks"]


def test_sft_masked_loss_equals_a_hand_computation(tmp_path):
    tok = chat_tokenizer(tmp_path / "tok")
    path = sft_file(tmp_path / "c.jsonl", [CHAT])
    src = SFTWindows(path, str(tok), seq_len=16, vocab_size=64)
    (inputs, targets), = micro_batches(src, 0, 1, 1, 0, 1)
    names = SPECIAL + WORDS
    assert [names[i] for i in inputs[0]] == [
        "<|user|>", "the", "wind", "turns", "<|end|>", "<|assistant|>", "west", "before", "rain",
        "<|end|>", "<|user|>", "and", "then", "<|end|>", "<|assistant|>", "north"]
    # by hand: the assistant's words and the <|end|> that closes each assistant turn
    trained = {5: "west", 6: "before", 7: "rain", 8: "<|end|>", 14: "north", 15: "<|end|>"}
    assert {j: names[t] for j, t in enumerate(targets[0].tolist()) if t != IGNORE_INDEX} == trained
    logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    hand = 0.0
    for j, word in trained.items():
        row = logits[j].tolist()
        hand += math.log(sum(math.exp(v) for v in row)) - row[names.index(word)]
    hand /= len(trained)
    got = vocab_parallel_cross_entropy(logits, targets[0], 0, None)
    assert abs(float(got) - hand) < 1e-12
    # a micro-batch with nothing to learn adds 0, not NaN
    none = torch.full((16,), IGNORE_INDEX)
    assert float(vocab_parallel_cross_entropy(logits, none, 0, None)) == 0.0


def test_packing_keeps_conversations_whole_and_the_loss_inside_each(tmp_path):
    tok = chat_tokenizer(tmp_path / "tok")
    short = [{"role": "user", "content": "a node"}, {"role": "assistant", "content": "leaves"}]
    convs = conversations(sft_file(tmp_path / "c.jsonl", [short, CHAT[:2], short, CHAT]), tok)
    lengths = [len(ids) for ids, _ in convs]
    assert lengths == [7, 10, 7, 17]
    tokens, trained = pack(convs, 20, pad=1)
    # 7+10 fit in 20, 7 more do not; 7 and 17 do not share
    assert tokens.shape == (3, 20)
    assert tokens[0][:17].tolist() == [*convs[0][0], *convs[1][0]]
    assert tokens[1][:7].tolist() == list(convs[2][0]) and tokens[2][:17].tolist() == list(convs[3][0])
    assert (tokens[0][17:] == 1).all() and not trained[0][17:].any()      # padding untrained
    # no target is a conversation's first token: nothing is predicted across conversations
    for row, starts in ((0, [0, 7]), (1, [0]), (2, [0])):
        assert not trained[row][starts].any()
    # a conversation longer than a window is cut to one window
    t2, _ = pack(convs[3:], 10, pad=1)
    assert t2.shape == (1, 10) and t2[0].tolist() == list(convs[3][0][:10])


def test_sft_problems_are_named(tmp_path):
    tok = chat_tokenizer(tmp_path / "tok")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no messages"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: SFT lines must be objects"):
        conversations(bad, tok)
    with pytest.raises(DataError, match="give this source format 'sft'"):
        prepare_text(sft_file(tmp_path / "chat.jsonl", [CHAT]), tok)
    plain = small_tokenizer(tmp_path / "plain")
    with pytest.raises(DataError, match="has no chat template"):
        conversations(sft_file(tmp_path / "c.jsonl", [CHAT]), plain)


def sft_config(tmp_path: Path, layout: str, steps_data: int = 6, **kw):
    tok = chat_tokenizer(tmp_path / "tok")
    short = [{"role": "user", "content": "a node"}, {"role": "assistant", "content": "leaves"}]
    long = CHAT + [{"role": "user", "content": "the wind"},
                   {"role": "assistant", "content": "turns west before the rain"}]
    chats = [CHAT, short, long, CHAT[:2], short, long][:steps_data]
    path = sft_file(tmp_path / "sft.jsonl", chats)
    return make_config("gpt-tiny", layout, data=path, data_format="sft", tokenizer=str(tok),
                       seq_len=20, global_batch_size=4, micro_batch_size=1, lr=3e-3, eps=1e-6,
                       **kw)


def test_sft_training_follows_the_reference_under_dp_and_tp(tmp_path):
    """The masked mean over micro-batches, under DP (gradients averaged over ranks) and TP (the
    vocabulary-parallel loss): the plain reference's F.cross_entropy(ignore_index=-100)."""
    from dynatrain.trainer.launch import run_local
    from reference_model import train_reference

    steps = 3
    ref = train_reference(sft_config(tmp_path, "dp=1"), steps).losses
    for layout in ("dp=2", "tp=2"):
        got = run_local(sft_config(tmp_path, layout), steps).losses
        for a, b in zip(got, ref):
            assert abs(a - b) < 1e-5 * abs(b), (layout, got, ref)
    # the mask counts: different micro-batches have different numbers of trained tokens
    src = token_source(sft_config(tmp_path, "dp=1"))
    counts = {int((t != IGNORE_INDEX).sum()) for _, t in micro_batches(src, 0, 4, 1, 0, 1)}
    assert len(counts) > 1, counts


# -- the manifest ---------------------------------------------------------------------------------


def _manifest(data) -> dict:
    return {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": "j"},
            "spec": {"model": {"preset": "gpt-tiny"}, "elastic": {"minWorkers": 1,
                                                                  "maxWorkers": 2},
                     "training": {"seqLen": 4, "data": data}}}


def test_manifest_data_forms_reach_the_trainer_config(tmp_path):
    from dynatrain.spec.job import job_from_manifest
    from dynatrain.vps.layout import parse_layout

    a = windows_file(tmp_path / "a.bin", 10, 4)
    b = windows_file(tmp_path / "b.bin", 10, 4)
    dp1 = parse_layout("dp=1")
    c = job_from_manifest(_manifest([{"path": a, "weight": 2}, {"path": b}])).train_config(dp1)
    assert c.data_blend == (DataSource(path=a, weight=2.0), DataSource(path=b)) and not c.shuffle
    c = job_from_manifest(_manifest({"sources": [a, {"path": b, "weight": 0.5}],
                                     "shuffle": True, "seed": 3})).train_config(dp1)
    assert c.shuffle and c.shuffle_seed == 3 and c.data_blend[1].weight == 0.5
    c = job_from_manifest(_manifest({"path": a, "shuffle": True})).train_config(dp1)
    assert c.data == a and c.shuffle and c.shuffle_seed is None and c.data_blend == ()


@pytest.mark.parametrize("data,needle", [
    ({"sources": [{"path": "x", "tokenizer": "t"}]}, "spec.training.data.sources[0]: unknown "
                                                     "field(s) tokenizer"),
    ([{"path": "x", "weight": -1}], "spec.training.data[0].weight=-1 must be positive"),
    ({"path": "x", "sources": ["y"]}, "exactly one of path"),
    ({"path": "x", "shuffle": "yes"}, "spec.training.data.shuffle='yes' must be true or false"),
    ({"path": "x", "format": "csv"}, "spec.training.data.format"),
    ({"path": "c.jsonl", "format": "sft"}, "is sft; set spec.training.data.tokenizer"),
    (7, "must be 'synthetic', a path, a list of sources"),
])
def test_manifest_data_problems_name_the_field(data, needle):
    from dynatrain.spec.job import JobError, job_from_manifest

    with pytest.raises(JobError) as e:
        job_from_manifest(_manifest(data))
    assert needle in str(e.value)


def test_packed_conversations_attend_to_earlier_ones_as_documented(tmp_path):
    """sft.py says: the loss never crosses conversations, attention does (no block mask). Two
    windows hold a different first conversation of the same length, then the same second
    one at the same positions; counting only the second's targets, the losses differ, which
    only attention across the boundary can cause."""
    from reference_model import ReferenceLM

    from dynatrain.trainer.weights import initial_tensor

    tok = chat_tokenizer(tmp_path / "tok")
    first = CHAT[:2]
    other = [{"role": "user", "content": "a node leaves"},
             {"role": "assistant", "content": "the wind turns"}]
    second = [{"role": "user", "content": "a node"}, {"role": "assistant", "content": "leaves"}]
    config = make_config("gpt-tiny", "dp=1")
    model = ReferenceLM(config.model)
    specs = {t.name: t for t in config.model.tensors}
    with torch.no_grad():
        for name, p in model.named_logical().items():
            p.copy_(initial_tensor(config.model, specs[name], 0))
    losses = []
    for lead in (first, other):
        src = SFTWindows(sft_file(tmp_path / f"c{len(losses)}.jsonl", [lead, second]), str(tok),
                         16, 2048)
        assert src.windows == 1                           # 10 + 7 tokens: one window
        (inputs, targets), = micro_batches(src, 0, 1, 1, 0, 1)
        targets[0][:9] = IGNORE_INDEX                     # only the second conversation's
        assert (targets[0][9:] != IGNORE_INDEX).sum() == 2     # "leaves", "<|end|>"
        with torch.no_grad():
            losses.append(float(model(inputs, targets)))
    assert abs(losses[0] - losses[1]) > 1e-4, losses


def test_eval_of_sft_data_scores_only_the_assistant_tokens(tmp_path):
    """`dynatrain eval` on SFT data is the mean over the trained (assistant) targets of the
    sequences, as the reference's F.cross_entropy(ignore_index=-100) over the same batch, under
    any layout: masked targets are neither scored nor counted."""
    from reference_model import ReferenceLM

    from dynatrain.trainer.evaluate import run_eval
    from dynatrain.trainer.weights import initial_tensor

    config = sft_config(tmp_path, "dp=1")
    model = ReferenceLM(config.model)
    specs = {t.name: t for t in config.model.tensors}
    with torch.no_grad():
        for name, p in model.named_logical().items():
            p.copy_(initial_tensor(config.model, specs[name], config.seed))
    (inputs, targets), = micro_batches(token_source(config), 0, 4, 1, 0, 4)
    with torch.no_grad():
        ref = float(model(inputs, targets))
    trained = int((targets != IGNORE_INDEX).sum())
    assert 0 < trained < targets.numel()
    for layout in ("dp=1", "tp=2"):
        got = run_eval(sft_config(tmp_path, layout), 4, backend="gloo")
        assert got.tokens == trained, (layout, got.tokens, trained)
        assert abs(got.loss - ref) < 1e-5 * abs(ref), (layout, got.loss, ref)

"""Make a tiny Hugging Face tokenizer and Llama model from the example corpus, offline.

The examples that train on real text (``--data examples/data/corpus.jsonl``) need a tokenizer
and, for ``--model hf:DIR``, a Hugging Face checkpoint. Neither is shipped or downloaded: this
script builds both from what is in the repository, deterministically, so the same seed gives
the same files on every machine:

- ``OUT/tokenizer``: a byte-level BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json``)
  trained with the ``tokenizers`` package on ``examples/data/corpus.jsonl``, about 2,000 tokens,
  ``<|endoftext|>`` as its end-of-sequence token (which joins documents in the token file);
- ``OUT/model``: a randomly initialised ``LlamaForCausalLM`` (hidden 128, 4 layers, 4 heads,
  2 key/value heads, MLP 344, 256 positions, untied embeddings, vocabulary = the tokenizer's)
  written by ``save_pretrained``, with the same tokenizer files beside it.

Usage (``transformers`` is in the ``hf`` and ``test`` extras)::

    .venv/bin/python examples/make_tiny_hf.py                 # -> examples/tiny-llama
    .venv/bin/dynatrain train --model hf:examples/tiny-llama/model --layout dp=2 \\
        --data examples/data/corpus.jsonl --tokenizer examples/tiny-llama/tokenizer --seq-len 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EOS = "<|endoftext|>"
MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=344, max_position_embeddings=256, tie_word_embeddings=False)


def corpus_texts(path: Path) -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                value = json.loads(line)
                text = value.get("text") if isinstance(value, dict) else value
                if not isinstance(text, str):
                    sys.exit(f"{path}:{number}: expected {{\"text\": ...}} or a JSON string")
                texts.append(text)
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    # Byte-level: every string encodes (no unknown token), as in GPT-2-style tokenizers.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def save_tokenizer(tok, directory: Path, max_length: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    # What transformers' AutoTokenizer needs to load tokenizer.json as it is, and where
    # DynaTrain's tokenisation looks for the end-of-sequence token.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None,
              "pad_token": None, "unk_token": None, "model_max_length": max_length,
              "add_prefix_space": False, "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_model(vocab_size: int, eos_id: int, seed: int, directory: Path) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()

    config = LlamaConfig(vocab_size=vocab_size, eos_token_id=eos_id, bos_token_id=None,
                         pad_token_id=None, **MODEL)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE / "tiny-llama"),
                   help="output directory (default examples/tiny-llama)")
    p.add_argument("--corpus", default=str(HERE / "data" / "corpus.jsonl"),
                   help="the tokenizer's training text (.jsonl, {\"text\": ...} per line)")
    p.add_argument("--vocab-size", type=int, default=2000, help="BPE vocabulary (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="torch seed of the weights (default 0)")
    args = p.parse_args(argv)
    if args.vocab_size < 257:
        sys.exit(f"--vocab-size={args.vocab_size}: a byte-level BPE needs at least 257 "
                 "(256 bytes and the end-of-sequence token)")
    # Single-threaded BPE training: the merges are then the same run after run.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out)
    texts = corpus_texts(Path(args.corpus))
    tok = train_tokenizer(texts, args.vocab_size)
    vocab, eos_id = tok.get_vocab_size(), tok.token_to_id(EOS)
    for d in (out / "tokenizer", out / "model"):
        save_tokenizer(tok, d, MODEL["max_position_embeddings"])
    params = build_model(vocab, eos_id, args.seed, out / "model")
    tokens = sum(len(e.ids) + 1 for e in tok.encode_batch(texts))
    print(f"tokenizer: {out / 'tokenizer'} (byte-level BPE, {vocab:,} tokens, EOS {EOS} = "
          f"{eos_id}; {len(texts)} documents of {args.corpus} are {tokens:,} tokens)")
    print(f"model:     {out / 'model'} (LlamaForCausalLM, {params:,} parameters, seed "
          f"{args.seed}; tokenizer files beside it)")
    for f in sorted(out.rglob("*")):
        if f.is_file():
            print(f"  {f.relative_to(out)}  {f.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

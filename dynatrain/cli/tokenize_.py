"""``dynatrain tokenize``: turn a text corpus into the flat token file training reads.

Training tokenises text data by itself (``--data corpus.jsonl --tokenizer DIR``), once, into a
cache next to the text. This command does the same ahead of time, e.g. on a machine with more
cores than the workers have, or to hand the workers a plain token file (``--out``); it prints
where the file is, how many tokens it holds and their dtype. The work is
:mod:`dynatrain.trainer.textdata`'s; this module only checks the command line and reports.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dynatrain.cli.errors import UsageError

EPILOG = """\
text formats:
  .jsonl   one document per line: {"text": "..."} (other fields ignored) or a JSON string
  .txt     one document per non-blank line (use .jsonl for documents spanning lines)
Each document is encoded on its own (with the tokenizer's special tokens) and followed by the
tokenizer's end-of-sequence token when it has one.

examples:
  dynatrain tokenize examples/data/corpus.jsonl --tokenizer examples/tiny-llama/tokenizer
  dynatrain tokenize corpus.txt --tokenizer hf/Qwen3-0.6B --out corpus.u32.tokens
  dynatrain train --model hf:examples/tiny-llama/model --layout dp=2 \\
      --data examples/data/corpus.jsonl --tokenizer examples/tiny-llama/tokenizer

Without --out the file is the cache training looks for (next to the text, its name keyed by
the tokenizer, the dtype and the text's size and modification time), so a later
`dynatrain train`/`run` with the same text and tokenizer starts without tokenising.
"""


def register(sub) -> None:
    p = sub.add_parser(
        "tokenize", help="tokenise a .jsonl/.txt corpus into a flat token file",
        description="Tokenise a text corpus once with a Hugging Face tokenizer (tokenizer.json) "
        "into a flat uint16/uint32 token file, and print its path, token count and dtype.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", metavar="TEXT", help="the corpus: a .jsonl or .txt file")
    p.add_argument("--tokenizer", required=True, metavar="DIR",
                   help="a Hugging Face tokenizer or model directory with tokenizer.json")
    p.add_argument("--out", metavar="FILE",
                   help="write the token file here (always tokenising) instead of the cache "
                   "next to TEXT; train on it with --data FILE --data-dtype DTYPE")
    p.add_argument("--dtype", choices=("uint16", "uint32"), default="uint16",
                   help="token dtype (default uint16); uint32 regardless when the vocabulary "
                   "has more than 65,536 tokens")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (path, tokens, dtype, cached, seconds)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run_tokenize)


def run_tokenize(args) -> int:
    from dynatrain.trainer.textdata import TEXT_SUFFIXES, prepare_text

    if not args.text.lower().endswith(TEXT_SUFFIXES):
        raise UsageError(f"TEXT={args.text!r} must be a {' or '.join(TEXT_SUFFIXES)} file "
                         "(a token file needs no tokenising)")
    t0 = time.monotonic()
    progress = None if args.quiet or args.json else sys.stderr
    p = prepare_text(args.text, args.tokenizer, args.dtype, out=args.out, progress=progress)
    seconds = time.monotonic() - t0
    if args.json:
        print(json.dumps({"path": str(p.path), "tokens": p.tokens, "dtype": p.dtype,
                          "cached": p.cached, "documents": p.documents,
                          "seconds": round(seconds, 3)}))
        return 0
    if p.dtype != args.dtype:
        print(f"note: the tokenizer's vocabulary needs uint32 (asked: {args.dtype})")
    how = ("already tokenised (cache reused)" if p.cached else
           f"tokenised {p.documents:,} documents in {seconds:.1f} s")
    print(f"{p.path}\n  {p.tokens:,} tokens, dtype {p.dtype}; {how}")
    return 0

"""Each data source of a job, whatever its format, made ready to train from.

:mod:`.textdata` tokenises a text corpus once into a cached token file, :mod:`.tables` does the
same for Parquet/Arrow files and HF ``datasets`` directories, and :mod:`.sft` renders chat
conversations with their loss masks; this module picks the one a source's format needs, and
checks every source's token ids against the model's vocabulary before any worker starts. (It
sits above the three so that they, which share textdata's cache helpers, import nothing back.)
"""

from __future__ import annotations

from .config import DataSource
from .sft import conversations
from .tables import prepare_table
from .textdata import DataError, DataOptions, Prepared, check_tokens, prepare_text


def prepare_source(source: DataSource, options: DataOptions) -> tuple[str, str, str]:
    """(format, path, dtype) that training reads for one source: a token file as it is, a
    text corpus's or a table's cached token file (made now unless a valid cache exists), or an
    SFT file itself (rendered in each process, :mod:`.sft`)."""
    kind, p = _prepare(source, options)
    return (kind, str(p.path), p.dtype) if p else (kind, source.path, options.data_dtype)


def _prepare(source: DataSource, options: DataOptions) -> tuple[str, Prepared | None]:
    kind = source.kind
    if kind == "text":
        return kind, prepare_text(source.path, options.tokenizer, options.data_dtype)
    if kind == "table":
        return kind, prepare_table(source.path, options.tokenizer, options.data_dtype)
    if kind in ("tokens", "sft", "synthetic"):
        return kind, None
    raise DataError(f"data format {kind!r} of {source.path!r} is not one of tokens, text, "
                    "table, sft")


def prepare_and_check(options: DataOptions, vocab_size: int, say=None) -> None:
    """Before any rank or worker process starts: tokenise text corpora and tables once (each
    process then only finds the cache), render SFT conversations once as a check, and check
    the token ids against the model's vocabulary, so a mismatch is one line now rather than a
    traceback from every process. ``say(line)`` hears what was done."""
    for source in options.sources:
        kind, prepared = _prepare(source, options)
        path, dtype = (prepared.path, prepared.dtype) if prepared else (source.path,
                                                                         options.data_dtype)
        if kind == "synthetic":
            continue
        if kind == "sft":
            convs = conversations(path, options.tokenizer)
            top = max((int(ids.max()) for ids, _ in convs if len(ids)), default=0)
            if top >= vocab_size:
                raise DataError(f"SFT data {path!r} rendered with {options.tokenizer} holds "
                                f"token id {top}, outside the model's vocabulary of "
                                f"{vocab_size:,}: is that the model's own tokenizer?")
            if say:
                say(f"data: {path}: {len(convs):,} conversations (SFT, rendered with the chat "
                    f"template of {options.tokenizer})")
            continue
        what = f"{source.path} with {options.tokenizer}" if options.tokenizer else ""
        if say and prepared:
            say(f"data: {source.path} -> {prepared.path} ({prepared.tokens:,} {prepared.dtype} "
                f"tokens, {'cached' if prepared.cached else 'tokenised now'})")
        check_tokens(path, dtype, vocab_size, source=what if kind != "tokens" else "")

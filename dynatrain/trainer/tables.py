"""Parquet and Arrow files, and directories saved by Hugging Face ``datasets``, become flat token
files once, cached beside them, exactly as text corpora do (:mod:`.textdata`).

A table is read column-wise in record batches (bounded memory whatever its size):

- a ``text`` column (strings): each row is one document, tokenised like a ``.jsonl`` line
  (the tokenizer's own special tokens, then its end-of-sequence token); needs a tokenizer;
- an ``input_ids`` column (lists of integers): each row's ids are written as they are, in row
  order, with nothing added between rows (the rows were tokenised by whoever made the table,
  who decided their separators); needs no tokenizer.

With both columns, ``text`` is read when a tokenizer is given, else ``input_ids``. Rows come in
the table's order: for a ``datasets`` directory that is the dataset's own order (its indices
mapping, after ``select`` or ``shuffle``, included), read through ``datasets.load_from_disk``.
A ``DatasetDict`` directory (several splits) is refused with the splits named: point at one.

The cache's name carries the tokenizer (or ``ids``), the dtype and a key over the size and
modification time of the file (every file of a directory), so an edited table is read again.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Iterator

import numpy as np

from .config import TOKEN_DTYPES, is_hf_dataset_dir
from .textdata import (FORMAT, DataError, Prepared, _drop_stale, _existing, _locked, _writable,
                       _write_batch, fallback_dir, load_tokenizer)

BATCH_ROWS = 1024
COLUMNS = ("text", "input_ids")


def _stamp(path: Path) -> str:
    """What the table's contents are keyed by: size and mtime of it, or of each file under it."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    rows = [f"{p.relative_to(path) if p != path else p.name}:{p.stat().st_size}:"
            f"{p.stat().st_mtime_ns}" for p in files]
    return "\n".join(rows)


def _batches(path: Path) -> tuple[list[str], Iterator]:
    """(column names, iterator over pyarrow RecordBatch/Table chunks) of a table."""
    import pyarrow as pa

    if is_hf_dataset_dir(path):
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            raise DataError(f"{str(path)!r} holds a DatasetDict with splits "
                            f"{', '.join(ds)}; point the data path at one split's directory "
                            f"(e.g. {str(path / next(iter(ds)))!r})")
        return list(ds.column_names), ds.with_format("arrow").iter(batch_size=BATCH_ROWS)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            f = pq.ParquetFile(path)
        except pa.ArrowException as e:
            raise DataError(f"{str(path)!r} is not a Parquet file pyarrow can read: {e}") from None
        names = f.schema_arrow.names
        return names, lambda cols: f.iter_batches(batch_size=BATCH_ROWS, columns=cols)
    if suffix == ".arrow":
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_file(source)        # the IPC file format (random access)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)                          # the IPC stream format (datasets' shards)
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid as e:
                raise DataError(f"{str(path)!r} is neither an Arrow IPC file nor stream: "
                                f"{e}") from None
            batches = iter(reader)
        return reader.schema.names, batches
    raise DataError(f"{str(path)!r} is not a table: a .parquet or .arrow file, or a directory "
                    "saved by datasets (with a state.json)")


def _column_chunks(column: str, batches):
    """The column's values, batch by batch (a Parquet reader is asked for that column only)."""
    for b in batches([column]) if callable(batches) else batches:
        yield b.column(column)


def pick_column(path: Path, names: list[str], has_tokenizer: bool) -> str:
    if "text" in names and (has_tokenizer or "input_ids" not in names):
        if not has_tokenizer:
            raise DataError(f"table {str(path)!r} has a text column: it needs a tokenizer "
                            "directory (--tokenizer / spec.training.data.tokenizer)")
        return "text"
    if "input_ids" in names:
        return "input_ids"
    raise DataError(f"table {str(path)!r} has no text or input_ids column (its columns: "
                    f"{', '.join(names[:12]) or 'none'})")


_found: dict[tuple, Prepared] = {}
"""This process's answers, by (table, its stamp, tokenizer, dtype): every trainer a live switch
builds looks its data up again, and opening a datasets directory to read its column names
costs a noticeable fraction of a second."""


def prepare_table(path: str | Path, tokenizer: str | Path = "", dtype: str = "uint16", *,
                  progress=None) -> Prepared:
    """The cached flat token file of a table, made now unless a valid one exists."""
    path = Path(path)
    if not (path.is_file() or is_hf_dataset_dir(path)):
        raise DataError(f"table {str(path)!r} does not exist (a .parquet or .arrow file, or a "
                        "directory saved by datasets)")
    key = (str(path.resolve()), _stamp(path), str(tokenizer), dtype)
    known = _found.get(key)
    if known is not None and known.path.is_file():
        return Prepared(known.path, known.dtype, known.tokens, cached=True)
    _found[key] = found = _prepare_table(path, tokenizer, dtype, progress)
    return found


def _prepare_table(path: Path, tokenizer, dtype: str, progress) -> Prepared:
    names, batches = _batches(path)
    column = pick_column(path, names, bool(tokenizer))
    tok = load_tokenizer(tokenizer) if column == "text" else None
    if tok is not None and tok.vocab_size > 1 << 16:
        dtype = "uint32"
    label = f"{re.sub(r'[^A-Za-z0-9_-]+', '_', tok.directory.name)[:40]}-{tok.digest[:12]}" \
        if tok else \
        "ids-" + hashlib.sha256(f"ids\0format={FORMAT}".encode()).hexdigest()[:12]
    key = hashlib.sha256(_stamp(path).encode()).hexdigest()[:12]
    name = f"{path.name}.{label}.{key}.{dtype}.tokens"
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
    candidates = [path.parent / name,
                  fallback_dir() / f"{path.name}.{label}.{key}{where}.{dtype}.tokens"]
    found = _existing(candidates, dtype)
    if found:
        return found
    with _locked(path, progress):
        found = _existing(candidates, dtype)
        if found:
            return found
        target = candidates[0] if _writable(path.parent) else candidates[1]
        target.parent.mkdir(parents=True, exist_ok=True)
        names, batches = _batches(path)              # a fresh iterator: the first one was used
        rows, tokens = _write(path, column, _column_chunks(column, batches), tok,
                              dtype, target)
        if target == candidates[0]:
            _drop_stale(target)
    return Prepared(target, dtype, tokens, cached=False, documents=rows)


def _write(path: Path, column: str, chunks, tok, dtype: str, target: Path) -> tuple[int, int]:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    limit = 1 << (8 * TOKEN_DTYPES[dtype])
    import pyarrow.compute as pc

    rows = tokens = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                if column == "text":
                    texts = chunk.to_pylist()
                    if any(not isinstance(t, str) for t in texts):
                        bad = next(t for t in texts if not isinstance(t, str))
                        raise DataError(f"table {str(path)!r}: a text value is {bad!r}, not a "
                                        "string")
                    texts = [t for t in texts if t]
                    if texts:
                        tokens += _write_batch(f, tok, texts, dtype)
                    rows += len(texts)
                    continue
                flat = np.asarray(pc.list_flatten(chunk).to_numpy())
                if flat.dtype.kind not in "iu":
                    raise DataError(f"table {str(path)!r}: input_ids holds {flat.dtype} values, "
                                    "not integers")
                if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= limit):
                    raise DataError(f"table {str(path)!r}: input_ids holds id "
                                    f"{int(flat.max()) if flat.max() >= limit else int(flat.min())}"
                                    f", which {dtype} cannot hold"
                                    + ("; use dtype 'uint32'" if dtype == "uint16" else ""))
                flat.astype(dtype).tofile(f)
                tokens += int(flat.size)
                rows += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        if tokens == 0:
            raise DataError(f"table {str(path)!r} holds no tokens in its {column} column")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return rows, tokens

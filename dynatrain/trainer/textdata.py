"""Text corpora become flat token files once, cached next to the text, for every worker to map.

Training reads tokens, never text: a ``.jsonl`` or ``.txt`` corpus is tokenised a single time
with a Hugging Face tokenizer (``tokenizer.json``, read by the ``tokenizers`` package) into a
flat file of token ids, which :class:`dynatrain.trainer.data.FileTokens` then memory-maps like
any other token file. This keeps the data stream a pure function of the sample index (the
property live switches and exactly-once reading rest on) and keeps tokenisation off every
worker's start-up path.

Documents:

- ``.jsonl``: one document per line, either a JSON object with a ``text`` string field (other
  fields are ignored) or a bare JSON string; blank lines are skipped.
- ``.txt``: one document per non-blank line, the line break dropped (the convention of
  Hugging Face ``datasets``' text loader). A document that spans several lines belongs in a
  ``.jsonl`` file.

Each document is encoded as the tokenizer encodes it on its own (``Tokenizer.encode`` with its
special tokens, so a tokenizer that starts sequences with BOS does so per document), and is
followed by the tokenizer's end-of-sequence token when it has one (``eos_token`` of
``tokenizer_config.json``, else a conventional name such as ``</s>`` or ``<|endoftext|>``).

The cache file's name carries everything its contents depend on: the tokenizer (a hash of
``tokenizer.json`` and the EOS choice), the token dtype, and the text's size and modification
time, so an edited corpus or another tokenizer never reads a stale cache. It is written to a
temporary file and renamed into place, and whoever tokenises holds an ``flock`` on the text
meanwhile: worker processes starting together wait for one tokenisation and never see half a
file. The cache lives next to the text; where that directory is read-only, under
``$DYNATRAIN_CACHE`` (default ``~/.cache/dynatrain``)/``tokens``.

This module needs only numpy and ``tokenizers`` (no torch), so ``dynatrain tokenize`` and the
commands that tokenise before starting workers stay quick to start.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np

from .config import TEXT_SUFFIXES, TOKEN_DTYPES, ConfigError, DataSource

FORMAT = 1
"""Bumped whenever the way documents are laid out in the token file changes, so caches
written by an older rule are not reused."""
UINT16_LIMIT = 1 << 16
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>")
"""End-of-sequence tokens tried, in order, when ``tokenizer_config.json`` names none."""
BATCH_CHARS = 1 << 20
"""Text handed to ``encode_batch`` at once: large enough for its threads to pay off, small
enough that a corpus of any size is tokenised in bounded memory."""
PROGRESS_BYTES = 64 << 20
PROGRESS_SECONDS = 10.0
"""A progress line on stderr after every PROGRESS_BYTES of text or PROGRESS_SECONDS,
whichever comes first."""


class DataError(ConfigError):
    """Training data cannot be read: the message names the file, the place and what is valid."""


class DataOptions(Protocol):
    """What :func:`prepare_data` reads: a :class:`~dynatrain.trainer.config.TrainConfig`, or a
    job's ``Training`` (so the local runner can tokenise before any layout exists)."""

    data: str
    data_dtype: str
    tokenizer: str
    sources: tuple[DataSource, ...]


@dataclass(frozen=True)
class Prepared:
    path: Path
    """The flat token file."""
    dtype: str
    """``uint16`` or ``uint32``."""
    tokens: int
    cached: bool
    """True when an existing file was reused (nothing was tokenised)."""
    documents: int = 0
    """Documents tokenised now (0 when ``cached``)."""


def is_text(data: str) -> bool:
    return data != "synthetic" and Path(data).suffix.lower() in TEXT_SUFFIXES


def prepare_data(config: DataOptions) -> tuple[str, str]:
    """The token file and its dtype that training with ``config`` reads: the data itself for
    a token file (and ``synthetic`` for the synthetic stream), or a text corpus's cached token
    file, tokenised now unless a valid cache exists. Call it once before starting workers;
    each worker calling it again then only finds the cache."""
    if not is_text(config.data):
        return config.data, config.data_dtype
    p = prepare_text(config.data, config.tokenizer, config.data_dtype)
    return str(p.path), p.dtype


def check_tokens(path: str | Path, dtype: str, vocab_size: int, *, source: str = "") -> None:
    """Every id of a token file is below ``vocab_size``, or a DataError naming the first that is
    not, where it is, and (``source``: the text and tokenizer it came from) what to check."""
    top, at = max_token(path, dtype, vocab_size)
    if top < vocab_size:
        return
    if source:
        hint = f" (tokenised from {source}: is that the model's own tokenizer?)"
    elif dtype == "uint32" and top >= UINT16_LIMIT:
        hint = " (if the file holds uint16 tokens, its dtype is 'uint16')"
    else:
        hint = ""
    raise DataError(f"token file {str(path)!r} holds token id {top} at token {at:,}, outside "
                    f"the model's vocabulary of {vocab_size:,}{hint}")


MAX_CHUNK = 1 << 24
"""Tokens read at once while checking a file's ids against the vocabulary."""


def max_token(path: str | Path, dtype: str, vocab_size: int) -> tuple[int, int]:
    """(largest id, its position) of a token file, or the first id >= ``vocab_size`` and its
    position. Read in chunks, and remembered per (file, size, mtime) in this process, because
    every trainer a live switch builds opens the same file again and must not re-read it."""
    st = os.stat(path)
    return _max_token(os.path.realpath(path), st.st_size, st.st_mtime_ns, dtype, vocab_size)


@lru_cache(maxsize=16)
def _max_token(path: str, _size: int, _mtime: int, dtype: str, vocab_size: int):
    tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    top, at = -1, 0
    for start in range(0, len(tokens), MAX_CHUNK):
        chunk = tokens[start:start + MAX_CHUNK]
        k = int(chunk.argmax())
        if int(chunk[k]) > top:
            top, at = int(chunk[k]), start + k
        if top >= vocab_size:
            bad = int(np.flatnonzero(chunk >= vocab_size)[0])   # the first offender, not the max
            return int(chunk[bad]), start + bad
    return max(top, 0), at


# -- the tokenizer -----------------------------------------------------------------------------
@dataclass(frozen=True)
class TextTokenizer:
    tokenizer: object
    """The ``tokenizers.Tokenizer``."""
    directory: Path
    eos_id: int | None
    eos_token: str
    vocab_size: int
    """Including added tokens: every id it can produce is below this."""
    digest: str
    """What the token ids depend on (tokenizer.json, the EOS, :data:`FORMAT`), hashed."""


def load_tokenizer(directory: str | Path) -> TextTokenizer:
    """The tokenizer of a directory, parsed once per process while its files stay unchanged:
    every trainer a live switch builds looks its data up again, and parsing a large
    vocabulary's tokenizer.json takes a noticeable fraction of a second."""
    d = Path(directory)
    path = d / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"tokenizer={str(directory)!r} is not a directory with a tokenizer.json "
                        "(a Hugging Face tokenizer or model directory)")
    return _load_tokenizer(d.resolve(), _stamp(path), _stamp(d / "tokenizer_config.json"))


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns


@lru_cache(maxsize=4)
def _load_tokenizer(d: Path, _json_stamp, _config_stamp) -> TextTokenizer:
    from tokenizers import Tokenizer

    path = d / "tokenizer.json"
    raw = path.read_bytes()
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:   # the Rust side's parse errors: name the file, keep its words
        raise DataError(f"{str(path)!r} is not a tokenizer file the tokenizers package can "
                        f"read: {e}") from None
    eos = _eos_token(d, tok)
    eos_id = tok.token_to_id(eos) if eos else None
    digest = hashlib.sha256(raw + f"\0eos={eos}\0format={FORMAT}".encode()).hexdigest()
    return TextTokenizer(tok, d, eos_id, eos or "", tok.get_vocab_size(with_added_tokens=True),
                         digest)


def _eos_token(d: Path, tok) -> str | None:
    config = d / "tokenizer_config.json"
    if config.is_file():
        try:
            value = json.loads(config.read_text()).get("eos_token")
        except (ValueError, AttributeError):
            value = None   # an unreadable config only loses the hint; tokenizer.json rules
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and tok.token_to_id(value) is not None:
            return value
    return next((n for n in EOS_NAMES if tok.token_to_id(n) is not None), None)


def token_dtype(vocab_size: int, requested: str) -> str:
    """``requested``, or uint32 where the vocabulary has ids uint16 cannot hold."""
    if requested not in TOKEN_DTYPES:
        raise DataError(f"dtype={requested!r} is not one of {', '.join(TOKEN_DTYPES)}")
    return "uint32" if vocab_size > UINT16_LIMIT else requested


# -- the cache -----------------------------------------------------------------------------------
def cache_name(text: Path, tok: TextTokenizer, dtype: str, *, where: str = "") -> str:
    """``corpus.jsonl.<tokenizer dir>-<tokenizer hash>.<text key>.<dtype>.tokens``. The text
    key is its size and mtime (hashing a large corpus on every worker start would cost more
    than it saves); ``where`` adds the text's own path for the shared fallback directory."""
    st = text.stat()
    key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:{where}".encode()).hexdigest()[:12]
    label = re.sub(r"[^A-Za-z0-9_-]+", "_", tok.directory.resolve().name)[:40] or "tokenizer"
    return f"{text.name}.{label}-{tok.digest[:12]}.{key}.{dtype}.tokens"


def fallback_dir() -> Path:
    root = os.environ.get("DYNATRAIN_CACHE") or Path.home() / ".cache" / "dynatrain"
    return Path(root) / "tokens"


def cache_candidates(text: Path, tok: TextTokenizer, dtype: str) -> list[Path]:
    """Where the cache of ``text`` may be, preferred first: next to it, then the fallback."""
    return [text.parent / cache_name(text, tok, dtype),
            fallback_dir() / cache_name(text, tok, dtype, where=str(text.resolve()))]


def prepare_text(text: str | Path, tokenizer: str | Path, dtype: str = "uint16", *,
                 out: str | Path | None = None, progress=True) -> Prepared:
    """Tokenise ``text`` with ``tokenizer`` into a flat token file, or find the valid cache.

    ``dtype`` is used unless the vocabulary needs uint32. ``out``: write exactly there (and
    always tokenise) instead of the cache. ``progress``: a text stream for progress lines,
    True for stderr, or None."""
    progress = sys.stderr if progress is True else progress
    text = Path(text)
    if not text.is_file():
        raise DataError(f"text data {str(text)!r} does not exist")
    if text.suffix.lower() not in TEXT_SUFFIXES:
        raise DataError(f"text data {str(text)!r} must end in {' or '.join(TEXT_SUFFIXES)}")
    tok = load_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size, dtype)
    if out is not None:
        target = Path(out)
        target.parent.mkdir(parents=True, exist_ok=True)
        docs, n = _tokenize_to(text, tok, dtype, target, progress)
        return Prepared(target, dtype, n, cached=False, documents=docs)
    candidates = cache_candidates(text, tok, dtype)
    found = _existing(candidates, dtype)
    if found:
        return found
    with _locked(text, progress):
        found = _existing(candidates, dtype)     # tokenised by the process we waited for
        if found:
            return found
        target = candidates[0] if _writable(text.parent) else candidates[1]
        target.parent.mkdir(parents=True, exist_ok=True)
        docs, n = _tokenize_to(text, tok, dtype, target, progress)
        if target == candidates[0]:    # the fallback directory is shared by every corpus
            _drop_stale(target)
    return Prepared(target, dtype, n, cached=False, documents=docs)


def _existing(candidates: list[Path], dtype: str) -> Prepared | None:
    for c in candidates:
        if c.is_file():
            return Prepared(c, dtype, c.stat().st_size // TOKEN_DTYPES[dtype], cached=True)
    return None


def _writable(d: Path) -> bool:
    return os.access(d, os.W_OK | os.X_OK)


def _drop_stale(target: Path) -> None:
    """Remove this text's caches for the same tokenizer and dtype but an older text key: the
    corpus changed, so nothing can use them (a process still reading one keeps its mapping)."""
    stem, _key, dtype = target.name.removesuffix(".tokens").rsplit(".", 2)
    for old in target.parent.glob(f"{glob.escape(stem)}.*.{dtype}.tokens"):
        # (a text key has no dots: the same count means '*' matched exactly one key)
        if old != target and old.name.count(".") == target.name.count("."):
            old.unlink(missing_ok=True)


class _locked:
    """An exclusive ``flock`` on the text while it is tokenised, so concurrent starters wait
    for one tokenisation. Best effort: where the filesystem refuses locks (some network
    filesystems), each process tokenises on its own, which the atomic rename keeps safe."""

    def __init__(self, text: Path, progress):
        self.text, self.progress, self.fd = text, progress, None

    def __enter__(self):
        try:
            self.fd = os.open(self.text, os.O_RDONLY)
        except OSError:
            return self
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if self.progress:
                print(f"waiting for another process tokenising {self.text}", file=self.progress,
                      flush=True)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX)
            except OSError:
                pass
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EBADF, errno.EINVAL, errno.EOPNOTSUPP):
                raise
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)          # closing releases the lock


# -- tokenising ----------------------------------------------------------------------------------
def documents(text: Path) -> Iterator[tuple[str, int]]:
    """(document, bytes of the file read so far), in file order."""
    jsonl = text.suffix.lower() == ".jsonl"
    done = 0
    with open(text, "rb") as f:
        for number, raw in enumerate(f, 1):
            done += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{text}:{number}: not UTF-8 text ({e.reason} at byte "
                                f"{e.start})") from None
            if not line.strip():
                continue
            if not jsonl:
                yield line.rstrip("\r\n"), done
                continue
            try:
                value = json.loads(line)
            except ValueError as e:
                raise DataError(f"{text}:{number}: not JSON ({e}); each line must be an object "
                                'with a "text" field, or a JSON string') from None
            if isinstance(value, dict):
                if "text" not in value:
                    hint = (" (chat conversations: give this source format 'sft')"
                            if "messages" in value else "")
                    raise DataError(f"{text}:{number}: the object has no \"text\" field (its "
                                    f"fields: {', '.join(list(value)[:8]) or 'none'}); each "
                                    'line must be an object with a "text" string, or a JSON '
                                    f"string{hint}")
                value = value["text"]
                if not isinstance(value, str):
                    raise DataError(f"{text}:{number}: \"text\" is a JSON {_json_kind(value)}, "
                                    "not a string")
            elif not isinstance(value, str):
                raise DataError(f"{text}:{number}: a JSON {_json_kind(value)}; each line must "
                                'be an object with a "text" field, or a JSON string')
            if value:                  # an empty document would add only a separator
                yield value, done


def _json_kind(value) -> str:
    """JSON's own name for what ``json.loads`` returned."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
             float: "number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def _tokenize_to(text: Path, tok: TextTokenizer, dtype: str, target: Path,
                 progress) -> tuple[int, int]:
    """Write the token file to ``target`` via a temporary file; (documents, tokens)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    report = _Progress(text, progress)
    docs = tokens = 0
    if tok.eos_id is None and progress:
        print(f"note: tokenizer {str(tok.directory)!r} has no end-of-sequence token; the "
              f"documents of {text} are concatenated without a separator", file=progress)
    try:
        with open(tmp, "wb") as f:
            batch, chars = [], 0
            for doc, done in documents(text):
                batch.append(doc)
                chars += len(doc)
                if chars >= BATCH_CHARS:
                    tokens += _write_batch(f, tok, batch, dtype)
                    docs += len(batch)
                    batch, chars = [], 0
                    report.update(done, tokens)
            if batch:
                tokens += _write_batch(f, tok, batch, dtype)
                docs += len(batch)
            f.flush()
            os.fsync(f.fileno())     # the rename below must never publish unwritten blocks
        if tokens == 0:
            raise DataError(f"text data {str(text)!r} holds no documents (every line is blank)")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    report.finish(f"{docs:,} documents, {tokens:,} tokens ({dtype})", target)
    return docs, tokens


class _Progress:
    """A line on ``stream`` every PROGRESS_BYTES of text or PROGRESS_SECONDS, whichever comes
    first, and a closing line if there was any: short corpora tokenise silently."""

    def __init__(self, text: Path, stream):
        self.text, self.stream = text, stream
        self.total = max(1, text.stat().st_size)
        self.t0 = self.last = time.monotonic()
        self.next_bytes, self.said = PROGRESS_BYTES, False

    def update(self, done: int, tokens: int) -> None:
        now = time.monotonic()
        if not self.stream or (done < self.next_bytes and now - self.last < PROGRESS_SECONDS):
            return
        self.next_bytes, self.last, self.said = done + PROGRESS_BYTES, now, True
        rate = done / (1 << 20) / max(now - self.t0, 1e-9)
        print(f"tokenising {self.text}: {_mib(done)} of {_mib(self.total)} MiB "
              f"({100 * done / self.total:.0f}%), {tokens:,} tokens, {rate:.1f} MiB/s",
              file=self.stream, flush=True)

    def finish(self, what: str, target: Path) -> None:
        if self.stream and self.said:
            print(f"tokenised {self.text}: {what} in {time.monotonic() - self.t0:.1f} s "
                  f"-> {target}", file=self.stream, flush=True)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.{0 if n >= 10 << 20 else 1}f}"


def _write_batch(f, tok: TextTokenizer, batch: list[str], dtype: str) -> int:
    pieces = []
    for enc in tok.tokenizer.encode_batch(batch):
        ids = enc.ids
        if tok.eos_id is not None and (not ids or ids[-1] != tok.eos_id):
            ids = [*ids, tok.eos_id]     # unless the tokenizer's template already ends with it
        pieces.append(np.asarray(ids, dtype=np.int64))
    flat = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    # The dtype was chosen from the vocabulary; a tokenizer producing an id past its own
    # vocabulary would wrap silently on the cast, so it is checked rather than trusted.
    if flat.size and int(flat.max()) >= (1 << (8 * TOKEN_DTYPES[dtype])):
        raise DataError(f"tokenizer {str(tok.directory)!r} produced id {int(flat.max())}, "
                        f"which {dtype} cannot hold; use dtype 'uint32'")
    flat.astype(dtype).tofile(f)
    return int(flat.size)

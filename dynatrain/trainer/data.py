"""Deterministic token streams: the same global sample index gives the same tokens anywhere.

A step consumes the global samples ``[position, position + global_batch_size)``; data-parallel
rank ``j`` takes its contiguous share and cuts it into micro-batches. Because samples are a pure
function of (sources, seed, index), the data position (the next sample index) is all the state
the stream has, and a run resumed under another layout sees exactly the samples it would have.

Sources: a seeded synthetic stream with learnable structure (a sparse Markov chain, so the
loss visibly falls within a few steps); a local file of flat uint16 or uint32 tokens,
memory-mapped (text corpora, Parquet/Arrow files and Hugging Face ``datasets`` directories
become such a file once: :mod:`.textdata`, :mod:`.tables`); SFT conversations rendered with the
tokenizer's chat template and packed into windows with a loss mask (:mod:`.sft`).

Two layers sit between a global sample index and a source's window, both pure functions of
the index, so neither adds state and neither depends on the layout:

- **Shuffling** (:class:`Shuffled`): in epoch ``e = i // windows`` sample ``i`` reads window
  ``perm_e(i mod windows)``, where ``perm_e`` is a keyed Feistel bijection of
  ``[0, windows)`` (:class:`Permutation`, key from (seed, source, e)): every window once per
  epoch, a new order each epoch, O(1) memory whatever the corpus size.
- **Blending** (:class:`Blend`): weights become small integer counts per period (fractions with
  denominators up to 1,000); one period is laid out by smooth weighted round robin (nginx's:
  each source gains its count, the richest is picked and pays the period), so sources
  interleave evenly and every period holds each source exactly its count. Global sample ``i``
  is period ``i // P``, slot ``i mod P``; the source's own sample index is its count times the
  period plus its slots before ``i``'s, so each source is read as its own stream, in order
  (shuffled if asked), with its own epochs.

Samples whose targets are partly masked (SFT) come with a loss mask; :func:`micro_batches`
writes :data:`IGNORE_INDEX` into masked targets, which the loss skips.
"""

from __future__ import annotations

import os
import zlib
from fractions import Fraction
from math import gcd, lcm
from pathlib import Path

import numpy as np
import torch

from .config import TOKEN_DTYPES, DataSource
from .sources import prepare_source
from .textdata import DataError, check_tokens, prepare_data
from .tp import IGNORE_INDEX

__all__ = ["SyntheticTokens", "FileTokens", "Permutation", "Shuffled", "BlendSchedule", "Blend",
           "token_source", "prepare_data", "micro_batches", "DataError", "IGNORE_INDEX"]

class SyntheticTokens:
    """A seeded sparse Markov chain over the first ``min(vocab, 512)`` token ids: every token
    has 4 likely successors (probabilities .5/.25/.15/.1, drawn once from ``seed``) and 5% of
    tokens are uniform noise. Sample ``i`` is a walk from a random start, drawn from a generator
    seeded by (seed, i). A model first learns which ids occur, then the successor table, so the
    loss falls visibly from ln(vocab) within a few steps."""

    ALPHABET = 512
    SUCCESSORS = 4
    WEIGHTS = torch.tensor([0.5, 0.25, 0.15, 0.1])
    NOISE = 0.05

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.alphabet = min(vocab_size, self.ALPHABET)
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:successors".encode()))
        table = torch.randint(self.alphabet, (self.alphabet, self.SUCCESSORS), generator=g)
        self.successors = table.tolist()

    def sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{index}".encode()))
        n = self.seq_len + 1
        choice = torch.multinomial(self.WEIGHTS, n, replacement=True, generator=g).tolist()
        noise = (torch.rand(n, generator=g) < self.NOISE).tolist()
        random = torch.randint(self.alphabet, (n,), generator=g).tolist()
        tokens = [random[0]]
        for k in range(1, n):
            tokens.append(random[k] if noise[k] else self.successors[tokens[-1]][choice[k]])
        return torch.tensor(tokens)


class FileTokens:
    """Sample ``i``: ``seq_len + 1`` consecutive tokens of a flat ``dtype`` file starting at
    token ``(i mod windows) * seq_len``, where ``windows = (tokens - 1) // seq_len``: windows
    overlap by the one token that is both the last target of one and the first input of the
    next, and the stream wraps around after the last whole window."""

    def __init__(self, path: str, vocab_size: int, seq_len: int, dtype: str = "uint16", *,
                 source: str = ""):
        if dtype not in TOKEN_DTYPES:
            raise DataError(f"token dtype {dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
        size = os.stat(path).st_size
        width = TOKEN_DTYPES[dtype]
        if size % width:
            raise DataError(f"token file {path!r} is {size:,} bytes, not a whole number of "
                            f"{dtype} tokens ({width} bytes each): is the dtype right?")
        if size // width < seq_len + 1:
            raise DataError(f"token file {path!r} holds {size // width:,} tokens, fewer than "
                            f"seq_len+1 = {seq_len + 1}")
        self.path, self.dtype, self.seq_len = path, dtype, seq_len
        self.tokens = np.memmap(Path(path), dtype=np.dtype(dtype), mode="r")
        self.windows = (len(self.tokens) - 1) // seq_len
        check_tokens(path, dtype, vocab_size, source=source)

    def sample(self, index: int) -> torch.Tensor:
        start = (index % self.windows) * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))


class Permutation:
    """A seeded bijection of ``[0, n)``: a 6-round Feistel network on the smallest even number
    of bits covering ``n``, its round function a SplitMix64 hash of (key, round, half), with
    cycle walking (apply again until the value falls below ``n``; the domain is under 4n, so
    under 4 tries on average). Any key gives a permutation; different keys, different orders."""

    ROUNDS = 6

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        bits = max(2, (n - 1).bit_length())
        self.n, self.half = n, (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = [_mix(key * 0x100 + r) for r in range(self.ROUNDS)]

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} outside [0, {self.n})")
        x = self._round_trip(i)
        while x >= self.n:
            x = self._round_trip(x)
        return x

    def _round_trip(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(k ^ right) & self.mask)
        return (left << self.half) | right


_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a 64-bit hash whose every output bit depends on every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Shuffled:
    """``source`` read in a seeded order: sample ``i`` is window ``perm_e(i mod windows)`` of
    epoch ``e = i // windows``, with a fresh permutation per epoch."""

    def __init__(self, source, seed: int, salt: int = 0):
        if not source.windows:
            raise DataError("only a source with a finite number of windows can be shuffled")
        self.source, self.windows = source, source.windows
        self.key = _mix(_mix(seed) ^ salt)
        self.masked = getattr(source, "masked", False)

    def window_of(self, index: int) -> int:
        epoch, i = divmod(index, self.windows)
        return Permutation(self.windows, _mix(self.key ^ epoch))(i)   # (6 hashes to build)

    def example(self, index: int):
        return example(self.source, self.window_of(index))


class BlendSchedule:
    """Global sample index -> (source, that source's own sample index), for weights given as
    positive numbers (any scale: only their ratios count)."""

    MAX_PERIOD = 1_000_000

    def __init__(self, weights):
        if not weights or any(not w > 0 for w in weights):
            raise DataError(f"blend weights {list(weights)} must be positive numbers")
        total = sum(weights)
        fractions = [Fraction(w / total).limit_denominator(1000) for w in weights]
        if any(f == 0 for f in fractions):
            raise DataError(f"blend weights {list(weights)}: a share below 1/1000 of the blend "
                            "rounds to nothing; raise it or drop that source")
        scale = lcm(*(f.denominator for f in fractions))
        counts = [int(f * scale) for f in fractions]
        common = gcd(*counts)
        self.counts = [c // common for c in counts]
        self.period = sum(self.counts)
        if self.period > self.MAX_PERIOD:
            raise DataError(f"blend weights {list(weights)} need a period of {self.period:,} "
                            f"samples (over {self.MAX_PERIOD:,}); use rounder ratios")
        current, self.pattern, self.rank = [0] * len(self.counts), [], []
        seen = [0] * len(self.counts)
        for _ in range(self.period):             # smooth weighted round robin
            current = [c + n for c, n in zip(current, self.counts)]
            pick = current.index(max(current))
            current[pick] -= self.period
            self.pattern.append(pick)
            self.rank.append(seen[pick])
            seen[pick] += 1

    def __call__(self, index: int) -> tuple[int, int]:
        period, slot = divmod(index, self.period)
        s = self.pattern[slot]
        return s, period * self.counts[s] + self.rank[slot]


class Blend:
    """Several sources interleaved by :class:`BlendSchedule`."""

    windows = None

    def __init__(self, sources: list, weights):
        self.sources, self.schedule = sources, BlendSchedule(weights)
        self.masked = any(getattr(s, "masked", False) for s in sources)

    def example(self, index: int):
        s, k = self.schedule(index)
        return example(self.sources[s], k)


def example(source, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens (T+1,), loss mask over the T targets or None for all) of sample ``index``."""
    if hasattr(source, "example"):
        return source.example(index)
    return source.sample(index), None


def _one_source(s: DataSource, config, salt: int):
    """One source of ``config``'s data, shuffled if the config asks."""
    if s.path == "synthetic":
        # Synthetic samples are already independent seeded draws per index: there is no file
        # order to shuffle, so `shuffle` leaves them as they are (documented in the config).
        return SyntheticTokens(config.model.vocab_size, config.seq_len, config.seed)
    fmt, path, dtype = prepare_source(s, config)
    if fmt == "sft":
        from .sft import SFTWindows

        source = SFTWindows(path, config.tokenizer, config.seq_len, config.model.vocab_size)
    else:
        what = f"{s.path} with {config.tokenizer}" if config.tokenizer and fmt != "tokens" else ""
        source = FileTokens(path, config.model.vocab_size, config.seq_len, dtype, source=what)
    if config.shuffle:
        seed = config.seed if config.shuffle_seed is None else config.shuffle_seed
        source = Shuffled(source, seed, salt)
    return source


def token_source(config):
    """The sample stream of a :class:`~dynatrain.trainer.config.TrainConfig`: its one source,
    or the blend of its sources, each shuffled when ``config.shuffle``. Text, tables and SFT
    conversations are prepared here if no process did it before (see
    :func:`~dynatrain.trainer.sources.prepare_source`)."""
    sources = config.sources
    if len(sources) == 1:
        return _one_source(sources[0], config, salt=0)
    return Blend([_one_source(s, config, salt=n) for n, s in enumerate(sources)],
                 [s.weight for s in sources])


def micro_batches(source, position: int, global_batch: int, dp: int, dp_index: int,
                  micro_batch: int, shares: tuple[int, ...] | None = None
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's (inputs, targets) micro-batches of the step starting at ``position``;
    masked targets (SFT: everything but the assistant's tokens) are :data:`IGNORE_INDEX`.
    ``shares``: micro-batches per DP rank when uneven (the layout's), else an even split;
    either way rank ``j`` takes the run of the global batch after ranks ``0..j-1``'s."""
    counts = shares or (global_batch // (dp * micro_batch),) * dp
    first = position + sum(counts[:dp_index]) * micro_batch
    out = []
    for m in range(counts[dp_index]):
        rows = [example(source, first + m * micro_batch + i) for i in range(micro_batch)]
        batch = torch.stack([tokens for tokens, _ in rows])     # (mb, T+1)
        targets = batch[:, 1:].clone()
        for row, (_, keep) in enumerate(rows):
            if keep is not None:
                targets[row][~keep] = IGNORE_INDEX
        out.append((batch[:, :-1].contiguous(), targets))
    return out

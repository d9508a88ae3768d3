"""Deterministic token streams: the same global sample index gives the same tokens anywhere.

A step consumes the global samples ``[position, position + global_batch_size)``; data-parallel
rank ``j`` takes its contiguous share and cuts it into micro-batches. Because samples are a pure
function of (source, seed, index), the data position (the next sample index) is all the state
the stream has, and a run resumed under another layout sees exactly the samples it would have.

Two sources: a seeded synthetic stream with learnable structure (a sparse Markov chain, so the
loss visibly falls within a few steps), and a local file of flat uint16 or uint32 tokens,
memory-mapped (a text corpus becomes such a file once, :mod:`.textdata`).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import torch

from .config import TOKEN_DTYPES
from .textdata import DataError, check_tokens, is_text, prepare_data

__all__ = ["SyntheticTokens", "FileTokens", "token_source", "prepare_data", "micro_batches",
           "DataError"]


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


def token_source(config):
    """The token stream of a :class:`~dynatrain.trainer.config.TrainConfig`: the synthetic
    stream, a token file, or a text corpus's cached token file (tokenised here if no process
    did it before, see :func:`prepare_data`)."""
    if config.data == "synthetic":
        return SyntheticTokens(config.model.vocab_size, config.seq_len, config.seed)
    path, dtype = prepare_data(config)
    source = f"{config.data} with {config.tokenizer}" if is_text(config.data) else ""
    return FileTokens(path, config.model.vocab_size, config.seq_len, dtype, source=source)


def micro_batches(source, position: int, global_batch: int, dp: int, dp_index: int,
                  micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's (inputs, targets) micro-batches of the step starting at ``position``."""
    per_rank = global_batch // dp
    first = position + dp_index * per_rank
    out = []
    for m in range(per_rank // micro_batch):
        rows = [source.sample(first + m * micro_batch + i) for i in range(micro_batch)]
        batch = torch.stack(rows)                       # (mb, T+1)
        out.append((batch[:, :-1].contiguous(), batch[:, 1:].contiguous()))
    return out

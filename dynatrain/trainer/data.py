"""Deterministic token streams: the same global sample index gives the same tokens anywhere.

A step consumes the global samples ``[position, position + global_batch_size)``; data-parallel
rank ``j`` takes its contiguous share and cuts it into micro-batches. Because samples are a pure
function of (source, seed, index), the data position (the next sample index) is all the state
the stream has, and a run resumed under another layout sees exactly the samples it would have.

Two sources: a seeded synthetic stream with learnable structure (a sparse Markov chain, so the
loss visibly falls within a few steps), and a local file of flat uint16 tokens.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch


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
    """Sample ``i``: ``seq_len + 1`` consecutive tokens from a flat uint16 file, wrapping."""

    def __init__(self, path: str, vocab_size: int, seq_len: int):
        self.tokens = np.memmap(Path(path), dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.windows = (len(self.tokens) - 1) // seq_len
        top = int(self.tokens.max()) if len(self.tokens) else 0
        if top >= vocab_size:
            raise ValueError(f"token file {path!r} holds token id {top}, outside the model's "
                             f"vocabulary of {vocab_size}")

    def sample(self, index: int) -> torch.Tensor:
        start = (index % self.windows) * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))


def token_source(data: str, vocab_size: int, seq_len: int, seed: int):
    if data == "synthetic":
        return SyntheticTokens(vocab_size, seq_len, seed)
    return FileTokens(data, vocab_size, seq_len)


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

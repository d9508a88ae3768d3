"""What to train: model, layout, batch geometry, optimizer and data, validated up front.

A :class:`TrainConfig` is checked completely (layout against model, batch divisibility, data
source) before any process or process group exists, so a job that cannot run fails with one
message naming every problem.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dynatrain.vps.layout import Layout, LayoutError, layout_problems, parse_layout
from dynatrain.vps.model import ModelSpec
from dynatrain.vps.presets import load_model


class ConfigError(ValueError):
    """A training configuration cannot run; the message names every problem."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: ModelSpec
    layout: Layout
    global_batch_size: int = 8
    """Sequences per optimizer step, whatever the layout (micro-batches per rank adapt)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch on one data-parallel rank."""
    seq_len: int = 0
    """Tokens per sequence; 0 means min(model.max_seq_len, 128)."""
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Applied to matrices (2-d and up); norms and biases are not decayed."""
    seed: int = 0
    """Seeds initialisation and the synthetic data stream."""
    data: str = "synthetic"
    """``synthetic`` or the path of a flat uint16 token file."""

    def __post_init__(self) -> None:
        if self.seq_len == 0:
            object.__setattr__(self, "seq_len", min(self.model.max_seq_len, 128))
        problems = config_problems(self)
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def micro_batches_per_rank(self) -> int:
        return self.global_batch_size // (self.layout.dp * self.micro_batch_size)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def with_layout(self, layout: Layout) -> "TrainConfig":
        return replace(self, layout=layout)


def config_problems(c: TrainConfig) -> list[str]:
    p = list(layout_problems(c.layout, c.model))
    if p:
        p = [f"layout {c.layout.to_text()!r} does not fit {c.model.name}: " + "; ".join(p)]
    if c.global_batch_size < 1 or c.micro_batch_size < 1:
        p.append(f"global_batch_size={c.global_batch_size} and micro_batch_size="
                 f"{c.micro_batch_size} must be positive")
    elif c.global_batch_size % (c.layout.dp * c.micro_batch_size):
        p.append(f"global_batch_size={c.global_batch_size} must be a multiple of dp * "
                 f"micro_batch_size = {c.layout.dp} * {c.micro_batch_size}")
    if not 1 <= c.seq_len <= c.model.max_seq_len:
        p.append(f"seq_len={c.seq_len} must be in 1..{c.model.max_seq_len} "
                 f"(max_seq_len of {c.model.name})")
    if c.lr <= 0:
        p.append(f"lr={c.lr} must be positive")
    if c.data != "synthetic":
        from pathlib import Path

        path = Path(c.data)
        if not path.is_file():
            p.append(f"data={c.data!r} is neither 'synthetic' nor an existing token file")
        elif path.stat().st_size < 2 * (c.seq_len + 1):
            p.append(f"data file {c.data!r} holds fewer than seq_len+1 = {c.seq_len + 1} tokens")
    return p


def make_config(model: str, layout: str, **kw) -> TrainConfig:
    """A config from CLI-style strings (model preset or spec file, layout text)."""
    try:
        return TrainConfig(model=load_model(model), layout=parse_layout(layout), **kw)
    except LayoutError as e:
        raise ConfigError(str(e)) from None

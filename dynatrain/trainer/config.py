"""What to train: model, layout, batch geometry, optimizer and data, validated up front.

A :class:`TrainConfig` is checked completely (layout against model, batch divisibility, data
source) before any process or process group exists, so a job that cannot run fails with one
message naming every problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from dynatrain.vps.layout import (Layout, LayoutError, layout_problems, micro_batch_shares,
                                  parse_layout)
from dynatrain.vps.model import ModelSpec
from dynatrain.vps.presets import load_model

from .schedule import LRSchedule

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}
"""``--precision`` / ``spec.training.precision``: the working parameters' dtype (compute);
master weights and AdamW moments are float32 either way."""
TOKEN_DTYPES = {"uint16": 2, "uint32": 4}
"""Flat token file dtypes and their bytes per token."""
TEXT_SUFFIXES = (".jsonl", ".txt")
TABLE_SUFFIXES = (".parquet", ".arrow")
DATA_FORMATS = ("auto", "tokens", "text", "table", "sft")
"""How a data path is read: ``tokens`` (a flat token file), ``text`` (.jsonl/.txt tokenised
once), ``table`` (a Parquet or Arrow file, or a directory saved by Hugging Face ``datasets``,
with a ``text`` or ``input_ids`` column), ``sft`` (.jsonl conversations, ``messages``, rendered
with the tokenizer's chat template, loss on the assistant's tokens only); ``auto`` tells the
first three apart by the path (SFT is never guessed)."""


@dataclass(frozen=True, kw_only=True)
class DataSource:
    """One source of a blend (``spec.training.data: [{path, weight, format}, ...]``)."""

    path: str
    weight: float = 1.0
    """Its share of the samples, relative to the others' weights."""
    format: str = "auto"
    """One of :data:`DATA_FORMATS`."""

    @property
    def kind(self) -> str:
        """The format, ``auto`` resolved from the path (``synthetic`` for the synthetic stream)."""
        return data_format(self.path, self.format)


def is_hf_dataset_dir(path: Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (a Dataset's ``state.json``, a
    DatasetDict's ``dataset_dict.json``)."""
    return path.is_dir() and any((path / f).is_file() for f in ("state.json",
                                                                 "dataset_dict.json"))


def data_format(path: str, fmt: str = "auto") -> str:
    if path == "synthetic":
        return "synthetic"
    if fmt != "auto":
        return fmt
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix in TABLE_SUFFIXES or is_hf_dataset_dir(p):
        return "table"
    return "tokens"


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
    """``synthetic``, the path of a flat token file (``data_dtype``), or a text file
    (``.jsonl``/``.txt``) that ``tokenizer`` turns into a cached token file once."""
    data_format: str = "auto"
    """How ``data`` is read: one of :data:`DATA_FORMATS`."""
    data_blend: tuple[DataSource, ...] = ()
    """Several sources mixed by weight (:class:`~dynatrain.trainer.data.Blend`); when given,
    ``data`` stays ``synthetic`` and names nothing."""
    shuffle: bool = False
    """Read each file source's windows in a seeded order, a new one each epoch
    (:class:`~dynatrain.trainer.data.Shuffled`); the synthetic stream is already a sequence
    of independent seeded draws and is left as it is."""
    shuffle_seed: int | None = None
    """The shuffle's seed; None: ``seed``."""
    data_dtype: str = "uint16"
    """``uint16`` or ``uint32`` (vocabularies over 65,536 tokens need uint32). For text data,
    the cached token file's dtype: uint32 regardless where the tokenizer's vocabulary needs it."""
    tokenizer: str = ""
    """A Hugging Face tokenizer directory (``tokenizer.json``), for text, tables with a
    ``text`` column and SFT conversations (its ``chat_template``)."""
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    """Warmup and decay; ``lr`` is the peak. ``decay_steps`` 0 means :attr:`total_steps`."""
    total_steps: int = 0
    """The job's planned steps (where a schedule with ``decay_steps`` 0 ends); 0: unknown."""
    grad_clip: float = 0.0
    """Clip the gradient to this global L2 norm (over every shard once); 0: no clipping."""
    init_hf: str = ""
    """A Hugging Face checkpoint directory whose weights start the run (``hf:DIR`` models);
    empty: seeded random initialisation."""
    activation_checkpointing: bool = False
    """Keep only each transformer block's input for the backward pass and recompute the block
    there (``spec.training.activationCheckpointing``): activations per micro-batch shrink from
    a block's worth per layer to one hidden state per layer, for one more forward pass. The
    recomputation repeats the same arithmetic, so losses and gradients are bit-identical."""

    def __post_init__(self) -> None:
        if self.seq_len == 0:
            object.__setattr__(self, "seq_len", min(self.model.max_seq_len, 128))
        problems = config_problems(self)
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def micro_batch_shares(self) -> tuple[int, ...]:
        """Micro-batches of each data-parallel rank in one step (the layout's shares, or even)."""
        return micro_batch_shares(self.layout, self.global_batch_size, self.micro_batch_size)

    @property
    def sources(self) -> tuple[DataSource, ...]:
        """The data's sources: the blend, or ``data`` alone."""
        return self.data_blend or (DataSource(path=self.data, format=self.data_format),)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def with_layout(self, layout: Layout) -> "TrainConfig":
        return replace(self, layout=layout)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        return self.lr_schedule.resolved(self.total_steps).lr(self.lr, step)


def config_problems(c: TrainConfig) -> list[str]:
    p = list(layout_problems(c.layout, c.model))
    if p:
        p = [f"layout {c.layout.to_text()!r} does not fit {c.model.name}: " + "; ".join(p)]
    if c.global_batch_size < 1 or c.micro_batch_size < 1:
        p.append(f"global_batch_size={c.global_batch_size} and micro_batch_size="
                 f"{c.micro_batch_size} must be positive")
    else:
        try:
            micro_batch_shares(c.layout, c.global_batch_size, c.micro_batch_size)
        except LayoutError as e:
            p.append(str(e))
    if not 1 <= c.seq_len <= c.model.max_seq_len:
        p.append(f"seq_len={c.seq_len} must be in 1..{c.model.max_seq_len} "
                 f"(max_seq_len of {c.model.name})")
    if c.lr <= 0:
        p.append(f"lr={c.lr} must be positive")
    if c.lr_schedule.min_lr > c.lr:
        p.append(f"the schedule's min_lr={c.lr_schedule.min_lr} exceeds the peak lr={c.lr}")
    if not isinstance(c.activation_checkpointing, bool):
        p.append(f"activation_checkpointing={c.activation_checkpointing!r} must be true or false")
    if c.grad_clip < 0:
        p.append(f"grad_clip={c.grad_clip} must be >= 0 (0: no clipping)")
    if c.data_dtype not in TOKEN_DTYPES:
        p.append(f"data_dtype={c.data_dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
    p += data_problems(c.sources, c.data_dtype, c.tokenizer, c.model, c.seq_len)
    if c.data_blend and c.data != "synthetic":
        p.append(f"data={c.data!r} and a blend of {len(c.data_blend)} sources: give one or "
                 "the other")
    if c.tokenizer and not (Path(c.tokenizer) / "tokenizer.json").is_file():
        p.append(f"tokenizer={c.tokenizer!r} is not a directory with a tokenizer.json")
    if c.init_hf and not (Path(c.init_hf) / "config.json").is_file():
        p.append(f"init_hf={c.init_hf!r} is not a Hugging Face checkpoint directory "
                 "(no config.json)")
    return p


def data_problems(sources, dtype: str, tokenizer: str, model: ModelSpec | None,
                  seq_len: int = 0, where: str = "data") -> list[str]:
    """Everything wrong with a list of data sources that can be seen without reading them."""
    p = []
    for n, s in enumerate(sources):
        at = f"{where}[{n}]" if len(sources) > 1 else where
        if s.format not in DATA_FORMATS:
            p.append(f"{at}: format={s.format!r} is not one of {', '.join(DATA_FORMATS)}")
            continue
        if not isinstance(s.weight, (int, float)) or not s.weight > 0:
            p.append(f"{at}: weight={s.weight!r} must be a positive number")
        if s.path == "synthetic":
            continue
        kind, path = s.kind, Path(s.path)
        if not (path.is_file() or (kind == "table" and is_hf_dataset_dir(path))):
            what = "a Hugging Face datasets directory" if kind == "table" else "a file"
            p.append(f"{at}: {s.path!r} is neither 'synthetic' nor an existing {what}")
        elif kind in ("text", "sft") and not tokenizer:
            p.append(f"{at}: {s.path!r} is {kind}; it needs a tokenizer directory "
                     "(--tokenizer / spec.training.data.tokenizer)")
        elif kind == "sft" and path.suffix.lower() != ".jsonl":
            p.append(f"{at}: SFT data {s.path!r} must be a .jsonl file of {{\"messages\": "
                     "[...]} lines")
        elif (kind == "tokens" and seq_len
              and path.stat().st_size < TOKEN_DTYPES.get(dtype, 2) * (seq_len + 1)):
            p.append(f"data file {s.path!r} holds fewer than seq_len+1 = {seq_len + 1} tokens")
        if (kind in ("tokens", "table") and dtype == "uint16" and model is not None
                and model.vocab_size > 1 << 16):
            # (text and SFT: the cached token file's dtype follows the tokenizer's vocabulary)
            p.append(f"data_dtype='uint16' cannot hold the ids of {model.name}'s "
                     f"{model.vocab_size:,}-token vocabulary; use 'uint32'")
    return p


def with_precision(model: ModelSpec, precision: str | None) -> ModelSpec:
    """``model`` computing in ``precision`` (``fp32``/``bf16``); None or "" keeps its dtype."""
    if not precision:
        return model
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    return replace(model, dtype=PRECISIONS[precision])


def make_config(model: str, layout: str, *, precision: str | None = None, **kw) -> TrainConfig:
    """A config from CLI-style strings: a preset, a spec file or ``hf:DIR`` (whose weights then
    start the run), and layout text."""
    try:
        spec = with_precision(load_model(model), precision)
        if model.startswith("hf:"):
            kw.setdefault("init_hf", model[3:])
        return TrainConfig(model=spec, layout=parse_layout(layout), **kw)
    except LayoutError as e:
        raise ConfigError(str(e)) from None

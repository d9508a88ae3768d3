"""Evaluation: a model's mean next-token loss over the first N samples of a data source, under
any layout.

Sample ``i`` is the window the training stream would give it (:mod:`.data`: tokens
``[i*S, i*S + S + 1)`` of a token file), so a loss measured here is directly comparable with
the training loss on the same data. The model is a :class:`.Trainer`'s (weights allocated from
the VPS mapping, from a Hugging Face checkpoint for ``hf:`` models, AdamW moments never
allocated: they only appear at the first optimizer step) and its forward is the training
step's: embedding on the first pipeline stage, activations to the next stage by ``pp``
send/recv, ``StageModel.loss`` on the last; only no gradients and no optimizer.

The mean is exact over the N sequences whatever the layout: each DP rank takes a contiguous
share of the samples (the first ``N % dp`` ranks one more), its last stage sums per-token
losses in float64, and one all-reduce adds sums and token counts. Every DP rank runs the same
number of fixed-shape micro-batches, padding its last ones with rows it does not count: pipeline
receivers must know the activation shape, and the expert-parallel all-to-alls of an EP group
(whose members are DP ranks) need every member in every exchange.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dynatrain.vps.abandon import wait
from dynatrain.vps.layout import bind, parse_layout

from .config import ConfigError, TrainConfig, make_config
from .data import example, token_source
from .groups import build_groups
from .launch import DEFAULT_TIMEOUT_S, pick_backend, run_ranks
from .textdata import is_text
from .tp import IGNORE_INDEX
from .trainer import Trainer


@dataclass(frozen=True)
class EvalResult:
    model: str
    layout: str
    world: int
    backend: str
    loss: float
    """Mean cross-entropy (nats) over every predicted token of the ``sequences`` samples that
    training would learn from (SFT data: the assistant's tokens only)."""
    sequences: int
    tokens: int
    """Predicted tokens counted: ``sequences * seq_len``, less the masked ones (SFT)."""
    seconds: float
    """The forward passes on rank 0, without process start-up and weight loading."""

    def to_json(self) -> dict:
        return {"loss": self.loss, "sequences": self.sequences}


def eval_config(model: str, layout: str, *, seq_len: int = 0, micro_batch_size: int = 1,
                precision: str | None = None, data: str = "synthetic",
                data_dtype: str = "uint16", tokenizer: str = "", seed: int = 0) -> TrainConfig:
    """The configuration an evaluation runs under, validated like a training one.

    The global batch size means nothing here (:func:`evaluate` takes the sample count); it is
    set to one micro-batch per DP rank so that the training config's divisibility check holds.
    """
    dp = parse_layout(layout).dp
    return make_config(model, layout, precision=precision, seq_len=seq_len,
                       micro_batch_size=micro_batch_size,
                       global_batch_size=dp * max(micro_batch_size, 1), data=data,
                       data_dtype=data_dtype, tokenizer=tokenizer, seed=seed)


def source_windows(config: TrainConfig) -> int | None:
    """Samples the data source holds (a window needs ``seq_len + 1`` tokens), or None for the
    unbounded synthetic stream. Opening the source here, before any rank starts, reports a bad
    file (size, dtype, token ids outside the vocabulary) as one line, and tokenises a text
    corpus once: the ranks then only find the cache."""
    return getattr(token_source(config), "windows", None)


def sequences_problem(config: TrainConfig, sequences: int, windows: int | None) -> str:
    """Why ``sequences`` samples cannot be evaluated from a source of ``windows``, or ""."""
    if sequences < 1:
        return f"sequences={sequences} must be >= 1"
    if windows is not None and sequences > windows:
        what = f"{config.data!r}" + (" (tokenised)" if is_text(config.data) else "")
        return (f"sequences={sequences} is more than {what} holds: {windows} "
                f"windows of seq_len+1 = {config.seq_len + 1} tokens (sample i starts at token "
                f"i*{config.seq_len}); use --sequences {windows} or less, or a shorter --seq-len")
    return ""


def dp_share(sequences: int, dp: int, dp_index: int) -> range:
    """The contiguous global samples DP rank ``dp_index`` evaluates; the first
    ``sequences % dp`` ranks take one more."""
    base, extra = divmod(sequences, dp)
    start = dp_index * base + min(dp_index, extra)
    return range(start, start + base + (dp_index < extra))


@torch.no_grad()
def evaluate(trainer: Trainer, sequences: int) -> tuple[float, int]:
    """(mean loss, tokens counted) of samples ``0 .. sequences-1`` of ``trainer.source``.

    Collective: every rank of the trainer's layout calls it, and all get the same result. It
    reads the trainer's weights and data source and changes neither (no data position, no RNG).
    """
    cfg, g, stage, lay = trainer.cfg, trainer.g, trainer.stage, trainer.lay
    mb, seq_len, device = cfg.micro_batch_size, cfg.seq_len, trainer.device
    # A token file's stream wraps around after its last window; evaluation must not, or the
    # mean would count some samples twice.
    problem = sequences_problem(cfg, sequences, getattr(trainer.source, "windows", None))
    if problem:
        raise ConfigError(problem)
    share = dp_share(sequences, lay.dp, g.dp_index)
    # Every DP rank runs as many micro-batches as the largest share needs (see the module note).
    rounds = -(-len(dp_share(sequences, lay.dp, 0)) // mb)
    gathered = trainer.zero == 3 and not trainer.working
    if gathered:
        trainer._gather_zero3()              # ZeRO-3 keeps only flat shards at rest
    w = trainer.working
    total = torch.zeros((), dtype=torch.float64, device=device)
    counted = rows_counted = 0
    try:
        for m in range(rounds):
            first = share.start + m * mb
            valid = max(0, min(mb, share.stop - first))
            inputs = targets = None
            if g.first_stage or g.last_stage:
                # Padding rows are token 0 (in every vocabulary); their losses are not counted.
                # Masked targets (SFT: all but the assistant's tokens) are not either, as in
                # training: the loss gives them 0 and the count leaves them out.
                rows = [example(trainer.source, first + r) if r < valid
                        else (torch.zeros(seq_len + 1, dtype=torch.long), None)
                        for r in range(mb)]
                batch = torch.stack([tokens for tokens, _ in rows])   # (mb, T+1)
                targets = batch[:, 1:].clone()
                for row, (_, keep) in enumerate(rows):
                    if keep is not None:
                        targets[row][~keep] = IGNORE_INDEX
                batch, targets = batch.to(device), targets.to(device)
                inputs = batch[:, :-1]
            if g.first_stage:
                x = stage.embed(inputs, w)
            else:
                x = torch.empty((mb, seq_len, trainer.model.hidden_size), dtype=trainer.dtype,
                                device=device)
                wait(g.pp.recv([x], g.pp_index - 1, 0))
            y = stage.blocks(x, w)
            if g.last_stage:
                losses = stage.loss(y, targets, w, reduction="none").view(mb, seq_len)
                total += losses[:valid].double().sum()
                counted += int((targets[:valid] != IGNORE_INDEX).sum())
                rows_counted += valid
            else:
                wait(g.pp.send([y.contiguous()], g.pp_index + 1, 0))
    finally:
        if gathered:
            trainer.working = {}
    # One rank per (dp, tp) position's last stage speaks for it: TP ranks hold the same loss.
    report = torch.zeros(3, dtype=torch.float64, device=device)
    if g.last_stage and g.tp_index == 0:
        report[0], report[1], report[2] = total, counted, rows_counted
    if g.world is not None:
        wait(dist.all_reduce(report, group=g.world, async_op=True))
    tokens, samples = int(report[1]), int(report[2])
    if samples != sequences:                 # every sample counted once, whatever the layout
        raise RuntimeError(f"evaluation counted {samples} sequences, expected {sequences}")
    if tokens == 0:
        raise ConfigError(f"evaluation of {sequences} sequences found no target to score: "
                          "every one is masked (SFT data without assistant tokens?)")
    return float(report[0]) / tokens, tokens


def _eval_rank(rank: int, device: torch.device, results, config: TrainConfig,
               sequences: int) -> None:
    trainer = Trainer(config, build_groups(bind(config.layout, config.model), rank),
                      device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    loss, tokens = evaluate(trainer, sequences)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if rank == 0:
        results.put(("loss", (loss, tokens, time.perf_counter() - t0)))


def run_eval(config: TrainConfig, sequences: int, *, backend: str = "auto",
             timeout_s: float = DEFAULT_TIMEOUT_S) -> EvalResult:
    """Evaluate samples ``0 .. sequences-1`` with one process per rank on this machine."""
    problem = sequences_problem(config, sequences, source_windows(config))
    if problem:
        raise ConfigError(problem)
    world = config.layout.world
    backend = pick_backend(backend, world)
    out = {}

    def on_message(kind, payload):
        out["loss"], out["tokens"], out["seconds"] = payload

    run_ranks(_eval_rank, (config, sequences), world=world, backend=backend, messages=1,
              on_message=on_message, what=f"evaluation under {config.layout.to_text()}",
              timeout_s=timeout_s)
    return EvalResult(config.model.name, config.layout.to_text(), world, backend, out["loss"],
                      sequences, out["tokens"], out["seconds"])

"""What a job tells the people watching it, from the worker that is its rank 0: step lines in
the log, and TensorBoard event files.

Every rank learns the step's loss (the step's own all-reduce) and every rank knows each switch,
so any could say them; exactly one does, the job's **rank 0** of the running layout, so that
``kubectl logs`` of that pod reads as the job's story and a TensorBoard directory holds one
curve. A switch can make another device rank 0: the old one stops at that step boundary and the
new one goes on from the next step.

- **Log lines** (stdout, so ``kubectl logs`` and the local runner's worker logs show them): a
  step line every ``log_every`` steps (loss, learning rate, gradient norm, tokens/s, modelled
  MFU, layout, and the step's split into compute, communication and redundancy), and one line
  per switch or recovery (reason, layouts, step, pause).
- **TensorBoard** (``spec.output.tensorboard``, default ``<checkpoint path>/<job>/tensorboard``):
  scalars ``train/loss``, ``train/learning_rate``, ``train/grad_norm``,
  ``train/tokens_per_second`` and ``train/mfu`` at every step; each switch or recovery as a
  text marker under ``events`` (reason, layouts, pause) and a scalar ``events/pause_ms`` at
  its step, so a curve shows where the layout changed and what it cost.

Each tenure as rank 0 writes its own event file, opened when the tenure starts and closed when
it ends: TensorBoard reads a directory's files in name order, which starts with the creation
time, so the files follow one another as the tenures did. A recovery that goes back to an
older step writes a session restart at the step after the restored one; TensorBoard's reader
then drops every tag's points from that step on (its "orphaned data" purge), so the curve shows
each step once, as trained last.
"""

from __future__ import annotations

import time
from pathlib import Path


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


class TrainingLog:
    """The job's step lines and TensorBoard events, written while this worker is rank 0."""

    def __init__(self, job_name: str, device: int, *, steps: int, log_every: int = 10,
                 tensorboard_dir: str = "", out=print):
        if log_every < 1:
            raise ValueError(f"log_every={log_every} must be >= 1 (spec.output.logEverySteps)")
        self.job_name, self.device, self.steps = job_name, device, steps
        self.log_every = log_every
        self.tensorboard_dir = tensorboard_dir
        self.out = out
        self._writer = None
        self._t0 = time.monotonic()

    # -- tenure ------------------------------------------------------------------------------
    def _tb(self):
        """This tenure's event writer (opened on first use), or None without a directory."""
        if not self.tensorboard_dir:
            return None
        if self._writer is None:
            # Imported here: only a worker that writes events pays for tensorboard's import.
            from torch.utils.tensorboard import SummaryWriter

            Path(self.tensorboard_dir).mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(self.tensorboard_dir, flush_secs=5)
        return self._writer

    def end_tenure(self) -> None:
        """This worker is no longer rank 0 (or is stopping): flush and close its event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    close = end_tenure

    # -- what is said ------------------------------------------------------------------------
    def step(self, *, step: int, loss: float, learning_rate: float, grad_norm: float,
             tokens_per_second: float, mfu: float, layout: str, phases: dict[str, float],
             seconds: float) -> None:
        """One step of the job (call only while rank 0)."""
        tb = self._tb()
        if tb is not None:
            for tag, value in (("train/loss", loss), ("train/learning_rate", learning_rate),
                               ("train/grad_norm", grad_norm),
                               ("train/tokens_per_second", tokens_per_second),
                               ("train/mfu", mfu)):
                tb.add_scalar(tag, value, step)
        if step % self.log_every == 0 or step == self.steps:
            total = sum(phases.values()) or seconds or 1.0
            split = "  ".join(f"{name} {100 * phases.get(name, 0.0) / total:.0f}%"
                              for name in ("compute", "communication", "redundancy"))
            self._say(f"step {step:>5}/{self.steps}  loss {loss:.6f}  lr {learning_rate:.3e}  "
                      f"grad-norm {grad_norm:.4f}  {tokens_per_second:,.0f} tok/s  "
                      f"mfu {100 * mfu:.2f}%  {layout}  step {_ms(seconds)} ({split})")

    def switch(self, *, kind: str, reason: str, from_layout: str, to_layout: str, step: int,
               pause_seconds: float, generation: int, detail: str = "") -> None:
        """A switch (``kind`` "switch"), recovery ("recovery") or the job's first layout
        ("start": logged only), said by the new rank 0."""
        text = (f"{kind.upper()} {from_layout or '-'} -> {to_layout}  reason {reason}  at "
                f"step {step}  pause {_ms(pause_seconds)}  generation {generation}")
        if detail:
            text += f"  ({detail})"
        self._say(text)
        tb = self._tb() if kind != "start" else None     # a start is no change to mark
        if tb is not None and kind == "recovery":
            # The steps after the restored one are trained again: a session restart at the
            # next step makes TensorBoard's reader drop the old ones for every tag at once
            # (its per-tag out-of-order purge would keep some tags' stale points).
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            tb._get_file_writer().add_event(
                Event(step=step + 1, session_log=SessionLog(status=SessionLog.START)))
        if tb is not None:
            tb.add_text("events", f"{kind} ({reason}): {from_layout or '-'} → {to_layout}, "
                        f"pause {_ms(pause_seconds)}" + (f", {detail}" if detail else ""), step)
            tb.add_scalar("events/pause_ms", pause_seconds * 1e3, step)
            tb.flush()          # markers are rare and worth seeing at once

    def _say(self, text: str) -> None:
        self.out(f"[{time.monotonic() - self._t0:8.1f}s] job {self.job_name} "
                 f"(device {self.device}, rank 0): {text}", flush=True)

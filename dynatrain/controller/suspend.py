"""A job's one agreed checkpoint and its stop: ``spec.suspend`` (the front end asks), and the
park below the minimum (:class:`.decide.Park`): every member writes its part of one
checkpoint at a step boundary they agree on, and no generation runs until the front end
restarts the job from it (:meth:`~.core.JobController.restart_from`) with whatever workers it
then has. Functions over the controller, as :mod:`.recovery` is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import JobFailed, SuspendFailed
from .orchestrator import _fan_out

if TYPE_CHECKING:
    from .core import JobController


@dataclass(frozen=True)
class Parked:
    """The job parked below its minimum (:class:`.decide.Park`), and where it continues from."""
    why: str
    checkpoint: str
    step: int


def suspend(c: JobController) -> tuple[str, int]:
    """Every member writes its part of one checkpoint at a step boundary they agree on
    and trains no further (``spec.suspend``); returns (path, step). The front end then
    removes the workers and, to resume, calls :meth:`~.core.JobController.restart_from`
    with what this returned: the job continues from that step under whatever layout fits
    the workers it then has. Raises :class:`SuspendFailed` (the job trains on, or is recovered if a
    member died inside the collective save)."""
    if c.layout is None or c.switching:
        raise SuspendFailed("no generation is running" if c.layout is None
                            else "a switch is in flight")
    members, g = c.members, c.generation_running
    replies = _fan_out(lambda d: c.clients[d].checkpoint(
        g, stop=True, timeout_s=c.timeouts.commit_s), members)
    bad = [f"device {d}: {r}" for d, r in zip(members, replies) if isinstance(r, Exception)]
    if bad:
        raise SuspendFailed("; ".join(bad))
    written = {(r.path, r.step) for r in replies}
    if len(written) != 1:       # one agreed boundary: every rank answers the same
        raise SuspendFailed(f"the members answered different checkpoints: {sorted(written)}")
    c.poll(judge=False)      # the last steps' records (their reads) before they go
    path, step = written.pop()
    c.log(f"suspended at step {step}: every member wrote its part of {path} and "
          "trains no further")
    return path, step


def park(c: JobController, why: str) -> None:
    """Below the minimum by notices: one checkpoint written by every member before the
    doomed ones go, then no generation runs (:attr:`~.core.JobController.parked` tells the
    front end). A checkpoint that cannot be written fails the job: nothing else would keep
    its state."""
    try:
        path, step = suspend(c)
    except SuspendFailed as e:
        raise JobFailed(f"{why}; the checkpoint to wait at was not written: {e}") from e
    c.restart_from(path, step)
    c.parked = Parked(why, path, step)
    c.log(f"parked: {why}; waits for {c.job.min_workers} workers to continue from "
          f"the checkpoint of step {step}")

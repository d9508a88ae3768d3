"""A job's progress as the controller sees it: steps, losses, and every sample each data reader
read, audited for exactly-once.

Readers report their reads with each step's record (``StepRecord.sample_begin/end``); they are
kept per step and per device, so a step trained again after a recovery replaces its reads
instead of adding to them, and :meth:`Progress.audit` can say, for every step, which samples
were never read or read twice. Samples that no report covers but that a restored state proves
were consumed (their reader died before its last report was read) are kept apart as
*inferred*.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Progress:
    step: int = 0
    loss: float | None = None
    tokens_per_second: float = 0.0
    losses: dict[int, float] = field(default_factory=dict)
    timeline: dict[int, tuple[float, float]] = field(default_factory=dict)
    """step -> (wall time at its end, tokens per second): the latest report of each step (a
    step trained again after a recovery replaces it), for pictures of the run."""
    reads: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)
    """step -> {device: [begin, end)}: the samples each data reader reported reading for that
    step (a step trained again after a recovery replaces its reads)."""
    inferred: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """step -> samples no reader's report covers, but that the restored state proves were
    consumed (a reader died before reporting them); kept apart from ``reads``."""
    finished: bool = False
    first_step: int = 0
    """The step the job started from (a checkpoint's); samples before it are not this run's."""
    retrained: int = 0
    """Steps trained a second time (a recovery went back to an older step): 0 while every
    capacity change was a planned switch."""

    @property
    def samples(self) -> list[tuple[int, int]]:
        """Every [begin, end) read, reported or inferred, in step order."""
        out = []
        for k in sorted(set(self.reads) | set(self.inferred)):
            out.extend(sorted(self.reads.get(k, {}).values()))
            out.extend(self.inferred.get(k, []))
        return out

    def audit(self, global_batch_size: int, last_step: int, *,
              since: int | None = None) -> list[str]:
        """Each step's global batch must be read exactly once: steps ``first_step+1 ..
        last_step`` (``since+1 ..`` when given: a controller that adopted a running job has
        the workers' recent records only), step k owning samples [(k-1)*gbs, k*gbs). Returns
        the discrepancies, each naming the step and the samples (empty: exactly once)."""
        problems = []
        start = self.first_step if since is None else max(self.first_step, since)
        for k in range(start + 1, last_step + 1):
            lo, hi = (k - 1) * global_batch_size, k * global_batch_size
            got = sorted([(b, e, f"device {d}") for d, (b, e) in self.reads.get(k, {}).items()]
                         + [(b, e, "inferred") for b, e in self.inferred.get(k, [])])
            at = lo
            for b, e, who in got:
                if b < lo or e > hi:
                    problems.append(f"step {k}: {who} read samples [{b}, {e}), outside the "
                                    f"step's batch [{lo}, {hi})")
                elif b < at:
                    problems.append(f"step {k}: samples [{b}, {min(e, at)}) read twice "
                                    f"(again by {who})")
                at = max(at, min(e, hi))
            problems += [f"step {k}: samples [{a}, {b}) never read"
                         for a, b in _gaps([(b, e) for b, e, _ in got], lo, hi)]
        return problems

    def infer(self, step: int, global_batch_size: int) -> dict[int, list[tuple[int, int]]]:
        """Record as *inferred* every sample of steps up to ``step`` that no report (nor an
        earlier inference) covers: the caller knows the state of ``step`` was restored, so
        every one of them was consumed. Returns what it added, by step."""
        added = {}
        for k in range(self.first_step + 1, step + 1):
            lo, hi = (k - 1) * global_batch_size, k * global_batch_size
            known = self.inferred.get(k, [])
            gaps = _gaps(list(self.reads.get(k, {}).values()) + known, lo, hi)
            if gaps:
                self.inferred[k] = known + gaps
                added[k] = gaps
        return added

    def rewind(self, step: int) -> None:
        """Forget what came after ``step``: those steps are trained again (counted in
        :attr:`retrained`)."""
        self.retrained += max(0, self.step - step)
        self.step = step
        self.losses = {k: v for k, v in self.losses.items() if k <= step}
        self.reads = {k: v for k, v in self.reads.items() if k <= step}
        self.inferred = {k: v for k, v in self.inferred.items() if k <= step}
        self.loss = self.losses.get(step)


def _gaps(spans: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [lo, hi) that no span covers."""
    gaps, at = [], lo
    for b, e in sorted(spans):
        if b > at:
            gaps.append((at, min(b, hi)))
        at = max(at, e)
        if at >= hi:
            break
    if at < hi:
        gaps.append((at, hi))
    return [(a, b) for a, b in gaps if a < b]

"""Capacity shared between jobs: how many workers each job of a pool may hold (#35).

Several elastic jobs on one pool race for its GPUs: each would create pods up to its maximum
and never yield, and two jobs that each hold fewer than their minimum would wait for ever.
This module is the rule that settles it, as a pure function of what every job claims; the
operator gathers the claims (:mod:`dynatrain.operator.sharing`) and each job acts on its own
share: it creates no pods beyond it while the pool is contended, and shrinks live (reason
``rebalance``) when it holds more.

The rule, which the README repeats:

1. **The pool and what it holds.** Jobs with the same placement (pod template node selector,
   affinity, tolerations, GPUs per worker) share a pool. What the pool's jobs may divide is what
   they hold now (GPUs of placed worker pods): the scheduler places a pending pod on any free
   GPU that fits, so while one of them waits, the pool has nothing free that the jobs do not
   hold already. Capacity is never counted from nodes (the scheduler knows the taints,
   selectors and other tenants). A GPU one job lets go is free, held by nobody, until the
   scheduler places a waiting pod on it; so the operator passes the largest total of the last
   few seconds as the pool's ``floor``. Without it, a job whose gang was just admitted lost
   its share whenever the count fell between a leaving pod and its own being placed: its pods
   were deleted, the others grew back, and it waited again (a livelock that a CI run on 2
   cores kept up for minutes).
2. **Priority first.** Levels of ``priority`` (the job's PriorityClass value) are served in
   order, highest first, each in full before the next: the scheduler preempts lower-priority
   pods for higher ones the same way.
3. **Gang minimum.** Within a level, jobs already training first, then by age (oldest first),
   each gets its ``minWorkers`` whole if they fit in what is left, else nothing (a gang):
   a job that cannot reach its minimum holds nothing, so two jobs can never each hold part
   of one and wait for the rest.
4. **Max-min fair extras.** The GPUs left go one worker at a time to the admitted job (of the
   level) holding the fewest GPUs in its share, up to its maximum; ties go to the older job.
5. **Contended.** A pool is contended while some job holds less than its share and has
   worker pods the scheduler cannot place. Only then do shares bind: each job keeps at most
   its share (pods beyond it are deleted, members beyond it switched out live), so the
   waiting job's pods take the freed GPUs. In a pool nobody waits in, jobs ask for their
   maximum (pending pods are demand a cluster autoscaler sees) and grow into free GPUs.

Pure: no grpc, kubernetes or torch (a contract says so); table tests in
``tests/controller/test_share.py``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    """What one job asks of its pool at one instant."""

    job: str
    """``namespace/name``."""
    pool: str
    """Jobs with equal ``pool`` compete (their placement, as text)."""
    priority: int = 0
    """The value of the workers' PriorityClass (0 without one)."""
    started: bool = False
    """Training already (it has a layout): served before jobs not yet started."""
    created: str = ""
    """``metadata.creationTimestamp`` (RFC 3339, which sorts as text): older first."""
    min_workers: int = 1
    max_workers: int = 1
    """The most workers it wants now (maxWorkers, ``kubectl scale``, minEfficiency)."""
    gpus: int = 1
    """GPUs per worker (a CPU-only worker counts as one slot)."""
    held: int = 0
    """Its worker pods placed on a node."""
    waiting: int = 0
    """Its worker pods the scheduler could not place."""

    def __post_init__(self):
        if self.min_workers < 0 or self.max_workers < 0 or self.held < 0 or self.waiting < 0:
            raise ValueError(f"claim of {self.job}: counts must be >= 0, got min "
                             f"{self.min_workers}, max {self.max_workers}, held {self.held}, "
                             f"waiting {self.waiting}")
        if self.gpus < 1:
            raise ValueError(f"claim of {self.job}: gpus per worker must be >= 1 (a CPU "
                             f"worker counts as 1), got {self.gpus}")


@dataclass(frozen=True)
class Share:
    """One job's share of its pool."""

    workers: int
    """The workers the job may hold while the pool is contended."""
    contended: bool
    """Some job of the pool waits below its share: hold no more than ``workers``."""
    why: str
    """The figures, for the job's condition and log."""

    def cap(self, wanted: int) -> int:
        """The workers to ask for: ``wanted``, or the share while the pool is contended."""
        return min(wanted, self.workers) if self.contended else wanted


def divide(claims: list[Claim] | tuple[Claim, ...],
           floors: Mapping[str, int] | None = None) -> dict[str, Share]:
    """Every job's :class:`Share` under the module's rule; ``floors``: pool -> the GPUs its
    jobs held a moment ago (the pool divides at least that many: rule 1)."""
    names = [c.job for c in claims]
    if len(set(names)) != len(names):
        raise ValueError(f"one claim per job, got {sorted(names)}")
    pools: dict[str, list[Claim]] = defaultdict(list)
    for c in claims:
        pools[c.pool].append(c)
    totals = pool_totals(claims)
    out: dict[str, Share] = {}
    for pool, members in pools.items():
        out.update(_divide_pool(members, max(totals[pool], (floors or {}).get(pool, 0))))
    return out


def _order(c: Claim) -> tuple:
    return (-c.priority, not c.started, c.created, c.job)


def pool_totals(claims: list[Claim] | tuple[Claim, ...]) -> dict[str, int]:
    """Pool -> the GPUs its jobs' placed worker pods hold."""
    totals: dict[str, int] = defaultdict(int)
    for c in claims:
        totals[c.pool] += c.held * c.gpus
    return dict(totals)


def _divide_pool(claims: list[Claim], total: int) -> dict[str, Share]:
    left = total
    alloc: dict[str, int] = {}
    for level in sorted({c.priority for c in claims}, reverse=True):
        jobs = sorted((c for c in claims if c.priority == level), key=_order)
        for c in jobs:                                         # the gangs, in order
            need = c.min_workers * c.gpus
            fits = need <= left and c.min_workers <= c.max_workers
            alloc[c.job] = c.min_workers if fits else 0
            left -= need if fits else 0
        rank = {c.job: i for i, c in enumerate(jobs)}
        while True:                                           # max-min fair extras
            open_ = [c for c in jobs if (alloc[c.job] > 0 or c.min_workers == 0)
                     and alloc[c.job] < c.max_workers and c.gpus <= left]
            if not open_:
                break
            c = min(open_, key=lambda c: (alloc[c.job] * c.gpus, rank[c.job]))
            alloc[c.job] += 1
            left -= c.gpus
    contended = any(c.waiting > 0 and c.held < alloc[c.job] for c in claims)
    waiting = [c.job for c in claims if c.waiting > 0 and c.held < alloc[c.job]]
    out = {}
    for c in claims:
        why = (f"share {alloc[c.job]} workers ({alloc[c.job] * c.gpus} GPUs) of the {total} "
               f"GPUs its pool's {len(claims)} jobs hold; it holds {c.held} workers, "
               f"minWorkers {c.min_workers}, wants {c.max_workers}, priority {c.priority}")
        if contended:
            why += f"; contended: {', '.join(waiting)} waits below its share"
        out[c.job] = Share(workers=alloc[c.job], contended=contended, why=why)
    return out

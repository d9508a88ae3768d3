"""When to switch, and to what: the controller's policy over the solver's estimates.

- **Capacity loss, or notice of it** (a preemption notice, a node going away): switch at once to
  the best layout on the devices that remain, whatever the estimate says: waiting loses the
  state on the doomed device.
- **A requested layout** (``parallelism.mode: fixed`` with a layout that differs from the
  running one): switch at once.
- **Fewer workers wanted** (``spec.elastic.workers`` below the running layout's, as ``kubectl
  scale`` sets it; never below ``minWorkers``, which the CRD and the parser enforce): switch at
  once to the best layout on that many devices, keeping the devices that make the switch move
  the fewest bytes; the front end then deletes the leavers' pods.
- **New capacity**: grow to the most devices (up to ``spec.elastic.workers`` or
  ``maxWorkers``) for which a layout exists, with the solver's best layout for that count: the
  user's bounds say how many GPUs the job should use, the solver says how to use them.
- **A better layout for the same devices**: switch only when the estimated throughput beats
  the running layout's by ``margin`` (a switch costs a pause; estimates are not exact).
- Neither of the last two within ``cooldown_s`` of the last voluntary switch (capacity that
  flaps must not make the job flap).
- Never start a voluntary switch within ``min_steps_left`` steps of the end of the job.

Which devices a new layout uses: the devices of the running layout first (their state is
already in place), then the lowest ids; fewer devices than are available only when no layout
uses all of them (e.g. 5 devices for a global batch of 12).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace

from dynatrain.vps.layout import Layout
from dynatrain.vps.placement import place_devices
from dynatrain.vps.planner import plan_switch

from .costmodel import Estimate, SolverError, estimate
from dynatrain.spec.hardware import DeviceProfile
from dynatrain.spec.job import JobSpec
from .solver import solve


SHRINK_CANDIDATES = 64
"""Keep sets planned exhaustively on a scale-down, at most (C(8, 6) = 28)."""
SHRINK_SECONDS = 2.0
"""Planning time a scale-down's choice of leavers may take (plans of a huge model are slow)."""


@dataclass
class Decision:
    layout: Layout
    """The new layout with its devices."""
    reason: str
    estimate: Estimate
    note: str = ""
    """The figures behind the decision, for the log (e.g. why workers are released)."""
    left_out: tuple[int, ...] = ()
    """Devices the switch leaves out for good (a straggler, :mod:`.straggler`)."""


@dataclass
class Policy:
    margin: float = 1.10
    cooldown_s: float = 10.0
    min_steps_left: int = 5
    last_voluntary: float = float("-inf")
    _efficiency_cache: dict = field(default_factory=dict, repr=False)

    def decide(self, job: JobSpec, profile: DeviceProfile, current: Layout | None,
               usable: list[int], doomed: set[int], step: int,
               share: int | None = None,
               measured: dict[str, float] | None = None) -> Decision | None:
        """The switch to make now, if any.

        ``usable``: devices that are up and not doomed; ``doomed``: devices with a notice (or
        gone) that the running layout must leave; ``share``: the most workers the job may
        hold while its pool is shared with waiting jobs (:mod:`.share`; None: no bound);
        ``measured``: layout shape (canonical text) -> the step seconds the job measured on it
        (:mod:`.feedback`): a shape it ran is judged by that, not by the cost model.
        """
        usable = sorted(usable)
        if share is not None and share < job.min_workers:
            if current is None:
                return None     # its minimum is not its share: it waits, holding nothing
            # A running job cannot go under its minimum live; a higher-priority job takes
            # those GPUs through the scheduler's preemption (notices), not by a share.
            share = None
        wanted = job.workers or job.max_workers
        efficient = self.efficient_workers(job, profile, wanted)
        cap = min(len(usable), efficient, len(usable) if share is None else share)
        kw = estimate_kwargs(job)
        lim = dict(zero_stages=job.limits.zero_stages, allow=job.limits.allow)
        if current is None or doomed & set(current.device_of):
            reason = "start" if current is None else "preemption"
            if cap < job.min_workers:
                raise SolverError(f"{cap} usable workers, fewer than spec.elastic.minWorkers="
                                  f"{job.min_workers}")
            best = self.best_on(job, profile, cap, kw)
            return self._place(job, current, usable, best, reason)
        steps_left = job.training.steps - step
        if job.mode == "fixed" and job.layout is not None \
                and not job.layout.same_shape(current):
            if job.layout.world <= len(usable):
                best = solve(job.model, job.layout.world, profile, fixed=job.layout, **kw)
                return self._place(job, current, usable, best, "requested")
            return None
        if job.mode != "fixed" and job.workers is not None and current.world > job.workers:
            # Fewer workers wanted (``kubectl scale`` down): at once, as a request is.
            best = self.best_on(job, profile, cap, kw)
            return self.shrink(job, current, usable, best)
        if job.mode != "fixed" and share is not None and current.world > share:
            # Over its share of a pool another job waits in: the workers over it go, at once
            # (their pods are deleted, so the waiting job's pods take the GPUs).
            best = self.best_on(job, profile, cap, kw)
            return self.shrink(job, current, usable, best, "rebalance")
        if job.mode != "fixed" and current.world > efficient:
            # Workers that add less than spec.elastic.minEfficiency: released, at once.
            best = self.best_on(job, profile, cap, kw)
            decision = self.shrink(job, current, usable, best, "release")
            decision.note = self.efficiency_note(job, profile, wanted)
            return decision
        if job.mode == "fixed" or steps_left < self.min_steps_left:
            return None
        if time.monotonic() - self.last_voluntary < self.cooldown_s:
            return None
        for n in range(cap, current.world, -1):      # new capacity: grow to the maximum
            try:
                bigger = solve(job.model, n, profile, **kw, **lim)
            except SolverError:
                continue                              # no layout uses exactly n devices
            return self._place(job, current, usable, bigger, "scale-up")
        best = solve(job.model, current.world, profile, **kw, **lim)
        # The cost model prices a layout's degrees on uniform devices; how the layers are
        # split between stages and the micro-batches between data-parallel ranks are the
        # measured costs' call (decide.rebalance, straggler.reshare). So the running degrees
        # are priced even, and a switch that would only split them again is never "better".
        even = replace(current, stages=None, shares=None)
        if best.layout.same_shape(even):
            return None
        now = estimate(job.model, even, profile, **kw)
        if best.tokens_per_second < self.margin * now.tokens_per_second:
            return None
        ran, running = (measured or {}).get(best.layout.to_text()), \
            (measured or {}).get(current.to_text())
        if ran is not None and running is not None and ran * self.margin > running:
            # Measured beats modelled: the job ran that layout and it was not enough faster
            # (so two layouts cannot take turns being "better").
            return None
        return self._place(job, current, usable, best, "better-layout")

    def record_voluntary(self) -> None:
        self.last_voluntary = time.monotonic()

    @staticmethod
    def best_on(job, profile, cap: int, kw) -> Estimate:
        """The solver's best layout on the most devices (<= cap) that some layout can use."""
        if job.mode == "fixed" and job.layout is not None and job.layout.world <= cap:
            return solve(job.model, job.layout.world, profile, fixed=job.layout, **kw)
        errors = []
        for n in range(cap, max(1, job.min_workers) - 1, -1):
            try:
                return solve(job.model, n, profile, **kw, zero_stages=job.limits.zero_stages,
                             allow=job.limits.allow)
            except SolverError as e:
                errors.append(f"{n} devices: {e}")
        raise SolverError("no layout fits between spec.elastic.minWorkers="
                          f"{job.min_workers} and {cap} devices: " + "; ".join(errors))

    def efficient_workers(self, job: JobSpec, profile: DeviceProfile, cap: int) -> int:
        """The most workers, up to ``cap``, each of which adds at least
        ``spec.elastic.minEfficiency`` of a worker's throughput: counting up from
        ``minWorkers`` over the counts some layout can use, a count is kept while the solver's
        best throughput grows, per added worker, by at least that fraction of the new count's
        throughput per worker. ``cap`` itself without the setting (or in mode fixed).
        Remembered per job, profile and cap (the solver runs once per count)."""
        if job.min_efficiency <= 0 or job.mode == "fixed" or cap <= job.min_workers:
            return cap
        return self._efficiency(job, profile, cap)[0]

    def efficiency_note(self, job: JobSpec, profile: DeviceProfile, cap: int) -> str:
        """The figures behind :meth:`efficient_workers`, for the log."""
        keep, figures = self._efficiency(job, profile, cap)
        shown = ", ".join(f"{n}: {t:,.0f} tok/s ({t / n:,.0f}/worker)" for n, t in figures)
        return (f"keeps {keep} of up to {cap} workers at spec.elastic.minEfficiency="
                f"{job.min_efficiency:g} (estimated {shown})")

    def _efficiency(self, job: JobSpec, profile: DeviceProfile, cap: int):
        kw = estimate_kwargs(job)
        key = (job.model, kw, job.limits, job.min_workers, job.min_efficiency, profile, cap)
        if self._efficiency_cache.get("key") != key:
            figures, keep = [], None
            for n in range(max(1, job.min_workers), cap + 1):
                try:
                    t = solve(job.model, n, profile, **kw, zero_stages=job.limits.zero_stages,
                              allow=job.limits.allow).tokens_per_second
                except SolverError:
                    continue                      # no layout uses exactly n devices
                if keep is not None:
                    last_n, last_t = figures[-1]
                    if (t - last_t) / (n - last_n) < job.min_efficiency * t / n:
                        figures.append((n, t))
                        break
                figures.append((n, t))
                keep = n
            self._efficiency_cache = {"key": key, "value": (keep or cap, figures)}
        return self._efficiency_cache["value"]

    @staticmethod
    def shrink(job, current: Layout, usable: list[int], best: Estimate,
                reason: str = "scale-down") -> Decision:
        """Scale down: of the running layout's devices, keep the ones that make the switch
        move the fewest bytes over the network (every keep set is planned while there are at
        most ``SHRINK_CANDIDATES``, else a few built from the layout's structure); on a tie
        the lowest device ids stay. The others leave and their pods are deleted."""
        n = best.layout.world
        pool = sorted(d for d in current.device_of if d in usable)
        if len(pool) < n:                         # not enough members left: standbys too
            pool += [d for d in sorted(usable) if d not in pool]
        if math.comb(len(pool), n) <= SHRINK_CANDIDATES:
            candidates = itertools.combinations(pool, n)
        else:
            by_rank = list(current.device_of)
            candidates = [tuple(by_rank[:n]), tuple(by_rank[-n:]), tuple(pool[:n])]
        chosen, cost = None, None
        deadline = time.monotonic() + SHRINK_SECONDS
        for keep in candidates:
            if not set(keep) <= set(usable):
                continue
            layout = place_devices(job.model, current, best.layout, sorted(keep))
            moved = sum(plan_switch(job.model, current, layout).need.values())
            if cost is None or moved < cost:
                chosen, cost = layout, moved
            if time.monotonic() > deadline:      # a huge model: the best found so far
                break
        return Decision(chosen, reason, best)

    @staticmethod
    def _place(job, current: Layout | None, usable: list[int], best: Estimate,
               reason: str) -> Decision:
        n = best.layout.world
        keep = [d for d in (current.device_of if current else ()) if d in usable]
        chosen = (keep + [d for d in usable if d not in keep])[:n]
        if current is None:
            layout = best.layout.with_devices(sorted(chosen))
        else:
            layout = place_devices(job.model, current, best.layout, sorted(chosen))
        return Decision(layout, reason, best)


def seq_len_of(job: JobSpec) -> int:
    """The tokens per sequence the job trains with (its own, else the default of its config)."""
    return job.training.seq_len or min(job.model.max_seq_len, 128)


def estimate_kwargs(job: JobSpec) -> dict:
    """What the cost model and the solver price one of ``job``'s layouts with, beside the
    model and the profile (the batch, the sequence, activation checkpointing)."""
    return dict(global_batch_size=job.global_batch_size,
                micro_batch_size=job.training.micro_batch_size, seq_len=seq_len_of(job),
                activation_checkpointing=job.training.activation_checkpointing)

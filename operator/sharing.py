"""Pools shared between jobs, the operator's side: each job's claim on one board, its share back.

Every job the operator runs has its own daemon (a thread). At each pass a job puts its
:class:`~dynatrain.controller.share.Claim` (its pool, priority, age, minimum and maximum, the
worker pods it holds and those the scheduler cannot place) on the operator's :class:`Board`
and reads back its :class:`~dynatrain.controller.share.Share`, which the pure rule in
:mod:`dynatrain.controller.share` computes over every job's latest claim. The job acts on its
own share only: it creates no pods beyond it while its pool is contended and its controller
switches the workers over it out live (reason ``rebalance``); so no job ever tells another
what to do, and two operators' boards never need to agree (only the leader runs jobs).

What makes a pool and a priority is read from the job, never from nodes (the scheduler decides
where pods go): the pool is the placement of the job's pod template and its GPUs per worker;
the priority is the value of the template's PriorityClass (read once a minute; 0 without one).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

from kubernetes import client
from kubernetes.client.rest import ApiException

from dynatrain.controller.share import Claim, Share, divide, pool_totals

from .basics import JobContext, Room

STALE_S = 120.0
"""A claim not renewed for this long is dropped (its job's daemon ended without saying so)."""
SHARE_HOLD_S = 20.0
"""A job's share keeps binding this long after its pool stops being contended (hysteresis)."""
PRIORITY_TTL_S = 60.0
"""How long a PriorityClass's value is remembered."""


def pool_of(spec: dict) -> str:
    """The pool a job's workers compete in: its template's placement and its GPUs per worker,
    as canonical text (jobs with equal text compete for the same GPUs)."""
    tspec = (spec.get("template") or {}).get("spec") or {}
    placement = {key: tspec.get(key) for key in ("nodeSelector", "affinity", "tolerations",
                                                 "schedulerName") if tspec.get(key)}
    placement["gpus"] = int((spec.get("resources") or {}).get("gpus") or 0)
    return json.dumps(placement, sort_keys=True, separators=(",", ":"))


class Priorities:
    """PriorityClass name -> value, read from the API and remembered for a minute."""

    def __init__(self, api: client.ApiClient | None, log=print):
        self.scheduling = client.SchedulingV1Api(api) if api is not None else None
        self._known: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()
        self.log = log

    def value(self, name: str | None) -> int:
        if not name or self.scheduling is None:
            return 0
        now = time.monotonic()
        with self._lock:
            hit = self._known.get(name)
            if hit is not None and now - hit[1] < PRIORITY_TTL_S:
                return hit[0]
        try:
            value = int(self.scheduling.read_priority_class(name).value or 0)
        except ApiException as e:
            # The scheduler refuses a pod naming a missing class; the pod's creation says so.
            # Here the job counts as priority 0 until it exists.
            if e.status != 404:
                raise
            self.log(f"PriorityClass {name} does not exist: its jobs count as priority 0")
            value = 0
        with self._lock:
            self._known[name] = (value, now)
        return value


class Board:
    """Every job's latest claim; a job's share is divided over all of them (see the module).

    Each pool divides at least the most GPUs its jobs held over the last :data:`SHARE_HOLD_S`
    (the ``floor`` of :func:`~dynatrain.controller.share.divide`): a GPU that one job let go
    stays the pool's while the pod that waits for it is being placed."""

    def __init__(self):
        self._claims: dict[str, tuple[Claim, float]] = {}
        self._totals: dict[str, list[tuple[float, int]]] = {}
        """Pool -> (when, GPUs held) over the last SHARE_HOLD_S, oldest first."""
        self._lock = threading.Lock()

    def share(self, claim: Claim) -> Share:
        now = time.monotonic()
        with self._lock:
            self._claims[claim.job] = (claim, now)
            for job, (_, when) in list(self._claims.items()):
                if now - when > STALE_S:
                    del self._claims[job]
            claims = [c for c, _ in self._claims.values()]
            # Rebuilt each time: a pool no job claims any more is forgotten.
            self._totals = {pool: [(t, n) for t, n in self._totals.get(pool, ())
                                   if now - t < SHARE_HOLD_S] + [(now, total)]
                            for pool, total in pool_totals(claims).items()}
            floors = {pool: max(n for _, n in seen) for pool, seen in self._totals.items()}
        return divide(claims, floors)[claim.job]

    def drop(self, job: str) -> None:
        """The job ended, was suspended or deleted: it claims nothing."""
        with self._lock:
            self._claims.pop(job, None)

    def claims(self) -> list[Claim]:
        with self._lock:
            return [c for c, _ in self._claims.values()]


class JobShare(Room):
    """One job's side of the board: its claim at each pass, its share back, and the ``Share``
    condition that says it (an Event when it must give workers back or cannot have its
    minimum)."""

    def __init__(self, ctx: JobContext, *, board: Board, priorities: Priorities | None):
        super().__init__(ctx)
        self.board, self.priorities = board, priorities
        self.key = f"{self.namespace}/{self.name}"
        self.contended_at = float("-inf")
        """When this job's pool was last contended (the share's hysteresis)."""

    def update(self, workers: dict, pods) -> Share:
        """The job's share now, from its worker pods (``workers``, by device) and ``pods``
        (its :class:`~.pods.WorkerPods`: what it wants, which devices it let go)."""
        now = time.monotonic()
        # A placed pod holds its GPU until it is gone (also one being deleted): counting it
        # keeps the pool's total steady while a worker leaves.
        placed = [w for w in workers.values()
                  if w.node and w.phase not in ("Succeeded", "Failed")]
        alive = [w for w in workers.values() if not w.doomed and w.device not in pods.left]
        spec = self.body["spec"]
        template = (spec.get("template") or {}).get("spec") or {}
        claim = Claim(
            job=self.key, pool=pool_of(spec),
            priority=self.priorities.value(template.get("priorityClassName"))
            if self.priorities else 0,
            started=self.controller.layout is not None,
            created=self.body["metadata"].get("creationTimestamp") or "",
            min_workers=self.job.min_workers, max_workers=pods.wanted(),
            gpus=max(1, self.job.gpus_per_worker), held=len(placed),
            waiting=sum(1 for w in alive if not w.node and w.unschedulable))
        share = self.board.share(claim)
        if share.contended:
            self.contended_at = now
        elif now - self.contended_at < SHARE_HOLD_S:
            # Hysteresis: the share binds a while after the contention ends, so that a pod
            # this job would create at once does not race the waiting job's pod for the GPU
            # just freed (the scheduler's queue does not keep arrival order).
            share = replace(share, contended=True)
        self._say(claim, share)
        return share

    def _say(self, claim: Claim, share: Share) -> None:
        if not share.contended:
            reason, ok = "Uncontended", True
        elif share.workers < claim.min_workers and claim.started:
            reason, ok = "WithinShare", True     # kept: it cannot shrink under its minimum
        elif share.workers < claim.min_workers:
            reason, ok = "WaitingForShare", False
        elif claim.held > share.workers:
            reason, ok = "OverShare", False
        else:
            reason, ok = "WithinShare", True
        was = (self.conditions.get("Share") or {}).get("reason")
        self.conditions.set("Share", ok, reason, share.why, self._generation())
        if reason != was and reason in ("OverShare", "WaitingForShare"):
            text = (f"gives back {claim.held - share.workers} workers to jobs waiting in its "
                    "pool: " if reason == "OverShare" else
                    "its minimum does not fit its share of the pool; it holds no pods until "
                    "it does: ") + share.why
            self._event("Normal", reason, text)
            self.log(f"job {self.name}: {reason}: {text}")

    def drop(self) -> None:
        """The job ended, was suspended or closed: it claims nothing."""
        self.board.drop(self.key)

"""Abandoning a failed generation: every wait on a collective can be cut short from outside.

When a worker dies without notice, its peers are left inside a collective. Those that talked
to it directly get an error from the transport at once, but the others wait on peers that are
themselves stuck or gone, until the group's timeout (a minute). ``ProcessGroupGloo.abort`` does
not wake such a wait (measured on torch 2.15: the blocked wait only ended when the peer process
exited), so DynaTrain never blocks in ``work.wait()`` itself: every wait of the trainer and of
the transition engine goes through :func:`wait`, which sleeps on the work's future *or* on a
failure notice, whichever comes first. The agent calls :func:`abandon` when the controller
reports a failure; the training loop then gets :class:`GenerationAbandoned`, drops the trainer
(its groups are left to time out in their own threads, never reused) and restores from the
in-memory redundancy. :func:`reset` re-arms the waits once the next generation starts.

**Under NCCL a wait is not where a thread blocks.** NCCL's ``work.wait()`` and futures return
when the op is queued; the training thread blocks later, in a host sync of a result (the loss,
a norm), which no notice can wake: only aborting the op's communicator ends it
(``ncclCommAbort``). So the groups of NCCL generations are :func:`track`-ed, and
:func:`abandon` aborts them; the blocked sync then raises and the thread gets to the recovery
(``dynatrain.vps.ncclsim`` reproduces the hang on CPU: without the abort, a recovery waited
for the group's timeout). Gloo's groups are not aborted: their waits go through :func:`wait`.

One process runs one trainer, so the notice is process-wide.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from datetime import timedelta


class GenerationAbandoned(RuntimeError):
    """The running generation was abandoned (a member failed); its collectives are void."""


SPIN_SECONDS = 50e-6
_lock = threading.Lock()
_reason: str | None = None
_waiting: dict[threading.Event, float] = {}
"""Every wait in progress, with its start (monotonic): :func:`longest_wait` reports it."""
_tracked: dict[int, list] = {}
"""Generation -> its groups that only an abort can free (NCCL's), for :func:`abandon`."""


def track(generation: int, group) -> None:
    """``group`` belongs to ``generation`` and a wait in it ends only when it is aborted."""
    with _lock:
        _tracked.setdefault(generation, []).append(group)


def keep_only(generation: int) -> None:
    """``generation`` runs now and no earlier one can be waited on: forget the others'
    groups (they are shut down where they are dropped)."""
    with _lock:
        for g in [g for g in _tracked if g < generation]:
            del _tracked[g]


def abandon(reason: str) -> None:
    """Wake every wait, now and until :func:`reset`, with :class:`GenerationAbandoned`, and
    abort every tracked group (a host sync stuck in one raises)."""
    global _reason
    with _lock:
        _reason = reason
        for ev in _waiting:
            ev.set()
        groups = [g for gs in _tracked.values() for g in gs]
        _tracked.clear()
    for g in groups:
        try:
            g.abort()
        except Exception:            # already aborted or shut down: nothing waits in it
            pass


def longest_wait() -> float:
    """Seconds the oldest wait in progress has lasted (0: none). A worker that makes no
    progress while its peers wait for it this long is the one that hangs (the controller's
    watchdog reads this through Status)."""
    with _lock:
        oldest = min(_waiting.values(), default=None)
    return 0.0 if oldest is None else time.monotonic() - oldest


def reset() -> None:
    """Re-arm: the next generation's collectives wait normally again."""
    global _reason, _helper_thread
    with _lock:
        _reason = None
        if _helper_thread is not None:   # it may be stuck in an abandoned wait: a fresh one
            _helper_thread.jobs.put(None)
            _helper_thread = None


def abandoned() -> str | None:
    """The reason given to :func:`abandon`, or None."""
    return _reason


def check() -> None:
    if _reason is not None:
        raise GenerationAbandoned(_reason)


_waited = threading.local()


def waited_seconds() -> float:
    """Seconds the calling thread has spent in :func:`wait` since it started: the trainer
    reads it before and after a step to split the step's time into compute and the time it
    waited for its peers (communication not hidden behind compute)."""
    return getattr(_waited, "seconds", 0.0)


def wait(work, timeout: timedelta | None = None):
    """``work.wait()``, unless the generation is abandoned first. Errors of the work itself (a
    lost peer, the group's timeout or ``timeout``) are raised as the backend reports them;
    returns what ``work.wait`` returned."""
    t0 = time.perf_counter()
    try:
        return _wait(work, timeout)
    finally:
        _waited.seconds = waited_seconds() + (time.perf_counter() - t0)


def _wait(work, timeout: timedelta | None):
    check()
    try:
        future = work.get_future()
    except RuntimeError:        # gloo's point-to-point works have no future
        future = None
    if future is not None:
        if not _spin(work):
            _sleep_until(future.add_done_callback)
            if not work.is_completed():
                check()
        return work.wait() if timeout is None else work.wait(timeout)
    # Without a future (gloo send/recv: is_completed() turns true only inside wait()), the
    # wait itself runs on a helper thread; an abandoned one is left there, blocked until
    # its peer's socket closes or the group's timeout ends it.
    done = _helper().submit(work, timeout)
    _sleep_until(done.add_done_callback)
    if not done.done():
        check()
    return done.result()


def _spin(work) -> bool:
    """Most collectives of a step finish within microseconds of being posted (the peers are
    in step): look for that briefly before paying for a sleep and a wake-up."""
    deadline = time.perf_counter() + SPIN_SECONDS
    while True:
        if work.is_completed():
            return True
        if time.perf_counter() > deadline:
            return False


class _Helper:
    """One daemon thread that runs blocking waits in order. When a generation is abandoned it
    may stay blocked in a dead wait, so :func:`reset` starts a new one for the next."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="dynatrain-wait", daemon=True).start()

    def submit(self, work, timeout) -> Future:
        done: Future = Future()
        self.jobs.put((work, timeout, done))
        return done

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            work, timeout, done = job
            try:
                done.set_result(work.wait() if timeout is None else work.wait(timeout))
            except BaseException as e:  # handed to the waiting thread
                done.set_exception(e)


_helper_thread: _Helper | None = None


def _helper() -> _Helper:
    global _helper_thread
    with _lock:
        if _helper_thread is None:
            _helper_thread = _Helper()
        return _helper_thread


def _sleep_until(add_done_callback) -> None:
    ev = threading.Event()
    with _lock:
        _waiting[ev] = time.monotonic()
        if _reason is not None:
            ev.set()
    try:
        # The callback runs on whichever thread ends the work (well or badly).
        add_done_callback(lambda _: ev.set())
        ev.wait()
    finally:
        with _lock:
            _waiting.pop(ev, None)

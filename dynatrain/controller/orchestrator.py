"""The two-phase switch, driven over the agents' gRPC API.

Phase one, Prepare: every device of the switch (old ∪ new) is told the new generation; each
starts its background work and answers at once. The orchestrator then polls Status until every
device reports the generation ready. Nothing has changed yet, so any failure here (a refused
Prepare, a preparation error, a timeout) is answered with Abort on every device and is
*retryable* with a fresh generation number (store keys of a failed generation are never reused).

Phase two, Commit: sent to every device at once; each answers after it switched at the agreed
step boundary, with its pause, phases and bytes. A failure here is not retryable by this module:
state may have started to move (recovery is the job of the next layer).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from dynatrain.agent.client import AgentCallError, AgentClient
from dynatrain.vps import faults
from dynatrain.vps.layout import Layout
from dynatrain.vps.topology import DEFAULT_DEVICES_PER_NODE

from .decide import stopped_answering
from dynatrain.spec.timeouts import Timeouts


class SwitchFailed(RuntimeError):
    def __init__(self, message: str, *, retryable: bool, superseded: bool = False):
        super().__init__(message)
        self.retryable = retryable
        self.superseded = superseded
        """Aborted in Prepare because a newer signal made its target wrong (not an error)."""


@dataclass
class SwitchRecord:
    """One switch as the controller saw it (the summary's and the metrics' source)."""

    generation: int
    from_layout: str
    to_layout: str
    reason: str
    workers_before: int
    workers_after: int
    step: int = 0
    pause_seconds: float = 0.0
    """The longest pause over the devices of the switch."""
    prepare_seconds: float = 0.0
    transfer_seconds: float = 0.0
    bytes: int = 0
    """Bytes sent over the network, summed over devices."""
    bytes_local: int = 0
    phases: dict = field(default_factory=dict)
    """Seconds per phase of the pause (release, scalars, transfer, rebuild), the longest over
    the devices that were training, and per device (``by_device``) for diagnosis."""
    result: str = "success"
    attempts: int = 1
    error: str = ""
    wall_time: float = field(default_factory=time.time)

    def summary(self) -> dict:
        return {"from": self.from_layout, "to": self.to_layout, "reason": self.reason,
                "generation": self.generation, "step": self.step,
                "pause_seconds": self.pause_seconds, "prepare_seconds": self.prepare_seconds,
                "transfer_seconds": self.transfer_seconds, "bytes": self.bytes,
                "bytes_local": self.bytes_local, "phases": self.phases,
                "workers_before": self.workers_before,
                "workers_after": self.workers_after, "result": self.result,
                "attempts": self.attempts, "wall_time": self.wall_time}


def _fan_out(fn, items) -> list:
    """fn(item) for every item at once; results (or the exception raised) in order."""
    def call(item):
        try:
            return fn(item)
        except Exception as e:  # collected, judged by the caller
            return e

    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        return list(pool.map(call, items))


@dataclass(frozen=True)
class Restore:
    """What a recovery switch starts from: every survivor's snapshot of ``step``; the failed
    devices' unique state from the mirrors their ``proxies`` hold."""

    step: int
    failed: tuple[int, ...]
    proxies: dict[int, int]


def switch(clients: dict[int, AgentClient], generation: int, old: Layout | None, new: Layout,
           rendezvous: str, *, reason: str, timeouts: Timeouts = Timeouts(),
           devices_per_node: int = DEFAULT_DEVICES_PER_NODE, staging_bytes: int = 0,
           restore: Restore | None = None,
           checkpoint: str = "", watch=None,
           device_nodes: dict[int, str] | None = None) -> SwitchRecord:
    """Switch the job from ``old`` to ``new`` (both with devices) as ``generation``.

    ``restore`` makes it a recovery (the old generation failed; its failed devices take no
    part); ``checkpoint`` (with ``old=None``) starts ``new`` from a checkpoint.
    ``device_nodes`` (device -> node) tells the workers where their mirrors go and which
    links the plan's transfers cross (sent for each layout whose every device it names).

    ``watch(phase)`` is called about every 0.1 s while the switch waits (``phase`` is
    ``"prepare"`` or ``"commit"``): the caller takes in the signals that arrived meanwhile.
    In Prepare it may return a reason, and the switch is aborted as *superseded*."""
    failed = set(restore.failed) if restore else set()
    members = sorted((set(old.device_of if old else ()) | set(new.device_of)) - failed)
    missing = [d for d in members if d not in clients]
    if missing:
        raise SwitchFailed(f"no agent for devices {missing}", retryable=False)
    record = SwitchRecord(generation, old.to_text() if old else "", new.to_text(), reason,
                          old.world if old else 0, new.world)
    known = device_nodes or {}

    def nodes_of(devices):                     # all or nothing: a partial list is refused
        return [known[d] for d in devices] if all(d in known for d in devices) else []

    def prepare(d):
        return clients[d].prepare(
            generation, new.to_text(), list(new.device_of), rendezvous,
            devices_per_node=devices_per_node, staging_bytes=staging_bytes,
            timeout_s=timeouts.group_s, reason=reason,
            old_layout=old.to_text() if old else "",
            old_devices=list(old.device_of) if old else [], recover=restore is not None,
            restore_step=restore.step if restore else 0,
            failed_devices=list(restore.failed) if restore else [],
            proxies=restore.proxies if restore else None, checkpoint=checkpoint,
            device_nodes=nodes_of(new.device_of),
            old_device_nodes=nodes_of(old.device_of) if old else [])

    t0 = time.monotonic()
    errors = [(d, r) for d, r in zip(members, _fan_out(prepare, members))
              if isinstance(r, Exception)]
    if errors:
        _abort(clients, members, generation, "prepare refused")
        raise SwitchFailed("; ".join(f"device {d}: {e}" for d, e in errors), retryable=True)
    deadline = t0 + timeouts.prepare_s
    waiting = set(members)
    watched = time.monotonic()
    while waiting:
        if watch is not None and time.monotonic() - watched >= 0.1:
            watched = time.monotonic()
            why = watch("prepare")
            if why:
                _abort(clients, members, generation, f"superseded: {why}")
                raise SwitchFailed(why, retryable=True, superseded=True)
        for d, st in zip(sorted(waiting), _fan_out(lambda d: clients[d].status(
                since_step=1 << 62, timeout_s=timeouts.watchdog_s), sorted(waiting))):
            if isinstance(st, Exception):
                _abort(clients, members, generation, "status failed")
                raise SwitchFailed(f"device {d}: status failed while preparing: {st}",
                                   retryable=True)
            if st.prepared_generation == generation and st.prepared_error:
                _abort(clients, members, generation, "prepare failed")
                raise SwitchFailed(f"device {d}: preparing generation {generation} failed: "
                                   f"{st.prepared_error}", retryable=True)
            if st.prepared_generation == generation and st.prepared_ready:
                waiting.discard(d)
        if waiting and time.monotonic() > deadline:
            _abort(clients, members, generation, "prepare timed out")
            raise SwitchFailed(f"devices {sorted(waiting)} were not ready for generation "
                               f"{generation} within {timeouts.prepare_s} s", retryable=True)
        if waiting:
            time.sleep(0.02)
    record.prepare_seconds = time.monotonic() - t0
    faults.inject("prepared", faults.CONTROLLER)

    replies = _commit_watching(clients, members, generation, timeouts.commit_s, watch,
                               timeouts.status_s)
    errors = [(d, r) for d, r in zip(members, replies) if isinstance(r, Exception)]
    if errors:
        record.result, record.error = "failed", "; ".join(f"device {d}: {e}" for d, e in errors)
        raise SwitchFailed(f"generation {generation} failed during commit: {record.error}",
                           retryable=False)
    record.step = max(r.step for r in replies)
    # The pause is the training's: joiners enter the switch at once and wait there for the old
    # world to reach the boundary, so their time is not a pause of anything.
    trained = [r for d, r in zip(members, replies) if old is None or d in old.device_of]
    trained = trained or list(replies)
    record.pause_seconds = max(r.pause_seconds for r in trained)
    record.transfer_seconds = max(r.phase_seconds.get("transfer", 0.0) for r in trained)
    for r in trained:
        for k, v in r.phase_seconds.items():
            record.phases[k] = max(v, record.phases.get(k, 0.0))
    record.phases["by_device"] = {d: dict(r.phase_seconds) for d, r in zip(members, replies)}
    record.bytes = sum(r.bytes_sent for r in replies)
    record.bytes_local = sum(r.bytes_local for r in replies)
    return record


def _commit_watching(clients, members: list[int], generation: int, timeout_s: float,
                     watch=None, status_s: float = 2.0) -> list:
    """Commit on every device at once; while the replies are outstanding, check every 0.1 s
    that the devices still answer (and let ``watch`` take in new signals). A device that dies
    mid-switch leaves the others waiting in the transfer until their timeout; noticing it now
    lets the controller recover at once (its recovery Prepare abandons their waits)."""
    pool = ThreadPoolExecutor(max_workers=max(1, len(members)))
    futures = [pool.submit(lambda d=d: clients[d].commit(generation, 0, timeout_s=timeout_s))
               for d in members]
    misses: dict[int, int] = {}
    if faults.armed("committed", faults.CONTROLLER):
        _when_committed(clients, members, generation)
        faults.inject("committed", faults.CONTROLLER)
    try:
        while True:
            done, pending = wait(futures, timeout=0.1)
            if not pending:
                break
            if watch is not None:
                watch("commit")     # too late to abort: what it learns waits for the next tick
            # The gRPC health check, not Status: a leaver exits once its last Status is read.
            # A device that switched is not asked (it may be a leaver on its way out); one
            # whose Commit failed is (the dead one usually has: the others wait on it).
            for d, f in zip(members, futures):
                if f.done() and f.exception() is None:
                    continue
                if clients[d].health(timeout_s=status_s):
                    misses.pop(d, None)
                    continue
                misses[d] = misses.get(d, 0) + 1
                if stopped_answering(misses[d]):
                    raise SwitchFailed(f"device {d} stopped answering during the switch to "
                                       f"generation {generation}", retryable=False)
        out = []
        for f in futures:
            try:
                out.append(f.result())
            except Exception as e:  # collected, judged by the caller
                out.append(e)
        return out
    finally:
        pool.shutdown(wait=False)   # a commit still waiting ends when its agent gives up


def _when_committed(clients, members: list[int], generation: int, timeout_s: float = 30.0):
    """Wait until every device holds the Commit of ``generation`` (or has switched already):
    the fault point ``at:committed`` fires then, not while a Commit may still be in flight."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = _fan_out(lambda d: clients[d].status(since_step=1 << 62, timeout_s=2.0),
                          members)
        if all(not isinstance(st, Exception) and (st.generation >= generation or (
                st.prepared_generation == generation and st.prepared_committed))
               for st in states):
            return
        time.sleep(0.02)


def _abort(clients, members, generation: int, reason: str, timeout_s: float = 5.0) -> None:
    def abort(d):
        try:   # a hung agent must not hold up the others' abort (nor the next decision)
            clients[d].abort(generation, reason, timeout_s=timeout_s)
        except AgentCallError:
            pass   # an agent that cannot be reached has nothing prepared that matters

    _fan_out(abort, members)

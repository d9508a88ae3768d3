"""Reading the members' progress every tick, and the watchdog over them.

:func:`poll` asks each member of the running generation for its Status: the step records it
brings are taken in by :func:`ingest` (steps, losses, throughput, the samples each data reader
consumed, the wall times of steps), and the ones that do not answer, or answer but hang outside
a collective (:func:`find_hung`), are declared failed for the next tick to recover. After a
failed switch, :func:`drop_unreachable` asks the devices it involved whether they are still
there. These functions work on a :class:`.core.JobController`'s state; its
:meth:`~.core.JobController.poll` and ``_ingest`` call them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc

from dynatrain.agent.client import AgentCallError
from dynatrain.agent.v1 import agent_pb2 as pb

from . import decide
from . import inbox as ev
from . import jobstate as js
from .errors import JobFailed
from .progress import Progress

if TYPE_CHECKING:
    from .core import JobController

State = pb.StatusResponse.State


def poll(ctl: JobController, *, judge: bool = True) -> Progress:
    """Collect step records from every member (each reports its own data reads).

    The watchdog: a member that does not answer Status within ``timeouts.status_s``
    missed one; one that has missed every call for ``timeouts.watchdog_s`` (a stopped or
    hung process) is declared failed. One that refuses the connection has exited.
    ``judge=False`` (while a switch runs: a leaver exits as it ends, and the switch
    watches its devices itself) only reads progress."""
    p = ctl.progress
    states, waits = [], {}
    now = time.monotonic()
    for d in ctl.members:
        if d in ctl.failed or d not in ctl.clients:
            continue
        try:
            st = ctl.clients[d].status(since_step=ctl._seen.get(d, 0),
                                       timeout_s=ctl.timeouts.status_s)
        except AgentCallError as e:
            # The watchdog's verdict is the job state's (:class:`.jobstate.StatusFailed`).
            ctl._apply(js.StatusFailed(d, now, slow=e.code == grpc.StatusCode.DEADLINE_EXCEEDED,
                                       error=str(e), judge=judge,
                                       watchdog_s=ctl.timeouts.watchdog_s))
            continue
        ctl._apply(js.StatusAnswered(d, time.monotonic()))
        if st.leaving and d not in ctl.doomed and decide.acts_on_notice(ctl.job):
            # Told to leave (SIGTERM with a grace period): a notice from the worker itself
            # (spec.preemptionPolicy Ignore: it is lost at its deadline, and recovered).
            ctl.log(f"device {d} is leaving ({st.leaving_in_seconds:.0f} s of its grace "
                    "period left): switching it out")
            ctl._apply(ev.Notice(d, st.leaving_in_seconds))
        if st.state == State.FAILED and judge:
            raise JobFailed(f"device {d} failed: {st.error}")
        states.append(st.state)
        if st.state == State.TRAINING:
            waits[d] = st.collective_wait_seconds
        ingest(ctl, d, st)
    if not judge:
        return p
    find_hung(ctl, waits)
    if State.INTERRUPTED in states:
        if ctl.interrupted_since is None:
            ctl.interrupted_since = time.monotonic()
    else:
        ctl.interrupted_since = None
    if states and not ctl.failed:
        p.finished = all(s == State.FINISHED for s in states)
    return p


def find_hung(ctl: JobController, waits: dict[int, float]) -> None:
    """The watchdog's second case: members that answer Status but make no progress. When
    the job has trained no step for the watchdog's time (or three steps' time, if steps
    are longer), the members that have waited in a collective for half of it are waiting
    for the ones that wait for nothing: those hang (stuck outside any collective) and are
    declared failed. When every member waits, the hang is inside the collectives and no
    one can be blamed: the collective timeout ends it."""
    limit = max(ctl.timeouts.watchdog_s, 3 * ctl._step_seconds)
    stalled = time.monotonic() - ctl._last_step_at
    if ctl.layout is None:
        return
    waiting = sorted(d for d, w in waits.items() if w >= limit / 2)
    for d in decide.hung(waits, stalled_s=stalled, limit_s=limit):
        ctl._apply(ev.DeviceFailed(d, f"hung: no step for {stalled:.1f} s while devices "
                                      f"{waiting} wait for it in a collective (watchdog "
                                      f"{limit:g} s)"))


def ingest(ctl: JobController, device: int, st) -> None:
    p = ctl.progress
    for rec in st.steps:
        if rec.step <= ctl._seen.get(device, 0):
            continue
        ctl._seen[device] = rec.step
        if rec.end_time:
            ctl.first_step_end.setdefault(rec.generation, rec.end_time)
        if rec.end_time and ctl.step_times is not None:
            key = (rec.generation, rec.step)
            start, end = rec.end_time - rec.seconds, rec.end_time
            if key in ctl.step_times:
                was = ctl.step_times[key]
                start, end = min(start, was[0]), max(end, was[1])
            ctl.step_times[key] = (start, end)
        if rec.compute_seconds or rec.communication_seconds:
            ctl.costs.add(device, rec.generation, {
                "step": rec.seconds, "compute": rec.compute_seconds,
                "communication": rec.communication_seconds,
                "redundancy": rec.redundancy_seconds, "forward": rec.forward_seconds,
                "backward": rec.backward_seconds, "memory": float(rec.memory_bytes)})
            ctl.costs.add_experts(device, rec.generation, rec.expert_tokens)
        p.losses.setdefault(rec.step, rec.loss)
        if rec.end_time:
            p.timeline[rec.step] = (rec.end_time, rec.tokens_per_second)
        if rec.sample_end > rec.sample_begin:
            p.reads.setdefault(rec.step, {})[device] = (rec.sample_begin, rec.sample_end)
        if rec.step >= p.step:
            if rec.step > p.step:
                ctl._last_step_at = time.monotonic()
                ctl._step_seconds = rec.seconds
            p.step, p.loss, p.tokens_per_second = rec.step, rec.loss, rec.tokens_per_second


def drop_unreachable(ctl: JobController, devices) -> bool:
    """After a failed switch: ask each device for its Status; fail (members) or drop (others)
    those that do not answer. True if any was gone."""
    gone = False
    for d in sorted(devices):
        client = ctl.clients.get(d)
        if client is None:           # failed, or removed while the switch ran
            gone = True
            continue
        try:
            client.status(since_step=1 << 62, timeout_s=ctl.timeouts.watchdog_s)
        except AgentCallError as e:
            gone = True
            if d in ctl.members:
                ctl._apply(ev.DeviceFailed(d, f"stopped answering during a switch: {e}"))
            else:
                ctl.log(f"device {d} is gone: {e}")
                ctl._apply(ev.DeviceLeft(d))
    return gone

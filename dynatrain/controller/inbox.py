"""The controller's inbox: what a front end saw, as typed events the controller takes in itself.

A front end (the operator, the local runner) watches the world: worker pods or processes that
came up, exited or turned unhealthy, preemption notices, spec edits, a user's layout request.
It never changes the controller's state itself. It pushes one event per signal with
:meth:`~.core.JobController.push` (from any thread), and the controller takes them in, in the
order they came, at points of its own choosing (:meth:`~.core.JobController.take_in`):

- at the start of every tick, before it decides;
- while a switch waits, right after asking the front end to look again
  (:attr:`~.core.JobController.sense`).

So a decision never sees its inputs change while it is made, and no front end's code changes
the controller inside the controller's own stack in the middle of a switch (before, the front
end's ``intake`` called ``fail_device``/``notice`` there; a pod that left in the switch in
flight was then taken for a failure before the switch's record said otherwise). A front end
that reads the controller's state right after pushing, in the same pass, takes the inbox in
first (``push(...)`` then ``take_in()``), outside a switch.

The events are plain frozen values, applied by the one function that changes the job's state,
:func:`.jobstate.decide`; tests/controller/test_jobstate.py replays tables of them against it,
and tests/controller/test_inbox.py against a controller whose agents are fakes.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any, Union

from dynatrain.spec.job import JobSpec
from dynatrain.vps.layout import Layout


@dataclass(frozen=True)
class DeviceUp:
    """A worker's agent answers: ``device`` may join (at the next decision)."""

    device: int
    client: Any
    """Its :class:`~dynatrain.agent.client.AgentClient`, which the controller now owns."""


@dataclass(frozen=True)
class Notice:
    """``device`` will be gone ``seconds`` after ``at``: the running layout must leave it."""

    device: int
    seconds: float
    at: float = field(default_factory=time.monotonic)
    """When the notice was seen (monotonic): the deadline does not move while it waits here."""


@dataclass(frozen=True)
class DeviceLeft:
    """``device`` is gone without failing: released, scaled down, a standby that exited, or
    gone after its notice."""

    device: int


@dataclass(frozen=True)
class DeviceFailed:
    """``device`` died without notice (crash, lost node, unhealthy pod): a member is recovered.
    A leaver of the switch in flight that exits is judged when the switch ends."""

    device: int
    why: str


@dataclass(frozen=True)
class SpecEdited:
    """The job's spec changed (``kubectl edit``; a scenario's spec edit)."""

    job: JobSpec


@dataclass(frozen=True)
class LayoutRequested:
    """A user asked for this layout (``parallelism.mode: fixed``)."""

    layout: Layout


Event = Union[DeviceUp, Notice, DeviceLeft, DeviceFailed, SpecEdited, LayoutRequested]
EVENTS = (DeviceUp, Notice, DeviceLeft, DeviceFailed, SpecEdited, LayoutRequested)


class Inbox:
    """Events in the order they were pushed; safe to push from any thread."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def push(self, *events: Event) -> None:
        for ev in events:
            if not isinstance(ev, EVENTS):
                raise TypeError(f"not a controller event: {ev!r}; expected one of "
                                f"{', '.join(e.__name__ for e in EVENTS)}")
            self._q.put(ev)

    def take(self) -> list[Event]:
        """Every event pushed so far, oldest first; the inbox is then empty."""
        out = []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out


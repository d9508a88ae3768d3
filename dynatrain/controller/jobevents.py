"""The job state's vocabulary: the executor's events, the actions, and a layout request.

:func:`.jobstate.decide` takes the front ends' events (:mod:`.inbox`) and the executor's own,
defined here: what the executor read (progress, each Status call), what its actions came to (a
switch begun, ended, committed; a recovery's placement and holdings; an adoption, a restart)
and the facts of a tick. It returns the actions defined here, and the tick's decisions
(:class:`~.decide.Switch`, :class:`~.decide.Recover`, :class:`~.decide.Park`,
:class:`~.decide.GiveUp`). All are frozen values; :mod:`.jobstate` imports each by name, so
``jobstate.Tick`` and the like are the same classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from dynatrain.spec.hardware import DeviceProfile
from dynatrain.vps.layout import Layout
from dynatrain.vps.topology import DEFAULT_DEVICES_PER_NODE

from . import decide as rules
from . import inbox as ev
from .measured import Measurement
from .policy import Policy


@dataclass(frozen=True)
class LayoutRequest:
    """A layout a user asked for, and the controller's answer to it."""

    layout: Layout
    step: int
    """The job's step when it was asked for."""
    state: str = "pending"
    """``pending`` (to be applied at the next decision), ``waiting`` (needs capacity),
    ``applied``, ``superseded`` (by a newer request, or withdrawn) or ``refused``."""
    answer: str = ""
    applied_step: int | None = None

    @property
    def open(self) -> bool:
        """Not yet applied, superseded or refused."""
        return self.state in ("pending", "waiting")

    def summary(self) -> dict:
        return {"layout": self.layout.to_text(), "step": self.step, "state": self.state,
                "answer": self.answer, "applied_step": self.applied_step}


# -- the executor's events -----------------------------------------------------------------------
@dataclass(frozen=True)
class Progressed:
    """The executor read the job's progress: it is at ``step``."""

    step: int


@dataclass(frozen=True)
class StatusAnswered:
    """``device`` answered its Status call at ``at`` (monotonic)."""

    device: int
    at: float


@dataclass(frozen=True)
class StatusFailed:
    """``device``'s Status call failed at ``at``: it ran out of time (``slow``: the agent may
    be busy) or was refused (``error``: the process is gone). ``judge``: whether a verdict may
    follow (not while a switch runs, which watches its devices itself); ``watchdog_s``: how
    long a device may stay silent (spec.recovery.timeouts)."""

    device: int
    at: float
    slow: bool
    error: str = ""
    judge: bool = True
    watchdog_s: float = float("inf")


@dataclass(frozen=True)
class SwitchBegan:
    """A switch (or recovery) from the running layout to ``target`` is being prepared."""

    involved: frozenset[int]
    target: Layout
    reason: str


@dataclass(frozen=True)
class SwitchEnded:
    """The switch in flight ended, committed (``ok``) or failed: then its leavers that exited
    left nothing behind and count as failed."""

    ok: bool


@dataclass(frozen=True)
class Committed:
    """The job runs ``layout`` from ``step`` on, after a switch for ``reason`` (or a
    recovery: ``recovered``, which replaced the failed devices)."""

    layout: Layout
    step: int
    reason: str
    recovered: bool = False
    displaced: str = ""
    """A recovery's answer to the pending request it did not meet (it waits again)."""


@dataclass(frozen=True)
class Adopted:
    """After a restart of the controller: the agents run ``layout``."""

    layout: Layout


@dataclass(frozen=True)
class Reconciled:
    """A switch seen failing completed on every survivor: they run ``layout`` (generation
    ``generation``); its devices without an agent are lost."""

    layout: Layout
    generation: int


@dataclass(frozen=True)
class Restarted:
    """Every worker was replaced (checkpoint-and-restart, a park): no agent, no layout."""


@dataclass(frozen=True)
class LeftOut:
    """A committed switch left these stragglers out (never usable again)."""

    devices: frozenset[int]


@dataclass(frozen=True)
class Tick:
    """Decide what the job does now, given the executor's facts (:class:`~.decide.View`'s
    fields that the state does not hold) and its policy and device profile."""

    now: float
    policy: Policy = field(compare=False)
    profile: DeviceProfile
    finished: bool = False
    last_step_at: float = 0.0
    give_up_s: float = float("inf")
    interrupted_since: float | None = None
    recover_in_memory: bool = True
    wait_below_minimum: bool = False
    speeds: tuple[tuple[int, float], ...] = ()
    measurement: Measurement | None = None
    switch_cost_s: float = 1.0
    measured_steps: tuple[tuple[str, float], ...] = ()
    share: int | None = None


@dataclass(frozen=True)
class PlaceRecovery:
    """A recovery starts (after the executor asked the survivors which generation they run):
    where does the job go, over the devices left?"""

    policy: Policy = field(compare=False)
    profile: DeviceProfile


@dataclass(frozen=True)
class Holdings:
    """The recovery to ``target`` without ``failed`` asked the survivors what they hold
    (their Status: snapshots, mirrors, the previous generation's, checkpoints): where does it
    restore from? ``device_nodes``, ``devices_per_node``: the node map to plan on."""

    target: Layout
    failed: tuple[int, ...]
    holdings: dict = field(compare=False)
    device_nodes: tuple[tuple[int, str], ...] = ()
    devices_per_node: int = DEFAULT_DEVICES_PER_NODE


@dataclass(frozen=True)
class Watch:
    """A Prepare is in flight: is its target still right?"""

    now: float


Event = Union[ev.Event, Progressed, StatusAnswered, StatusFailed, SwitchBegan, SwitchEnded,
              Committed, Adopted, Reconciled, Restarted, LeftOut, Tick, PlaceRecovery,
              Holdings, Watch]


# -- actions -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Close:
    """Close ``device``'s agent connection (after the switch in flight, which may still call
    it, when ``later``)."""

    device: int
    later: bool = False


@dataclass(frozen=True)
class Log:
    text: str


@dataclass(frozen=True)
class Answered:
    """A request's answer changed (the front end shows it)."""

    request: LayoutRequest


@dataclass(frozen=True)
class Workers:
    """The job's usable worker count changed."""

    count: int


@dataclass(frozen=True)
class Place:
    """Recover the running layout, without its ``failed`` members, to ``layout``."""

    layout: Layout
    failed: tuple[int, ...]


@dataclass(frozen=True)
class RestoreFrom:
    """Restore ``step`` of ``start`` in memory, the state of ``dead`` from the mirrors that
    ``proxies`` (dead device -> the one holding its mirror) hold; ``start`` is the running
    layout, or the generation before it (``earlier`` says so, for the log)."""

    start: Layout
    dead: tuple[int, ...]
    step: int
    proxies: tuple[tuple[int, int], ...] = ()
    earlier: str = ""


@dataclass(frozen=True)
class FromCheckpoint:
    """No copy in memory survives: restart the target from the newest checkpoint."""

    path: str
    step: int


@dataclass(frozen=True)
class Abort:
    """Abort the Prepare in flight: a newer signal made its target wrong."""

    why: str


Action = Union[Close, Log, Answered, Workers, Place, RestoreFrom, FromCheckpoint, Abort,
               rules.Action]

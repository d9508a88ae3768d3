"""Capacity changes for a local run, from a YAML file: what a cluster would do to the job.

```yaml
initialWorkers: 4          # optional; default spec.elastic.workers or maxWorkers
events:
  - atStep: 15
    preempt: {workers: [3], noticeSeconds: 30}   # notice now, the process is killed later
  - atStep: 20
    evict: {workers: [2], graceSeconds: 30}      # SIGTERM now (what Kubernetes sends), SIGKILL
                                                 # at the deadline: the worker reports it is
                                                 # leaving and is switched out live
  - atStep: 30
    join: 1                                     # new workers start in standby
  - atStep: 45
    layout: "dp=1,tp=2,pp=2"                     # a user fixes the layout (kubectl edit)
  - atStep: 60
    kill: {workers: [1]}                         # dies with no notice (kill -9): recovery
  - atStep: 70
    hang: {workers: [2]}                         # stops (SIGSTOP), alive but silent: the
                                                 # watchdog declares it failed, it is killed
  - atStep: 75
    minEfficiency: 0.5                           # spec.elastic.minEfficiency set (kubectl
                                                 # edit): workers that add less are released
```

Workers are named by their device id: the initial workers are 0..N-1, joiners take the next
ids. An event fires once the job has reached its step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from dynatrain.vps.layout import Layout, LayoutError, parse_layout

KINDS = ("preempt", "evict", "join", "layout", "kill", "hang", "minEfficiency")


class ScenarioError(ValueError):
    """A scenario file is not valid; the message names the event and field."""


@dataclass(frozen=True)
class Event:
    at_step: int
    kind: str
    workers: tuple[int, ...] = ()
    notice_seconds: float = 30.0
    """A preemption's notice, or an eviction's grace period."""
    count: int = 0
    layout: Layout | None = None
    value: float = 0.0
    """``minEfficiency``: the new ``spec.elastic.minEfficiency``."""

    def describe(self) -> str:
        if self.kind == "preempt":
            return (f"preemption notice for worker(s) {list(self.workers)} "
                    f"({self.notice_seconds:g} s)")
        if self.kind == "evict":
            return (f"worker(s) {list(self.workers)} evicted (SIGTERM, "
                    f"{self.notice_seconds:g} s grace)")
        if self.kind == "kill":
            return f"worker(s) {list(self.workers)} killed without notice"
        if self.kind == "hang":
            return f"worker(s) {list(self.workers)} hang (stopped, still alive)"
        if self.kind == "join":
            return f"{self.count} worker(s) join"
        if self.kind == "minEfficiency":
            return f"spec.elastic.minEfficiency set to {self.value:g}"
        return f"layout {self.layout.to_text()} requested"


@dataclass(frozen=True)
class Scenario:
    initial_workers: int | None
    events: tuple[Event, ...]


def parse_scenario(doc, *, source: str = "scenario") -> Scenario:
    if doc is None:
        return Scenario(None, ())
    if not isinstance(doc, dict):
        raise ScenarioError(f"{source}: expected a mapping with 'events', got "
                            f"{type(doc).__name__}")
    problems = []
    unknown = set(doc) - {"initialWorkers", "events"}
    if unknown:
        problems.append(f"unknown keys {sorted(unknown)}; valid: initialWorkers, events")
    initial = doc.get("initialWorkers")
    if initial is not None and (not isinstance(initial, int) or isinstance(initial, bool)
                                or initial < 1):
        problems.append(f"initialWorkers={initial!r} must be a positive integer")
    raw = doc.get("events", [])
    if not isinstance(raw, list):
        problems.append(f"events must be a list, got {type(raw).__name__}")
        raw = []
    events = []
    for i, e in enumerate(raw):
        where = f"events[{i}]"
        if not isinstance(e, dict):
            problems.append(f"{where} must be a mapping, got {e!r}")
            continue
        step = e.get("atStep")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            problems.append(f"{where}.atStep={step!r} must be an integer >= 0")
            continue
        kinds = [k for k in KINDS if k in e]
        extra = set(e) - set(KINDS) - {"atStep"}
        if len(kinds) != 1 or extra:
            problems.append(f"{where} must have atStep and exactly one of {', '.join(KINDS)}"
                            + (f" (unknown keys {sorted(extra)})" if extra else ""))
            continue
        kind = kinds[0]
        value = e[kind]
        if kind in ("preempt", "evict"):
            field = "noticeSeconds" if kind == "preempt" else "graceSeconds"
            if not isinstance(value, dict) or not isinstance(value.get("workers"), list) \
                    or not value["workers"] or set(value) - {"workers", field} \
                    or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0
                               for w in value["workers"]):
                problems.append(f"{where}.{kind} must be {{workers: [ids], {field}: N}} "
                                f"with worker ids >= 0, got {value!r}")
                continue
            notice = value.get(field, 30)
            if isinstance(notice, bool) or not isinstance(notice, (int, float)) or notice <= 0:
                problems.append(f"{where}.{kind}.{field}={notice!r} must be positive")
                continue
            events.append(Event(step, kind, workers=tuple(value["workers"]),
                                notice_seconds=float(notice)))
        elif kind in ("kill", "hang"):
            if not isinstance(value, dict) or not isinstance(value.get("workers"), list) \
                    or not value["workers"] or set(value) != {"workers"} \
                    or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0
                               for w in value["workers"]):
                problems.append(f"{where}.{kind} must be {{workers: [ids]}} with worker ids "
                                f">= 0, got {value!r}")
                continue
            events.append(Event(step, kind, workers=tuple(value["workers"])))
        elif kind == "join":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{where}.join={value!r} must be a positive worker count")
                continue
            events.append(Event(step, kind, count=value))
        elif kind == "minEfficiency":
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value < 1:
                problems.append(f"{where}.minEfficiency={value!r} must be a number in [0, 1)")
                continue
            events.append(Event(step, kind, value=float(value)))
        else:
            try:
                events.append(Event(step, kind, layout=parse_layout(value)))
            except LayoutError as err:
                problems.append(f"{where}.layout: {err}")
    if problems:
        raise ScenarioError(f"{source}: " + "; ".join(problems))
    return Scenario(initial, tuple(sorted(events, key=lambda ev: ev.at_step)))


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    if not path.is_file():
        raise ScenarioError(f"scenario file {str(path)!r} does not exist")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ScenarioError(f"{path}: not valid YAML: {e}") from None
    return parse_scenario(doc, source=str(path))

"""Where a machine's CPU goes: its busy time and each kind of process's share, from /proc.

On a 2-core CI machine the test suite is CPU-bound, so it gets shorter only by using less CPU,
and the question is whose: the forked training workers, the apiserver, etcd, the operator,
pytest and its pod runner, containerd... :class:`Sampler` reads every process's CPU time from
``/proc/<pid>/stat`` and adds the deltas between samples per kind of process (:func:`kind`);
:func:`machine_busy_seconds` is the machine's own busy time. ``tools/cpu-by-process`` runs a
command under them; ``benchmarks/solver_vs_measured.py`` uses the busy time to tell the load
of other processes from its own. Standard library only (the tool runs with any Python 3);
Linux only.
"""

from __future__ import annotations

import collections
import os
from typing import NamedTuple

TICK = os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds this machine has spent busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal: all but idle and iowait
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK


def kind(pid: int) -> str | None:
    """What process ``pid`` is, for the table (None: it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return None
    if not argv:
        return "kernel"                              # its threads (kworker, ksoftirqd...)
    exe = os.path.basename(argv[0])
    if not exe.startswith("python"):
        return exe.split(":")[0] or comm
    args = argv[1:]
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
        args = args[1:]                              # interpreter flags (-B, -I, -u...)
    if args[:1] == ["-c"]:
        code = args[1] if len(args) > 1 else ""
        return "forked workers" if "multiprocessing.forkserver" in code else "python -c"
    if args[:1] == ["-m"] and len(args) > 1:
        if args[1] == "dynatrain" and len(args) > 2:
            return f"dynatrain {args[2]}"
        return args[1]
    if args:
        name = os.path.basename(args[0])
        return "dynatrain " + args[1] if name == "dynatrain" and len(args) > 1 else name
    return "python"


class _Seen(NamedTuple):
    name: str
    ppid: int
    started: int                  # start time, in ticks since boot: tells a reused pid apart
    used: int                     # its own utime + stime
    reaped: int                   # cutime + cstime: its children that it has waited for


class Sampler:
    """CPU ticks per kind of process, from the deltas of /proc/<pid>/stat between samples.

    A process that exits between two samples would lose what it used since the last one, and
    one that lived entirely between two (a compiler run of ``go build``, a ``kubectl`` call)
    would not be seen at all. Both reach their parent's ``cutime``/``cstime`` when it waits for
    them, so what a parent's reaped time grows by, less what was already counted of its
    children that went away, is counted too, under ``<parent's kind> (children)``.
    """

    def __init__(self) -> None:
        self.ticks: collections.Counter[str] = collections.Counter()
        self._last: dict[int, _Seen] = {}
        self._first = True

    def sample(self) -> None:
        now: dict[int, _Seen] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ppid, started = int(rest[1]), int(rest[19])
            used = int(rest[11]) + int(rest[12])
            reaped = int(rest[13]) + int(rest[14])
            before = self._last.get(pid)
            if before is not None and before.started == started:
                now[pid] = before._replace(ppid=ppid, used=used, reaped=reaped)
                self.ticks[before.name] += used - before.used
                continue
            name = kind(pid)
            if name is None:
                continue
            now[pid] = _Seen(name, ppid, started, used, reaped)
            if not self._first:
                # Started since the last sample, so all of its time and its reaped children's
                # (younger than it) is new.
                self.ticks[name] += used
                if reaped:
                    self.ticks[f"{name} (children)"] += reaped
        self._count_reaped(now)
        self._last = now
        self._first = False

    def _count_reaped(self, now: dict[int, _Seen]) -> None:
        # What each process that went away was counted with (its own time and its reaped
        # children's), charged to its nearest ancestor still alive: that ancestor's reaped time
        # holds it again once the processes between them are waited for.
        counted: collections.Counter[int] = collections.Counter()
        for pid, gone in self._last.items():
            if pid in now and now[pid].started == gone.started:
                continue
            ancestor, hops = gone.ppid, 0
            while ancestor not in now and ancestor in self._last and hops < 64:
                ancestor, hops = self._last[ancestor].ppid, hops + 1
            counted[ancestor] += gone.used + gone.reaped
        for pid, seen in now.items():
            before = self._last.get(pid)
            if before is None or before.started != seen.started:
                continue
            more = seen.reaped - before.reaped - counted[pid]
            if more > 0:        # < 0: an orphan it adopted (a subreaper) was counted before
                self.ticks[f"{seen.name} (children)"] += more

    def seconds(self) -> collections.Counter[str]:
        """CPU seconds per kind of process so far."""
        return collections.Counter({name: t / TICK for name, t in self.ticks.items()})

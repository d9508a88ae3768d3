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


class Sampler:
    """CPU ticks per kind of process, from the deltas of /proc/<pid>/stat between samples."""

    def __init__(self) -> None:
        self.ticks: collections.Counter[str] = collections.Counter()
        self._last: dict[int, tuple[str, int]] = {}
        self._first = True

    def sample(self) -> None:
        seen = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            used = int(rest[11]) + int(rest[12])     # utime + stime
            seen.add(pid)
            if pid in self._last:
                name, before = self._last[pid]
                self.ticks[name] += used - before
                self._last[pid] = (name, used)
                continue
            name = kind(pid)
            if name is None:
                continue
            if not self._first:                      # started since the last sample
                self.ticks[name] += used
            self._last[pid] = (name, used)
        for pid in set(self._last) - seen:
            del self._last[pid]
        self._first = False

    def seconds(self) -> collections.Counter[str]:
        """CPU seconds per kind of process so far."""
        return collections.Counter({name: t / TICK for name, t in self.ticks.items()})

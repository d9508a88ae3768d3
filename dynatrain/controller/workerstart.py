"""Starting the local runner's worker processes: forked from a server with torch imported, or
each a fresh interpreter.

A worker (:mod:`dynatrain.agent.worker`) spends about 5 s of CPU before its agent answers on a
2-core machine: about 2 s importing torch and 2.7 s in ``torch._dynamo``, which every torch
optimizer imports on first use (``torch._disable_dynamo``), paid by the worker's warm-up. A
job of four workers pays that four times at start and once more per joiner, while the job's
other workers compete for the same cores.

``forkserver`` (the default) starts each worker from the fork server of
:mod:`dynatrain.trainer.processes`, which imports those libraries once (its ``PRELOAD``) and
forks: a worker starts in milliseconds plus its own imports of this project. Like a fresh
interpreter, it inherits no threads, locks or OpenMP state from the runner; it gets the
environment the runner gives it (its ``os.environ`` is replaced before any project module is
imported, so what they read at import is read there), its output goes to its log file on file
descriptors 1 and 2, and its stdin is ``/dev/null``; it does not import the runner's main
module (multiprocessing's children do: see :func:`start_worker`). It runs the same ``main`` as
``python -m dynatrain.agent.worker`` with the same arguments. ``exec`` starts that command as a
new interpreter instead: ``DYNATRAIN_WORKER_START=exec`` (``dynatrain run --worker-start``),
and the default of a runner that restarts the job on failure (the checkpoint-and-restart
baseline: a restarted worker stands for a new pod).

Either way the runner holds a handle with the part of :class:`subprocess.Popen` it uses
(``pid``, ``poll``, ``returncode``, ``wait``, ``kill``, ``send_signal``), and the worker's exit
code means the same: its ``main``'s return value, or minus the signal that killed it.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

START_ENV = "DYNATRAIN_WORKER_START"
METHODS = ("forkserver", "exec")
DEFAULT_METHOD = "forkserver"


def worker_start_method(value: str | None = None, *, restarts: bool = False) -> str:
    """The start method asked for (``value``, else ``$DYNATRAIN_WORKER_START``, else the
    default: ``exec`` where the job is restarted on failure (``restarts``), since that mode is
    the checkpoint-and-restart baseline and its restarted workers stand for new pods, which
    start a fresh interpreter); a bad one is a ``ValueError`` naming the valid ones."""
    source = "--worker-start" if value is not None else START_ENV
    default = "exec" if restarts else DEFAULT_METHOD
    method = value if value is not None else (os.environ.get(START_ENV) or default)
    if method not in METHODS:
        raise ValueError(f"worker start method {method!r} (from {source}) is not one of "
                         f"{', '.join(METHODS)}")
    return method


def worker_command(argv: list[str]) -> list[str]:
    """The command line of a worker started as a new interpreter."""
    return [sys.executable, "-m", "dynatrain.agent.worker", *argv]


class ForkedWorker:
    """A worker forked from the fork server, seen as the :class:`subprocess.Popen` subset the
    runner uses."""

    def __init__(self, process) -> None:
        self._process = process
        self.pid: int = process.pid
        self.stdout = self.stderr = None
        """The read ends of its output pipes, when it writes to pipes (see fork_worker)."""

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:          # as Popen: nothing once it has exited
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
NAME = "dynatrain worker"
"""The multiprocessing name of every forked worker (``NAME <log stem>``)."""


@atexit.register
def _kill_forked_at_exit() -> None:
    # multiprocessing joins its live children when the interpreter exits; a worker still
    # running then (the runner stopped on an error) would hold the exit up until its parent
    # watch noticed. A worker started with exec is not waited for; this one is killed first.
    import multiprocessing

    for p in multiprocessing.active_children():
        if p.name.startswith(NAME):
            p.kill()


def _run(argv: list[str], environ: dict[str, str], output, new_session: bool) -> None:
    """The forked worker: the starter's environment for it, its output on stdout and stderr
    (a log file's path, or the write ends of two pipes), and the worker's main."""
    os.environ.clear()
    os.environ.update(environ)
    if new_session:
        os.setsid()
    if isinstance(output, str):
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    else:
        for target, pipe in zip((1, 2), output):
            os.dup2(pipe.fileno(), target)
            pipe.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    # The worker's parent is the fork server, which exits when every holder of its "alive"
    # pipe's write end is gone: the starter (even killed), and each child, which
    # multiprocessing hands one so that it can start processes of its own. A worker starts
    # none: it closes its copy, so that the server ends with the starter, and the worker with
    # the server (it watches its parent, or has Linux kill it when the server dies).
    from multiprocessing import forkserver

    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    if "--parent-pid" in argv:
        # The worker stops (and says why in its log) when its parent changes (os.getppid);
        # the parent to watch is the fork server.
        argv = list(argv)
        argv[argv.index("--parent-pid") + 1] = str(os.getppid())
    elif sys.platform == "linux":
        # One that does not watch (a pod's) has Linux kill it with the server.
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    from dynatrain.agent import worker

    sys.argv = ["dynatrain.agent.worker", *argv]
    sys.exit(worker.main(argv))


def start_worker(argv: list[str], env: dict[str, str], log: Path, method: str):
    """Start one worker with ``argv`` (its command-line arguments) and environment ``env``,
    its output in ``log``; returns a Popen-like handle."""
    if method == "exec":
        with open(log, "w") as f:
            return subprocess.Popen(worker_command(argv), stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env)
    return fork_worker(argv, env, log=log)


def fork_worker(argv: list[str], env: dict[str, str], *, log: Path | None = None,
                new_session: bool = False) -> ForkedWorker:
    """Fork one worker from the fork server. Its output goes to ``log``, or, without one, to
    two pipes whose read ends are the handle's ``stdout`` and ``stderr`` (as with
    ``Popen(stdout=PIPE, stderr=PIPE)``); ``new_session`` makes it a session leader (as
    ``Popen(start_new_session=True)``)."""
    from multiprocessing.connection import Connection

    from dynatrain.trainer import processes

    ctx = processes.context("forkserver")
    pipes = None if log is not None else (os.pipe(), os.pipe())
    # The write ends travel to the child as Connections, which multiprocessing passes to the
    # fork server over its socket (a plain fd number would mean nothing there).
    output = str(log) if pipes is None else tuple(Connection(w, readable=False)
                                                  for _, w in pipes)
    process = ctx.Process(target=_run, args=(list(argv), dict(env), output, new_session),
                          name=f"{NAME} {Path(log).stem if log is not None else 'piped'}")
    # multiprocessing has a child import the caller's main module (a script is run again as
    # __mp_main__, and one without an `if __name__ == "__main__"` guard would start its job
    # again in every worker). A worker needs nothing from it: while the child's preparation
    # data is taken, __main__ is an empty module.
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        process.start()
    except BaseException:
        if pipes is not None:
            for end in (*pipes[0], *pipes[1]):
                os.close(end)
        raise
    finally:
        sys.modules["__main__"] = main
    handle = ForkedWorker(process)
    if pipes is not None:
        for conn in output:
            conn.close()                              # the child holds its own copies
        handle.stdout = os.fdopen(pipes[0][0], "rb", buffering=0)
        handle.stderr = os.fdopen(pipes[1][0], "rb", buffering=0)
    return handle

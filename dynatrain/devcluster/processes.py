"""Child processes of the dev cluster: start, wait for readiness, stop.

Each component (etcd, kube-apiserver, kube-scheduler, kwok) runs as a
:class:`Component`: its own session and process group, so that stopping it
reaches every process it may have forked and a Ctrl-C in the terminal does
not race our orderly shutdown; stdout and stderr go to one log file per
component. Waiting is always bounded: :func:`wait_until` polls a probe until
it succeeds, the component dies (reported with its exit code and log), or the
deadline passes (reported with the probe's last error and the log).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .errors import DevClusterError

_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent() -> None:
    """In the child: ask Linux to SIGKILL it when the starting thread dies.

    A new session shields the component from the terminal's Ctrl-C (we stop
    it in order ourselves) but also from its parent's death: without this, a
    test run killed with SIGKILL would leave etcd and the apiserver running.
    """
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


@dataclass(frozen=True, kw_only=True)
class Component:
    """A started component: its name, process and log file."""

    name: str
    process: subprocess.Popen
    log: Path

    @classmethod
    def start(cls, name: str, argv: Sequence[str], *, log: Path, cwd: Path) -> Component:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            out.write(f"$ {' '.join(argv)}\n".encode())
            out.flush()
            try:
                proc = subprocess.Popen(
                    list(argv), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            except OSError as exc:
                raise DevClusterError(f"{name}: cannot execute {argv[0]}: {exc}") from exc
        return cls(name=name, process=proc, log=log)

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise DevClusterError(
                f"{self.name} exited with code {code}; log: {self.log}\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(cannot read {self.log}: {exc})"
        return "\n".join("    " + line for line in text[-lines:])

    def stop(self, timeout: datetime.timedelta) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``timeout``."""
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout.total_seconds())
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait(timeout=timeout.total_seconds())
        # The leader may be gone while children it forked linger in the group.
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass  # the whole group has exited: exactly what stopping wants


def wait_until(
    what: str, probe: Callable[[], object], *, timeout: datetime.timedelta,
    component: Component | None = None,
) -> object:
    """Poll ``probe`` until it returns a truthy value; return that value.

    ``probe`` signals "not yet" by returning a falsy value or raising an
    exception; the last exception is quoted if the wait times out.
    ``component``, when given, is checked between polls so that a crash is
    reported at once, with its exit code, instead of as a timeout.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    last_error: str = "probe never succeeded"
    while True:
        if component is not None:
            component.check_alive()
        try:
            result = probe()
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
            last_error = f"{type(exc).__name__}: {exc}"
        else:
            if result:
                return result
            last_error = f"probe returned {result!r}"
        if time.monotonic() > deadline:
            where = f"; log: {component.log}\n{component.log_tail()}" if component else ""
            raise DevClusterError(
                f"timed out after {timeout.total_seconds():.0f}s waiting for {what} "
                f"(last: {last_error}){where}")
        time.sleep(_POLL_S)


def check_output(argv: Sequence[str], *, what: str, timeout: float, cwd: Path | None = None,
                 error: type[DevClusterError] = DevClusterError) -> str:
    """Run a short command to completion; its stdout, or ``error`` naming ``what`` failed,
    the command and its output."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              cwd=cwd)
    except FileNotFoundError as exc:
        raise error(f"{what}: `{argv[0]}` not found") from exc
    except subprocess.TimeoutExpired as exc:
        raise error(f"{what}: `{shlex.join(argv)}` did not finish in {timeout:.0f} s") from exc
    if proc.returncode != 0:
        raise error(f"{what}: `{shlex.join(argv)}` failed with exit code "
                    f"{proc.returncode}:\n{(proc.stdout + proc.stderr).strip()}")
    return proc.stdout

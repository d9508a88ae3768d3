"""How the local runner starts its workers (dynatrain.controller.workerstart): forked from a
server that has torch imported, or a new interpreter each; the same worker either way.

The runs with a job (a worker forked per device, its environment, its log) are the local
runner's own tests (tests/controller/test_run.py, test_chaos.py, whose fault trials reach their
workers through the environment); these check what the fork adds: the exit code and log of the
same command, a runner killed without notice, and a script without a main guard.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from dynatrain.controller.workerstart import (METHODS, START_ENV, fork_worker, start_worker,
                                              worker_start_method)


@pytest.mark.parametrize("method", METHODS)
def test_a_bad_argument_exits_2_with_the_workers_message_in_its_log(method, tmp_path):
    log = tmp_path / "worker-0.log"
    proc = start_worker(["--job", str(tmp_path / "job.yaml"), "--device", "0",
                         "--log-every", "-1"], {"PATH": "/usr/bin:/bin"}, log, method)
    assert proc.wait(timeout=120) == 2
    assert proc.poll() == 2 and proc.returncode == 2
    assert "--log-every -1 is invalid" in log.read_text()


def test_a_worker_forked_onto_pipes_writes_them_like_a_popen_with_pipes(tmp_path):
    # The dev cluster's pod runner reads a pod's output from two pipes (its logs, `kubectl
    # logs`): a worker forked for a pod gets its own session and writes there, and its pipes
    # close when it exits.
    proc = fork_worker(["--job", str(tmp_path / "job.yaml"), "--device", "0",
                        "--log-every", "-1"], {"PATH": "/usr/bin:/bin"}, new_session=True)
    out, err = proc.stdout.read(), proc.stderr.read()        # until the worker closes them
    assert proc.wait(timeout=120) == 2
    assert b"--log-every -1 is invalid" in err and b"is invalid" not in out


def test_the_start_method_is_checked_and_the_restart_baseline_execs(monkeypatch):
    monkeypatch.delenv(START_ENV, raising=False)
    assert worker_start_method() == "forkserver"
    assert worker_start_method(restarts=True) == "exec"
    assert worker_start_method("forkserver", restarts=True) == "forkserver"
    monkeypatch.setenv(START_ENV, "exec")
    assert worker_start_method() == "exec"
    monkeypatch.setenv(START_ENV, "fork")
    with pytest.raises(ValueError, match=r"'fork' \(from DYNATRAIN_WORKER_START\) is not one "
                                         r"of forkserver, exec"):
        worker_start_method()
    with pytest.raises(ValueError, match=r"'spawn' \(from --worker-start\)"):
        worker_start_method("spawn")


RUNNER = textwrap.dedent("""
    # No `if __name__ == "__main__"` guard, on purpose: the forked worker must not run this.
    import os, sys, time
    from pathlib import Path
    from dynatrain.controller.workerstart import start_worker
    out = Path(sys.argv[1])
    with open(out / "runs", "a") as f:
        f.write(f"{os.getpid()}\\n")
    job = out / "job.yaml"
    job.write_text("apiVersion: dynatrain.io/v1alpha1\\nkind: DynaTrainJob\\n"
                   "metadata: {name: w}\\nspec: {model: {preset: gpt-tiny}, "
                   "elastic: {minWorkers: 1, maxWorkers: 1}, globalBatchSize: 2, "
                   "training: {steps: 2, seqLen: 16}}\\n")
    token = out / "token"
    token.write_text("t" * 32)
    proc = start_worker(["--job", str(job), "--device", "0", "--token-file", str(token),
                         "--ready-file", str(out / "ready"), "--threads", "1",
                         "--backend", "gloo", "--parent-pid", str(os.getpid())],
                        dict(os.environ), out / "worker.log", "forkserver")
    print(proc.pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.timeout(180)
def test_a_forked_worker_stops_when_its_runner_is_killed_and_never_runs_the_runners_script(
        tmp_path):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    runner = subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(runner.stdout.readline())
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and _alive(pid), \
                (tmp_path / "worker.log").read_text()
            assert runner.poll() is None
            time.sleep(0.1)
    finally:
        runner.kill()                                   # no notice, no clean-up
        runner.wait()
    deadline = time.monotonic() + 30
    while _alive(pid):
        assert time.monotonic() < deadline, "the worker outlived its runner by 30 s"
        time.sleep(0.2)
    assert "parent process" in (tmp_path / "worker.log").read_text()
    # The script ran once: the worker did not import it again as multiprocessing's children
    # do with a caller's main module.
    assert (tmp_path / "runs").read_text().split() == [str(runner.pid)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False

"""tools/pytest-shards, the way `make test` runs the suite: every test file runs in exactly one
session, the cluster lanes wait for the prerequisites while the others run, a floating suite
runs once in whichever lane is free, and a failed prerequisite fails the cluster lanes (not
silently skipped) while the rest still runs."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load():
    path = str(ROOT / "tools" / "pytest-shards")
    loader = importlib.machinery.SourceFileLoader("pytest_shards", path)
    spec = importlib.util.spec_from_loader("pytest_shards", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def sessions_of(shards, path: str, commands) -> list[str]:
    """The sessions whose command line takes ``path`` (a path inside one of its arguments and
    inside none of its --ignore=)."""
    fixed, floating = commands
    out = []
    for name, cmd in [(s.name, c) for s, c in fixed] + floating:
        args = cmd[3:]
        paths = [a for a in args if not a.startswith("-")]
        ignores = [a.split("=", 1)[1] for a in args if a.startswith("--ignore=")]
        if shards._inside(path, paths) and not shards._inside(path, ignores):
            out.append(name)
    return out


@pytest.mark.parametrize("cpus", [2, 4])
def test_every_test_file_runs_in_exactly_one_session(cpus):
    shards = load()
    commands = shards._commands([], "/tmp/base", cpus)
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    assert len(files) > 100
    where = {f: sessions_of(shards, f, commands) for f in files}
    assert {f: s for f, s in where.items() if len(s) != 1} == {}
    assert where["tests/controller/test_chaos.py"] == ["chaos"]
    assert where["tests/k8s/test_operator.py"] == ["cluster" if cpus == 2 else "cluster-a"]
    assert where["tests/devcluster/test_kueue.py"] == ["cluster" if cpus == 2 else "cluster-b"]
    assert where["tests/controller/test_overlap.py"] == ["overlap"]
    assert where["tests/controller/test_recovery.py"] == ["processes"]


def fake_suite(tmp_path: Path, failing: str = "") -> Path:
    """A repository root with a tests tree of three one-test files: a cluster one that needs
    the prerequisites' file, a process one, and a floating one."""
    (tmp_path / "tests" / "k8s").mkdir(parents=True)
    (tmp_path / "tests" / "float").mkdir()
    (tmp_path / "tests" / "k8s" / "test_c.py").write_text(
        "import os\n"
        "def test_c():\n"
        "    assert os.path.exists('built')\n")
    (tmp_path / "tests" / "test_p.py").write_text(
        "def test_p():\n"
        f"    assert {failing != 'p'}\n")
    (tmp_path / "tests" / "float" / "test_f.py").write_text("def test_f():\n    pass\n")
    return tmp_path


def run_shards(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """tools/pytest-shards with its lists pointed at the fake suite, run in ``root``."""
    script = (
        "import sys\n"
        f"sys.argv = ['pytest-shards', *{list(args)!r}, '-p', 'no:cacheprovider', '-q']\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from test_pytest_shards import load\n"
        "m = load()\n"
        "m.TWO_SHARDS = [m.Shard('cluster', ('tests/k8s',), '127.20.0.0/16', needs_tools=True),\n"
        "                m.Shard('processes', ('tests',), '127.22.0.0/16')]\n"
        "m.THREE_SHARDS = m.TWO_SHARDS\n"
        "m.FLOATING = [('float', ('tests/float',))]\n"
        "sys.exit(m.main(sys.argv[1:]))\n")
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=root, capture_output=True, text=True, timeout=120,
        env={**os.environ, "DYNATRAIN_TEST_SHARDING": "on", **(env or {}),
             "PYTHONPATH": ""})


def results(out: str) -> dict[str, str]:
    """Each session's `[phase] test: pytest[NAME]: N s (exit RC)` line, as NAME -> RC."""
    found = {}
    for line in out.splitlines():
        if line.startswith("[phase] test: pytest[") and "(exit " in line:
            found[line.split("[")[2].split("]")[0]] = line.rsplit("(exit ", 1)[1].rstrip(")")
    return found


def test_the_cluster_lane_waits_for_the_prerequisites_and_every_session_runs_once(tmp_path):
    root = fake_suite(tmp_path)
    # the cluster test passes only once the prerequisite made its file; the process lane
    # does not wait for it (it ends before the prerequisite's sleep does)
    out = run_shards(root, "--prerequisites", "sleep 3 && touch built")
    assert out.returncode == 0, out.stdout + out.stderr
    assert results(out.stdout) == {"cluster": "0", "processes": "0", "float": "0"}
    # each test ran once: one session's "1 passed" each (and its summary line at the end)
    assert sorted(x.split(":")[0] for x in out.stdout.splitlines()
                  if x.endswith("s") and ": 1 passed in " in x) == ["cluster", "float",
                                                                      "processes"]
    assert sum(" 1 passed in " in x for x in out.stdout.splitlines()
               if x.startswith("[")) == 3
    lines = out.stdout.splitlines()
    done = lines.index(next(x for x in lines if x.startswith("[phase] test: cluster tools: ")
                            and "(exit 0)" in x))
    processes_started = next(i for i, x in enumerate(lines)
                             if x.startswith("[phase] test: pytest[processes]: started"))
    cluster_started = next(i for i, x in enumerate(lines)
                           if x.startswith("[phase] test: pytest[cluster]: started"))
    assert processes_started < done < cluster_started
    # the floating suite ran in the lane that was free first: the process lane
    assert any(x.startswith("[phase] test: pytest[float]: started") and "in lane processes" in x
               for x in lines), out.stdout


def test_a_failed_prerequisite_fails_the_cluster_lane_and_the_rest_runs(tmp_path):
    root = fake_suite(tmp_path)
    out = run_shards(root, "--prerequisites", "echo cannot build; exit 3")
    assert out.returncode == 3, out.stdout + out.stderr
    assert results(out.stdout) == {"cluster": "3", "processes": "0", "float": "0"}
    assert "[tools] cannot build" in out.stdout
    assert "not run: the cluster tools failed" in out.stdout


def test_a_failing_session_fails_the_run_and_one_lane_can_be_asked_for(tmp_path):
    root = fake_suite(tmp_path, failing="p")
    out = run_shards(root, "--prerequisites", "touch built")
    assert out.returncode == 1 and results(out.stdout)["processes"] == "1"
    # the failed test is named again after the summary lines: a CI log's tail names it
    tail = out.stdout.splitlines()
    tail = tail[tail.index("--- failed tests"):]
    assert tail[1].startswith("processes: FAILED tests/test_p.py::test_p - assert False"), tail
    assert len(tail) == 2, tail
    # only the floating suite: no prerequisites run, one lane of its own
    root = fake_suite(tmp_path / "again")
    out = run_shards(root, "--prerequisites", "touch built", env={"DYNATRAIN_SHARDS": "float"})
    assert out.returncode == 0 and results(out.stdout) == {"float": "0"}
    assert not (root / "built").exists() and "cluster tools" not in out.stdout
    out = run_shards(root, env={"DYNATRAIN_SHARDS": "nosuch"})
    assert out.returncode == 2 and "'nosuch'" in out.stderr and "float" in out.stderr


def test_setup_first_the_early_builds_beside_it_and_an_also_command_floats(tmp_path):
    root = fake_suite(tmp_path)
    (root / "tests" / "test_p.py").write_text(
        "import os\n"
        "def test_p():\n"
        "    assert os.path.exists('set-up')\n")
    # the early command runs while the setup still sleeps (it finds no set-up yet), the
    # prerequisite's build finds what it made; the sessions find the setup's file
    out = run_shards(root, "--setup", "sleep 2 && touch set-up",
                     "--early", "test ! -e set-up && touch early-built",
                     "--prerequisites", "test -e early-built && touch built",
                     "--also", "smoke=echo smoke ran; test -e set-up")
    assert out.returncode == 0, out.stdout + out.stderr
    assert results(out.stdout) == {"cluster": "0", "processes": "0", "float": "0"}
    lines = out.stdout.splitlines()

    def at(prefix: str) -> int:
        return next(i for i, x in enumerate(lines) if x.startswith(prefix))

    assert at("[phase] test: early builds: started") < at("[phase] test: setup: 2 s (exit 0)")
    assert at("[phase] test: setup: 2 s (exit 0)") < at("[phase] test: pytest[processes]: "
                                                        "started")
    assert "[smoke] smoke ran" in lines
    assert sum(x.startswith("[phase] test: smoke: ") and x.endswith("(exit 0)")
               for x in lines) == 1
    # an --also command that fails fails the run, and says which
    out = run_shards(fake_suite(tmp_path / "two"), "--prerequisites", "touch built",
                     "--also", "smoke=exit 4")
    assert out.returncode == 4 and "[phase] test: smoke: 0 s (exit 4)" in out.stdout


def test_a_failed_setup_ends_the_run_before_any_session(tmp_path):
    root = fake_suite(tmp_path)
    out = run_shards(root, "--setup", "echo no network; exit 7", "--prerequisites", "touch built")
    assert out.returncode == 7, out.stdout + out.stderr
    assert "[setup] no network" in out.stdout and results(out.stdout) == {}
    assert not (root / "built").exists()
    out = run_shards(root, "--also", "no-equals-sign")
    assert out.returncode == 2 and "'no-equals-sign': expected NAME=COMMAND" in out.stderr

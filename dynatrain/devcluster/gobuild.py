"""Build binaries from a pinned wrapper Go module, once, into a content-keyed cache.

Nothing the project runs from Go (the control plane's etcd, kube-apiserver, kube-scheduler,
kube-controller-manager, kubectl, kubelet and kwok in ``tools/k8s``; ``helm`` in
``tools/helm``; Kueue's manager in ``tools/kueue``) is downloaded as a binary: each is compiled
from a wrapper Go module whose ``go.mod`` is the one place its versions are pinned (``tool``
directives name the main packages; the modules the three share are at one version in all of
them, :mod:`.gopins`). This module is the one builder for all of them:

- **pins**: the cache key hashes go.mod as Go parses it (so editing a comment does not rebuild),
  go.sum, the Go toolchain's version, the build flags and environment, so a changed pin or
  toolchain builds into a new directory and an unchanged one never rebuilds;
- **cache**: ``<cache_root>/<hash>/bin/<name>``; the binaries appear by one atomic rename of a
  complete staging directory, so a reader sees all of them or none;
- **lock**: a file lock per hash serialises concurrent builders (two test sessions, a CLI and a
  CI warm-up): the second waits, then reuses the first one's result;
- **toolchain**: the go.mod's ``go`` line is the minimum; go on PATH is used if it is new
  enough or (Go >= 1.21, ``GOTOOLCHAIN=auto``) fetches the required toolchain itself, else
  :mod:`.goinstall` downloads and verifies that toolchain into ``~/.cache/dynatrain/go``
  (:func:`go_command`); only when that download is impossible is there a
  :class:`GoUnavailable`, which says what to install;
- **progress and time limit**: one line every 15 s (packages compiled so far), and the build is
  killed past its timeout, with the log's path in the error.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import goinstall
from .errors import DevClusterError

_PROGRESS_EVERY_S = 15.0

TOOLS = Path(__file__).resolve().parents[2] / "tools"
"""The source checkout's wrapper Go modules (``tools/k8s``, ``tools/helm``, ``tools/kueue``)."""

GO_CACHE_ENV = "DYNATRAIN_GO_CACHE"
"""Overrides where Go toolchains are installed (``$XDG_CACHE_HOME/dynatrain/go``)."""


class GoBuildError(DevClusterError):
    """A Go build failed or could not start; the message names the command and its log."""


class GoUnavailable(GoBuildError):
    """There is no Go command to build with (the tests skip outside CI and fail inside it)."""


def cache_root(name: str, env_var: str) -> Path:
    """``$<env_var>``, else ``$XDG_CACHE_HOME/dynatrain/<name>`` (``~/.cache`` by default)."""
    override = os.environ.get(env_var)
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "dynatrain" / name


def go_command(go_mod: Path, *, log: Callable[[str], None] | None = None) -> str:
    """A Go that builds the module of ``go_mod``: go on PATH, else a toolchain installed for it.

    Raises :class:`GoUnavailable` if there is none and none can be downloaded, and
    :class:`GoBuildError` if a downloaded toolchain fails its checksum.
    """
    try:
        return goinstall.find_go(go_mod, cache_root("go", GO_CACHE_ENV), log=log)
    except goinstall.DownloadFailed as exc:
        raise GoUnavailable(f"no Go to build {go_mod.parent} with: {exc}") from exc
    except goinstall.GoInstallError as exc:
        raise GoBuildError(str(exc)) from exc


BUILD_GOGC = "200"
"""The Go garbage collector's target for the go command, its compilers and linker: fewer
collections for a peak of ~1.7 GB (a compile of a large package), on a machine that has it."""


@dataclass(frozen=True, kw_only=True)
class GoModule:
    """A wrapper Go module and what to build from it."""

    label: str
    """Short name for log lines and errors (``devcluster``, ``helm``)."""
    module_dir: Path
    """The wrapper module (holds go.mod and go.sum)."""
    cache_root: Path
    """Parent of the per-pin cache directories."""
    binaries: Mapping[str, str]
    """Installed name -> the Go main package (a ``tool`` of go.mod) it is built from."""
    output_names: Mapping[str, str] = field(default_factory=dict)
    """Installed name -> the name ``go build -o DIR/`` gives it, where that differs (it names a
    binary after the last path element that is not a major-version suffix, so etcd's
    ``go.etcd.io/etcd/server/v3`` comes out as ``server``)."""
    ldflags: str = "-s -w"
    """Stripped binaries keep the cache lean."""
    gcflags: str = "all=-dwarf=false -c=1"
    """The compiler's flags, for every package. The binaries are stripped (``-w``), so the
    debug information the compiler makes would be dropped at link time: ``-dwarf=false`` does
    not make it. ``-c=1``: one backend thread per compile, as ``go build`` already runs a
    compile per core. With ``GOGC=200`` for the build (:data:`BUILD_GOGC`), a cold build of
    ``tools/k8s`` took 501 core-seconds instead of 577 on 2 cores (one run each, idle machine).
    The control plane, helm and Kueue share it: it is part of each compiled package's cache
    key, so one setting lets the three builds compile their shared packages once."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra build environment (``CGO_ENABLED=0`` for a static binary); part of the hash."""
    timeout: datetime.timedelta = datetime.timedelta(minutes=90)
    """The build is killed past this (a cold control-plane build takes 4-12 min on 2 cores)."""
    go: str | None = None
    """The Go command; None (the default): :func:`go_command` for the module's go.mod."""

    def __post_init__(self) -> None:
        if not (self.module_dir / "go.mod").is_file():
            raise GoBuildError(f"no go.mod in module_dir={self.module_dir}: the {self.label} "
                               "pins live in tools/ of a DynaTrain source checkout")
        unknown = set(self.output_names) - set(self.binaries)
        if unknown:
            raise GoBuildError(f"output_names names binaries not built: {sorted(unknown)}")


@dataclass(frozen=True, kw_only=True)
class Built:
    """Where one pin's binaries are."""

    bin_dir: Path
    pins_hash: str
    names: tuple[str, ...]

    def path(self, name: str) -> Path:
        if name not in self.names:
            raise KeyError(f"unknown binary {name!r}; known: {sorted(self.names)}")
        return self.bin_dir / name


def _go(module: GoModule) -> tuple[str, dict[str, str]]:
    """The module's Go command and the environment to run it in."""
    go = module.go or go_command(module.module_dir / "go.mod")
    return go, {**os.environ, **goinstall.toolchain_env(go, cache_root("go", GO_CACHE_ENV))}


def run_go(module: GoModule, *args: str, timeout: float = 120) -> str:
    """``go ARGS`` in the module's directory; its stdout."""
    go, env = _go(module)
    try:
        out = subprocess.run([go, *args], cwd=module.module_dir, capture_output=True,
                             text=True, timeout=timeout, check=True, env=env)
    except FileNotFoundError as exc:
        raise GoUnavailable(
            f"Go command {go!r} not found: the {module.label} binaries are built from "
            f"their Go module ({module.module_dir}); install Go (Debian: apt-get install "
            "golang-go; any Go >= 1.21 fetches the toolchain go.mod requires), or leave "
            "GoModule.go unset to have that toolchain installed") from exc
    except subprocess.CalledProcessError as exc:
        raise GoBuildError(f"`{go} {' '.join(args)}` failed in {module.module_dir}: "
                           f"{exc.stderr.strip()}") from exc
    return out.stdout


def pins_hash(module: GoModule) -> str:
    """Hash of everything that decides the binaries' content."""
    h = hashlib.sha256()
    h.update(run_go(module, "mod", "edit", "-json").encode() + b"\0")
    h.update((module.module_dir / "go.sum").read_bytes() + b"\0")
    h.update(run_go(module, "env", "GOVERSION").strip().encode() + b"\0")
    h.update(f"{module.ldflags}|{module.gcflags}|{sorted(module.env.items())}|"
             f"{sorted(module.binaries.items())}".encode())
    return h.hexdigest()[:16]


def cached(module: GoModule, digest: str | None = None) -> Built | None:
    """The cached binaries of the current pins (or ``digest``), or None if not built yet."""
    digest = digest or pins_hash(module)
    bin_dir = module.cache_root / digest / "bin"
    if all((bin_dir / name).is_file() for name in module.binaries):
        return Built(bin_dir=bin_dir, pins_hash=digest, names=tuple(module.binaries))
    return None


def ensure_built(module: GoModule, *, log: Callable[[str], None] | None = None) -> Built:
    """The binaries of the current pins, built first if they are not cached."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if module.go is None:
        go_command(module.module_dir / "go.mod", log=log)   # an install says so through `log`
    # One hash for the whole call: a go.mod edited while a long build runs does not move it.
    digest = pins_hash(module)
    found = cached(module, digest)
    if found:
        return found
    target = module.cache_root / digest
    target.mkdir(parents=True, exist_ok=True)
    with open(target / "build.lock", "w") as lock:
        # Another process may be building the same pins: wait for it, then reuse its result.
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = cached(module, digest)
        if found:
            return found
        _build(module, target, log)
    found = cached(module, digest)
    if found is None:
        raise GoBuildError(f"the {module.label} build finished but binaries are missing in "
                           f"{target / 'bin'}")
    return found


def _build(module: GoModule, target: Path, log: Callable[[str], None]) -> None:
    log_path = target / "build.log"
    staging = Path(tempfile.mkdtemp(prefix="bin.", dir=target))
    # -v names each package as it is compiled: that is the progress signal. -trimpath keeps
    # the binaries independent of where the checkout and caches live. Flags go on the command
    # line, not through $GOFLAGS, so that a user's own GOFLAGS still apply.
    go, go_env = _go(module)
    cmd = [go, "build", "-v", "-trimpath", f"-gcflags={module.gcflags}",
           f"-ldflags={module.ldflags}", "-o", str(staging) + "/", "tool"]
    env = {"GOGC": BUILD_GOGC, **go_env, **module.env}      # a GOGC of the user's wins
    shown_env = " ".join(f"{k}={v}" for k, v in sorted(module.env.items()))
    log(f"[{module.label}] building {', '.join(module.binaries)} from {module.module_dir} "
        f"into {target / 'bin'}; log: {log_path}")
    started = time.monotonic()
    with open(log_path, "w") as out:
        out.write(f"$ (cd {module.module_dir} && {shown_env} {' '.join(cmd)})\n")
        out.flush()
        try:
            proc = subprocess.Popen(cmd, cwd=module.module_dir, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except FileNotFoundError as exc:
            raise GoUnavailable(f"Go command {go!r} not found") from exc
        compiled = 0
        last = ""

        def pump() -> None:
            nonlocal compiled, last
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                if not line.startswith("go: downloading"):
                    compiled += 1
                last = line.strip()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        deadline = started + module.timeout.total_seconds()
        while True:
            try:
                proc.wait(timeout=_PROGRESS_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    os.killpg(proc.pid, 9)
                    proc.wait(timeout=60)
                    raise GoBuildError(f"the {module.label} build exceeded {module.timeout}; "
                                       f"log: {log_path}") from None
                log(f"[{module.label}] build {(time.monotonic() - started) / 60:4.1f} min: "
                    f"{compiled} packages compiled, last: {last}")
        reader.join(timeout=60)
    if proc.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
        raise GoBuildError(f"the {module.label} build failed with exit code {proc.returncode}; "
                           f"log: {log_path}\n{tail}")
    for name, package in module.binaries.items():
        built = staging / module.output_names.get(name, package.rsplit("/", 1)[-1])
        if not built.is_file():
            raise GoBuildError(f"go build produced no {built} for {package}; log: {log_path}")
        built.rename(staging / name)
    bin_dir = target / "bin"
    if bin_dir.exists():
        # A partial directory from an interrupted run of an older builder; the lock kept it
        # from being used, and the complete staging directory replaces it.
        shutil.rmtree(bin_dir)
    staging.rename(bin_dir)
    log(f"[{module.label}] built in {(time.monotonic() - started) / 60:.1f} min -> {bin_dir}")

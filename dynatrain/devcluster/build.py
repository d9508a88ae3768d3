"""Build and cache the control-plane binaries from Go modules.

The binaries (etcd, kube-apiserver, kube-scheduler, kubectl, kwok) are not
downloaded: they are compiled from the wrapper Go module in ``tools/k8s``,
whose ``go.mod`` is the one place the versions are pinned. The result is kept
under ``~/.cache/dynatrain/k8s/<pins hash>/bin/``; the hash covers go.mod (as
Go parses it, so comments do not count), go.sum, the Go toolchain version
and the build flags, so changing a pin (or Go) builds into a new directory
and an unchanged pin never rebuilds. A file lock serialises concurrent
builders (two test sessions, a CLI and CI warm-up) so the second one waits
and then reuses the first one's result.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import DevClusterError

# The Go package of each binary (as listed in go.mod's `tool` block) and the
# name it is installed under. `go build -o DIR` names a binary after the last
# path element that is not a major-version suffix, so etcd's main package
# (go.etcd.io/etcd/server/v3) comes out as "server" and is renamed.
BINARIES: dict[str, str] = {
    "etcd": "go.etcd.io/etcd/server/v3",
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kubectl": "k8s.io/kubernetes/cmd/kubectl",
    "kwok": "sigs.k8s.io/kwok/cmd/kwok",
}
_GO_OUTPUT_NAME = {"etcd": "server"}

# -trimpath and stripped symbols keep the cache lean and the build independent
# of where the checkout and caches live. (Flags are passed on the command line,
# not through $GOFLAGS, so that a user's own GOFLAGS still apply.)
_GOFLAGS = "-trimpath"
_LDFLAGS = "-s -w"

# A cold build (empty module and build caches) took 12 minutes on 2 cores;
# allow plenty more for slower machines before declaring it hung.
BUILD_TIMEOUT = datetime.timedelta(
    seconds=float(os.environ.get("DYNATRAIN_K8S_BUILD_TIMEOUT_S", 5400)))

_PROGRESS_EVERY_S = 15.0


@dataclass(frozen=True, kw_only=True)
class Toolchain:
    """Where the pins live and where built binaries are cached."""

    module_dir: Path
    """The wrapper Go module (``tools/k8s``)."""
    cache_root: Path
    """Parent of the per-pin cache directories."""
    go: str = "go"
    """The Go command."""

    def __post_init__(self) -> None:
        if not (self.module_dir / "go.mod").is_file():
            raise DevClusterError(
                f"no go.mod in module_dir={self.module_dir}: the control-plane pins live in "
                "tools/k8s of a DynaTrain source checkout")


@dataclass(frozen=True, kw_only=True)
class Binaries:
    """Absolute paths of the built binaries."""

    bin_dir: Path
    pins_hash: str

    def path(self, name: str) -> Path:
        if name not in BINARIES:
            raise KeyError(f"unknown binary {name!r}; known: {sorted(BINARIES)}")
        return self.bin_dir / name


def default_toolchain() -> Toolchain:
    """The toolchain of this source checkout, cache under ``$XDG_CACHE_HOME``.

    ``DYNATRAIN_K8S_CACHE`` overrides the cache root (CI keeps it on a cached volume).
    """
    repo = Path(__file__).resolve().parents[2]
    cache = os.environ.get("DYNATRAIN_K8S_CACHE")
    if cache:
        cache_root = Path(cache)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        cache_root = Path(xdg) / "dynatrain" / "k8s"
    return Toolchain(module_dir=repo / "tools" / "k8s", cache_root=cache_root)


def _go_version(go: str) -> str:
    try:
        out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True,
                             timeout=60, check=True)
    except FileNotFoundError as exc:
        raise DevClusterError(f"Go command {go!r} not found; install Go >= 1.26") from exc
    except subprocess.CalledProcessError as exc:
        raise DevClusterError(f"`{go} env GOVERSION` failed: {exc.stderr.strip()}") from exc
    return out.stdout.strip()


def pins_hash(toolchain: Toolchain) -> str:
    """Hash of everything that decides the binaries' content."""
    h = hashlib.sha256()
    # go.mod as Go parses it, so that editing a comment does not rebuild.
    try:
        parsed = subprocess.run([toolchain.go, "mod", "edit", "-json"], cwd=toolchain.module_dir,
                                capture_output=True, text=True, timeout=60, check=True)
    except subprocess.CalledProcessError as exc:
        raise DevClusterError(f"`go mod edit -json` failed in {toolchain.module_dir}: "
                              f"{exc.stderr.strip()}") from exc
    h.update(parsed.stdout.encode() + b"\0")
    h.update((toolchain.module_dir / "go.sum").read_bytes() + b"\0")
    h.update(_go_version(toolchain.go).encode())
    h.update(f"{_GOFLAGS}|{_LDFLAGS}|{sorted(BINARIES.items())}".encode())
    return h.hexdigest()[:16]


def pinned_versions(toolchain: Toolchain) -> dict[str, str]:
    """Module versions of the pins, read from go.mod, for display."""
    text = (toolchain.module_dir / "go.mod").read_text()
    wanted = ("k8s.io/kubernetes", "sigs.k8s.io/kwok", "go.etcd.io/etcd/server/v3")
    found = {}
    for module in wanted:
        m = re.search(rf"^\s*{re.escape(module)}\s+(v\S+)", text, re.MULTILINE)
        found[module] = m.group(1) if m else "?"
    return found


def cached(toolchain: Toolchain, digest: str | None = None) -> Binaries | None:
    """The cached binaries for the current pins (or ``digest``), or None if not built yet."""
    digest = digest or pins_hash(toolchain)
    bin_dir = toolchain.cache_root / digest / "bin"
    if all((bin_dir / name).is_file() for name in BINARIES):
        return Binaries(bin_dir=bin_dir, pins_hash=digest)
    return None


def ensure_built(
    toolchain: Toolchain | None = None, *, log: Callable[[str], None] | None = None,
) -> Binaries:
    """Return the binaries for the current pins, building them first if needed."""
    toolchain = toolchain or default_toolchain()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    # One hash for the whole call: the pins are read once, even if go.mod is
    # edited while a long build runs.
    digest = pins_hash(toolchain)
    found = cached(toolchain, digest)
    if found:
        return found

    target = toolchain.cache_root / digest
    target.mkdir(parents=True, exist_ok=True)
    with open(target / "build.lock", "w") as lock:
        # Another process may be building the same pins: wait for it, then reuse.
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = cached(toolchain, digest)
        if found:
            return found
        _build(toolchain, target, log)
    found = cached(toolchain, digest)
    if found is None:
        raise DevClusterError(f"build finished but binaries are missing in {target / 'bin'}")
    return found


def _build(toolchain: Toolchain, target: Path, log: Callable[[str], None]) -> None:
    versions = ", ".join(f"{m} {v}" for m, v in pinned_versions(toolchain).items())
    log(f"[devcluster] building {', '.join(BINARIES)} from Go modules ({versions})")
    log(f"[devcluster] into {target / 'bin'}; a cold build (empty Go caches) takes ~12 min "
        "on 2 cores, later pins reuse the Go build cache")
    log_path = target / "build.log"
    staging = Path(tempfile.mkdtemp(prefix="bin.", dir=target))
    # -v names each package as it is compiled: that is the progress signal.
    cmd = [toolchain.go, "build", "-v", _GOFLAGS, f"-ldflags={_LDFLAGS}",
           "-o", str(staging) + "/", "tool"]
    started = time.monotonic()
    with open(log_path, "w") as out:
        out.write(f"$ (cd {toolchain.module_dir} && {' '.join(cmd)})\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=toolchain.module_dir, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines = 0
        last = ""

        def pump() -> None:
            nonlocal lines, last
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                if not line.startswith("go: downloading"):
                    lines += 1
                last = line.strip()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        deadline = started + BUILD_TIMEOUT.total_seconds()
        while True:
            try:
                proc.wait(timeout=_PROGRESS_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - started
                if time.monotonic() > deadline:
                    os.killpg(proc.pid, 9)
                    proc.wait(timeout=60)
                    raise DevClusterError(
                        f"go build exceeded {BUILD_TIMEOUT} (DYNATRAIN_K8S_BUILD_TIMEOUT_S); "
                        f"log: {log_path}") from None
                log(f"[devcluster] build {elapsed / 60:4.1f} min: {lines} packages compiled, "
                    f"last: {last}")
        reader.join(timeout=60)
    if proc.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
        raise DevClusterError(
            f"go build failed with exit code {proc.returncode}; log: {log_path}\n{tail}")
    for name, package in BINARIES.items():
        built = staging / _GO_OUTPUT_NAME.get(name, package.rsplit("/", 1)[-1])
        if not built.is_file():
            raise DevClusterError(f"go build produced no {built} for {package}; log: {log_path}")
        built.rename(staging / name)
    bin_dir = target / "bin"
    if bin_dir.exists():
        # A partial directory from an interrupted run that the lock kept from being
        # used; the complete staging dir replaces it.
        shutil.rmtree(bin_dir)
    staging.rename(bin_dir)
    log(f"[devcluster] built in {(time.monotonic() - started) / 60:.1f} min -> {bin_dir}")

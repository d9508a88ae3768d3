"""Helm for the DynaTrain chart: built from its Go module, plus the chart's two checked facts.

The ``helm`` binary is not downloaded: like the dev cluster's control plane
(:mod:`dynatrain.devcluster.build`) it is compiled from a wrapper Go module,
``tools/helm``, whose ``go.mod`` is the one place its version is pinned. It is a module of its
own, separate from ``tools/k8s``, because Helm and kube-apiserver each require their own
``k8s.io/*`` versions and one module would force them onto a single set. The build is cached
under ``~/.cache/dynatrain/helm/<hash>/helm``; the hash covers go.mod (as Go parses it, so a
comment edit does not rebuild), go.sum, the Go version and the build flags. Nothing relies on
the cache existing: :func:`ensure_helm` builds when it is missing, under a file lock so that
two concurrent callers build once.

The chart (``charts/dynatrain``) carries a copy of the CRD, because Helm installs only what
lies in a chart's own ``crds/`` directory. ``crds/dynatrainjob.yaml`` at the top of the
repository stays the one source: :func:`sync_crd` re-copies it and :func:`crd_in_sync` is
what the tests check. :func:`dashboard_queries` lists the Grafana dashboard's PromQL with the
Grafana variables substituted, so that tests can hand every panel's query to a real
Prometheus.

Command line::

    python -m dynatrain.helm --build       # build (if needed) and print the helm path
    python -m dynatrain.helm --sync-crd    # copy crds/dynatrainjob.yaml into the chart
    python -m dynatrain.helm --check-crd   # exit 1 if the chart's copy differs
    python -m dynatrain.helm --queries     # print the dashboard's queries
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHART_DIR = REPO / "charts" / "dynatrain"
CRD_SOURCE = REPO / "crds" / "dynatrainjob.yaml"
CHART_CRD = CHART_DIR / "crds" / "dynatrainjob.yaml"
CRD_SOURCES = (CRD_SOURCE, REPO / "crds" / "kopf-peering.yaml")
"""Every CRD file the chart carries a copy of (the operator's peering CRDs too)."""
DASHBOARD = CHART_DIR / "dashboards" / "dynatrain.json"

HELM_MODULE = "helm.sh/helm/v4"
"""The Go module that provides the binary (its ``cmd/helm`` is the ``tool`` in go.mod)."""

# Static, stripped, and independent of where the checkout lives: the same flags Helm's own
# release Makefile uses. The version is stamped in with -X (Helm's source only knows "v4.3"),
# so `helm version` names the exact pin.
_GOFLAGS = "-trimpath"
_LDFLAGS = "-s -w"
_VERSION_VAR = f"{HELM_MODULE}/internal/version.version"

BUILD_TIMEOUT = datetime.timedelta(
    seconds=float(os.environ.get("DYNATRAIN_HELM_BUILD_TIMEOUT_S", "1800")))
_PROGRESS_EVERY_S = 15.0


class HelmError(RuntimeError):
    """Helm could not be built or run; the message names the command and its log."""


class HelmUnavailable(HelmError):
    """There is no Go toolchain to build Helm with (tests skip, or fail under CI)."""


@dataclass(frozen=True, kw_only=True)
class HelmToolchain:
    """Where Helm's pin lives and where the built binary is cached."""

    module_dir: Path
    """The wrapper Go module (``tools/helm``)."""
    cache_root: Path
    """Parent of the per-pin cache directories."""
    go: str = "go"

    def __post_init__(self) -> None:
        if not (self.module_dir / "go.mod").is_file():
            raise HelmError(f"no go.mod in module_dir={self.module_dir}: Helm's pin lives in "
                            "tools/helm of a DynaTrain source checkout")


def default_toolchain() -> HelmToolchain:
    """This checkout's ``tools/helm``; cache under ``$XDG_CACHE_HOME/dynatrain/helm``.

    ``DYNATRAIN_HELM_CACHE`` overrides the cache root (CI keeps it on a cached volume).
    """
    cache = os.environ.get("DYNATRAIN_HELM_CACHE")
    if cache:
        root = Path(cache)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(xdg) / "dynatrain" / "helm"
    return HelmToolchain(module_dir=REPO / "tools" / "helm", cache_root=root)


def _go(toolchain: HelmToolchain, *args: str) -> str:
    try:
        out = subprocess.run([toolchain.go, *args], cwd=toolchain.module_dir,
                             capture_output=True, text=True, timeout=120, check=True)
    except FileNotFoundError as exc:
        raise HelmUnavailable(f"Go command {toolchain.go!r} not found; Helm is built from "
                              "its Go module and needs Go >= 1.26") from exc
    except subprocess.CalledProcessError as exc:
        raise HelmError(f"`{toolchain.go} {' '.join(args)}` failed in {toolchain.module_dir}: "
                        f"{exc.stderr.strip()}") from exc
    return out.stdout


def pinned_version(toolchain: HelmToolchain | None = None) -> str:
    """The Helm version required in tools/helm/go.mod, e.g. ``v4.3.1``."""
    toolchain = toolchain or default_toolchain()
    text = (toolchain.module_dir / "go.mod").read_text()
    m = re.search(rf"^\s*{re.escape(HELM_MODULE)}\s+(v\S+)", text, re.MULTILINE)
    if not m:
        raise HelmError(f"{toolchain.module_dir / 'go.mod'} requires no {HELM_MODULE}")
    return m.group(1)


def pins_hash(toolchain: HelmToolchain) -> str:
    """Hash of everything that decides the binary's content."""
    h = hashlib.sha256()
    h.update(_go(toolchain, "mod", "edit", "-json").encode() + b"\0")
    h.update((toolchain.module_dir / "go.sum").read_bytes() + b"\0")
    h.update(_go(toolchain, "env", "GOVERSION").strip().encode() + b"\0")
    h.update(f"{_GOFLAGS}|{_LDFLAGS}|{_VERSION_VAR}|CGO_ENABLED=0".encode())
    return h.hexdigest()[:16]


def cached(toolchain: HelmToolchain | None = None, digest: str | None = None) -> Path | None:
    """The cached binary for the current pin, or None if it has not been built."""
    toolchain = toolchain or default_toolchain()
    path = toolchain.cache_root / (digest or pins_hash(toolchain)) / "helm"
    return path if path.is_file() else None


def ensure_helm(toolchain: HelmToolchain | None = None, *,
                log: Callable[[str], None] | None = None) -> Path:
    """Path of the ``helm`` binary for the current pin, built first if it is not cached.

    Raises :class:`HelmUnavailable` without Go, :class:`HelmError` if the build fails.
    """
    toolchain = toolchain or default_toolchain()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    digest = pins_hash(toolchain)  # once: a go.mod edited mid-build does not change the target
    found = cached(toolchain, digest)
    if found:
        return found
    target = toolchain.cache_root / digest
    target.mkdir(parents=True, exist_ok=True)
    with open(target / "build.lock", "w") as lock:
        # Another process may be building this pin: wait for it, then reuse its result.
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = cached(toolchain, digest)
        if found:
            return found
        _build(toolchain, target, log)
    found = cached(toolchain, digest)
    if found is None:
        raise HelmError(f"the build finished but {target / 'helm'} is missing")
    return found


def _build(toolchain: HelmToolchain, target: Path, log: Callable[[str], None]) -> None:
    version = pinned_version(toolchain)
    log(f"[helm] building {HELM_MODULE} {version} from its Go module into {target}")
    log_path = target / "build.log"
    staging = Path(tempfile.mkdtemp(prefix="bin.", dir=target))
    cmd = [toolchain.go, "build", "-v", _GOFLAGS,
           f"-ldflags={_LDFLAGS} -X {_VERSION_VAR}={version}", "-o", str(staging) + "/", "tool"]
    # CGO off: a static binary, and no C compiler needed on the build machine.
    env = {**os.environ, "CGO_ENABLED": "0"}
    started = time.monotonic()
    with open(log_path, "w") as out:
        out.write(f"$ (cd {toolchain.module_dir} && CGO_ENABLED=0 {' '.join(cmd)})\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=toolchain.module_dir, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        compiled = 0

        def pump() -> None:
            # -v names each package as it is compiled: the progress signal for the log line.
            nonlocal compiled
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                if not line.startswith("go: downloading"):
                    compiled += 1

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        while True:
            try:
                proc.wait(timeout=_PROGRESS_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - started
                if elapsed > BUILD_TIMEOUT.total_seconds():
                    os.killpg(proc.pid, 9)
                    proc.wait(timeout=60)
                    raise HelmError(f"go build of helm exceeded {BUILD_TIMEOUT} "
                                    f"(DYNATRAIN_HELM_BUILD_TIMEOUT_S); log: {log_path}") from None
                log(f"[helm] build {elapsed / 60:4.1f} min: {compiled} packages compiled")
        reader.join(timeout=60)
    if proc.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
        raise HelmError(f"go build of helm failed (exit {proc.returncode}); log: {log_path}\n"
                        f"{tail}")
    built = staging / "helm"
    if not built.is_file():
        raise HelmError(f"go build produced no {built}; log: {log_path}")
    # rename() is atomic: a concurrent cached() sees either no binary or a complete one.
    built.rename(target / "helm")
    shutil.rmtree(staging, ignore_errors=True)
    log(f"[helm] built in {time.monotonic() - started:.0f} s -> {target / 'helm'}")


# -- the chart's CRD copy -------------------------------------------------------------------

def _chart_copy(source: Path) -> Path:
    return CHART_DIR / "crds" / source.name


def crd_in_sync() -> bool:
    """Whether the chart's CRDs are byte-identical to their sources in ``crds/``."""
    return all(_chart_copy(src).is_file() and _chart_copy(src).read_bytes() == src.read_bytes()
               for src in CRD_SOURCES)


def sync_crd() -> bool:
    """Copy the CRDs of ``crds/`` into the chart; returns whether anything changed."""
    if crd_in_sync():
        return False
    CHART_CRD.parent.mkdir(parents=True, exist_ok=True)
    for src in CRD_SOURCES:
        shutil.copyfile(src, _chart_copy(src))
    return True


# -- the Grafana dashboard's queries --------------------------------------------------------

# What the dashboard's template variables become outside Grafana. ".*" selects every job and
# namespace (and, being able to match the empty string, also series without a namespace label,
# as in a local `dynatrain run`); gpus_per_worker is the text box the GPU curve multiplies by.
DEFAULT_VARIABLES = {"namespace": ".*", "dynatrain_job": ".*", "gpus_per_worker": "1"}


def dashboard_queries(rate_interval: str = "1m", *,
                      variables: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` for every query of every panel of the Grafana dashboard.

    Grafana's ``$__rate_interval`` becomes ``rate_interval`` and the dashboard's variables
    their values in ``variables`` (default :data:`DEFAULT_VARIABLES`), so the result can be
    run by Prometheus as is. A panel with several queries (e.g. p50, p95, p99) appears once
    per query, under the same title, in the dashboard's order.
    """
    values = {**DEFAULT_VARIABLES, **(variables or {}), "__rate_interval": rate_interval}
    dashboard = json.loads(DASHBOARD.read_text())

    def substitute(expr: str) -> str:
        def repl(m: re.Match) -> str:
            name = m.group(1) or m.group(2)
            if name not in values:
                raise KeyError(f"dashboard query uses ${name}, which has no value; "
                               f"known: {sorted(values)}")
            return values[name]
        # Both Grafana spellings: $name and ${name}.
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)

    queries = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            if target.get("expr"):
                queries.append((panel["title"], substitute(target["expr"])))
    return queries


def _panels(panels: list[dict]):
    # Rows may nest their panels (a collapsed row keeps them under "panels").
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynatrain.helm", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--build", action="store_true", help="build helm if needed; print its path")
    group.add_argument("--sync-crd", action="store_true",
                       help="copy crds/dynatrainjob.yaml into charts/dynatrain/crds/")
    group.add_argument("--check-crd", action="store_true",
                       help="exit 1 if the chart's CRD differs from crds/dynatrainjob.yaml")
    group.add_argument("--queries", action="store_true",
                       help="print the dashboard's PromQL, one 'title<TAB>query' per line")
    args = parser.parse_args(argv)
    if args.build:
        try:
            print(ensure_helm())
        except HelmError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    elif args.sync_crd:
        changed = sync_crd()
        print(f"{CHART_CRD.relative_to(REPO)}: {'updated' if changed else 'already in sync'}")
    elif args.check_crd:
        if not crd_in_sync():
            print(f"{CHART_CRD.relative_to(REPO)} differs from {CRD_SOURCE.relative_to(REPO)}; "
                  "run `python -m dynatrain.helm --sync-crd`", file=sys.stderr)
            return 1
        print("in sync")
    else:
        for title, expr in dashboard_queries():
            print(f"{title}\t{expr}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

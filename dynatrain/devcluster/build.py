"""The control plane's binaries, built from the pinned Go module ``tools/k8s``.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok and kubelet (for
the dev cluster's one real node, :mod:`.kubelet`) are compiled from the wrapper module in
``tools/k8s``, whose ``go.mod`` is the one place their versions are pinned, by the project's one
Go builder (:mod:`.gobuild`: content-keyed cache, lock, toolchain, progress). The result is
kept under ``~/.cache/dynatrain/k8s/<pins hash>/bin/`` (``DYNATRAIN_K8S_CACHE`` overrides the
root); a cold build takes 4-12 minutes on 2 cores, a later one finds it there.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Callable
from pathlib import Path

from .gobuild import TOOLS, Built, GoBuildError, GoModule, cache_root
from .gobuild import ensure_built as _ensure_built

# The Go package of each binary (as listed in go.mod's `tool` block) and the name it is
# installed under.
BINARIES: dict[str, str] = {
    "etcd": "go.etcd.io/etcd/server/v3",
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kubectl": "k8s.io/kubernetes/cmd/kubectl",
    "kwok": "sigs.k8s.io/kwok/cmd/kwok",
    "kubelet": "k8s.io/kubernetes/cmd/kubelet",
}


def version_ldflags(module_dir: Path) -> str:
    """The Kubernetes version stamped into the binaries, as its release build does (-X of
    component-base's version variables): without it the apiserver says it is
    ``v0.0.0-master+$Format:%H$``, which clients that parse the server's version refuse
    (Kueue's manager exits on it)."""
    text = (module_dir / "go.mod").read_text()
    m = re.search(r"^\s*k8s\.io/kubernetes\s+v(\d+)\.(\d+)\.(\d+)", text, re.MULTILINE)
    if not m:
        raise GoBuildError(f"{module_dir / 'go.mod'} requires no k8s.io/kubernetes vX.Y.Z")
    major, minor, patch = m.groups()
    var = "k8s.io/component-base/version"
    return (f"-s -w -X {var}.gitVersion=v{major}.{minor}.{patch} -X {var}.gitMajor={major} "
            f"-X {var}.gitMinor={minor} -X {var}.gitTreeState=clean")


def default_toolchain() -> GoModule:
    """This checkout's ``tools/k8s``, cached under ``$XDG_CACHE_HOME/dynatrain/k8s``."""
    return GoModule(
        label="devcluster",
        module_dir=TOOLS / "k8s",
        cache_root=cache_root("k8s", "DYNATRAIN_K8S_CACHE"),
        binaries=BINARIES,
        ldflags=version_ldflags(TOOLS / "k8s"),
        output_names={"etcd": "server"},
        # Static binaries (no C compiler needed), and the setting helm's and Kueue's builds use:
        # CGO_ENABLED is part of every package's build-cache key, so with it the three builds
        # compile their shared packages once (gopins.py).
        env={"CGO_ENABLED": "0"},
        # A cold build (empty module and build caches) took 12 minutes on 2 cores; allow
        # plenty more for slower machines before declaring it hung.
        timeout=datetime.timedelta(
            seconds=float(os.environ.get("DYNATRAIN_K8S_BUILD_TIMEOUT_S", 5400))),
    )


def pinned_versions(toolchain: GoModule | None = None) -> dict[str, str]:
    """Module versions of the pins, read from go.mod, for display."""
    toolchain = toolchain or default_toolchain()
    text = (toolchain.module_dir / "go.mod").read_text()
    wanted = ("k8s.io/kubernetes", "sigs.k8s.io/kwok", "go.etcd.io/etcd/server/v3")
    found = {}
    for module in wanted:
        m = re.search(rf"^\s*{re.escape(module)}\s+(v\S+)", text, re.MULTILINE)
        found[module] = m.group(1) if m else "?"
    return found


def ensure_built(toolchain: GoModule | None = None, *,
                 log: Callable[[str], None] | None = None) -> Built:
    """The control plane's binaries for the current pins, built first if needed."""
    return _ensure_built(toolchain or default_toolchain(), log=log)


def main(argv: list[str] | None = None) -> int:
    """``python -m dynatrain.devcluster.build [--helm]``: build the control plane (and helm)
    if needed and print where they are.

    This module, :mod:`.gobuild` and :mod:`.helm` need only Python's standard library, so
    ``make test`` runs this with the system's Python (``make go-tools-early``) while the
    project's venv is still being made: on a cold machine the venv's setup mostly downloads and unpacks
    and leaves a core for the compiler (tools/pytest-shards, ``--early``)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m dynatrain.devcluster.build", description=main.__doc__.split("\n\n")[0])
    parser.add_argument("--helm", action="store_true", help="build helm (tools/helm) as well")
    args = parser.parse_args(argv)
    try:
        print(f"control plane: {ensure_built().bin_dir}", flush=True)
        if args.helm:
            from .helm import ensure_helm

            print(f"helm: {ensure_helm()}", flush=True)
    except GoBuildError as exc:
        print(f"python -m dynatrain.devcluster.build: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

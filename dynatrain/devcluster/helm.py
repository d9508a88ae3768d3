"""``helm``, built from the pinned Go module ``tools/helm`` for the chart's tests.

Like the control plane (:mod:`.build`), the ``helm`` binary is not downloaded but compiled by
the project's one Go builder (:mod:`.gobuild`) from a wrapper module, ``tools/helm``, whose
``go.mod`` pins its version. It is a module of its own, beside ``tools/k8s``, but every module
the two share is at one version in both (:mod:`.gopins`), so a cold build compiles only Helm's
own packages (about 50; 916 before the versions were aligned). The build is cached under
``~/.cache/dynatrain/helm/<hash>/bin/helm`` (``DYNATRAIN_HELM_CACHE`` overrides the root).
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Callable
from pathlib import Path

from .gobuild import TOOLS, GoBuildError, GoModule, cache_root, ensure_built

HELM_MODULE = "helm.sh/helm/v4"
"""The Go module that provides the binary (its ``cmd/helm`` is the ``tool`` in go.mod)."""

# Helm's source only knows "v4.3"; the exact pin is stamped in with -X (as Helm's own release
# Makefile does), so `helm version` names it.
_VERSION_VAR = f"{HELM_MODULE}/internal/version.version"


def pinned_version(module_dir: Path | None = None) -> str:
    """The Helm version required in tools/helm/go.mod, e.g. ``v4.3.1``."""
    go_mod = (module_dir or TOOLS / "helm") / "go.mod"
    m = re.search(rf"^\s*{re.escape(HELM_MODULE)}\s+(v\S+)", go_mod.read_text(), re.MULTILINE)
    if not m:
        raise GoBuildError(f"{go_mod} requires no {HELM_MODULE}")
    return m.group(1)


def default_toolchain() -> GoModule:
    """This checkout's ``tools/helm``, cached under ``$XDG_CACHE_HOME/dynatrain/helm``."""
    module_dir = TOOLS / "helm"
    return GoModule(
        label="helm",
        module_dir=module_dir,
        cache_root=cache_root("helm", "DYNATRAIN_HELM_CACHE"),
        binaries={"helm": f"{HELM_MODULE}/cmd/helm"},
        ldflags=f"-s -w -X {_VERSION_VAR}={pinned_version(module_dir)}",
        # A static binary, and no C compiler needed on the build machine.
        env={"CGO_ENABLED": "0"},
        timeout=datetime.timedelta(
            seconds=float(os.environ.get("DYNATRAIN_HELM_BUILD_TIMEOUT_S", 1800))),
    )


def ensure_helm(toolchain: GoModule | None = None, *,
                log: Callable[[str], None] | None = None) -> Path:
    """Path of the ``helm`` binary for the current pin, built first if it is not cached.

    Raises :class:`~.gobuild.GoUnavailable` if there is no Go and none can be downloaded
    (:func:`~.gobuild.go_command`), :class:`~.gobuild.GoBuildError` if the build fails.
    """
    return ensure_built(toolchain or default_toolchain(), log=log).path("helm")

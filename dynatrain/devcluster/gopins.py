"""One version of every Go module the wrapper modules share, so each shared package compiles once.

The control plane (``tools/k8s``), ``helm`` (``tools/helm``) and Kueue (``tools/kueue``) are
three wrapper modules, built one after the other by :mod:`.gobuild` into one Go build cache.
Their builds share most of their packages (client-go, apimachinery, grpc, protobuf, x/net, ...),
but Go's build cache reuses a compiled package only when everything that went into it is the
same: the module's version (and its replacement), every dependency's, and the build settings
(``CGO_ENABLED`` among them, which is why all three build with ``CGO_ENABLED=0``). Left to
themselves the three select different versions, and a cold build compiled those packages three
times (2,895 + 916 + 1,276 packages); aligned, helm compiles only its own.

- :func:`misaligned` is the check (tests/test_go_pins.py): every module two wrapper modules
  both require has the same version and the same ``replace`` in both; it reads the go.mod
  files through ``go mod edit -json`` (no network).
- :func:`align` (``python -m dynatrain.devcluster.gopins``, after moving a pin) makes it so:
  Go's own minimal version selection over all three at once (a temporary ``go.work``) picks
  one version of each module, and each go.mod is given that version (``require``, plus the
  same ``replace`` where one module replaces it), then tidied.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from . import goinstall
from .gobuild import GO_CACHE_ENV, TOOLS, GoBuildError, cache_root, go_command

WRAPPERS = ("k8s", "helm", "kueue")
"""The wrapper modules under tools/ whose shared modules are kept at one version."""

Pin = tuple[str, "tuple[str, str] | None"]
"""A module's required version and its ``replace`` target (path, version), if any."""


def _go(args: list[str], cwd: Path, *, workspace: Path | None = None) -> str:
    """``go ARGS`` in ``cwd``, with the Go the builds use (:func:`.gobuild.go_command`)."""
    go = go_command(cwd / "go.mod")
    env = {**os.environ, **goinstall.toolchain_env(go, cache_root("go", GO_CACHE_ENV)),
           "GOWORK": str(workspace) if workspace else "off"}
    try:
        out = subprocess.run([go, *args], cwd=cwd, capture_output=True, text=True,
                             check=True, env=env, timeout=600)
    except subprocess.CalledProcessError as exc:
        raise GoBuildError(f"`go {' '.join(args)}` failed in {cwd}: {exc.stderr.strip()}") \
            from exc
    return out.stdout


def pins(module_dir: Path) -> dict[str, Pin]:
    """Each module ``module_dir/go.mod`` requires: its version and its replacement."""
    mod = json.loads(_go(["mod", "edit", "-json"], module_dir))
    replaced = {r["Old"]["Path"]: (r["New"]["Path"], r["New"].get("Version", ""))
                for r in mod.get("Replace") or ()}
    return {r["Path"]: (r["Version"], replaced.get(r["Path"]))
            for r in mod.get("Require") or ()}


def misaligned(modules: Mapping[str, Path] | None = None) -> list[str]:
    """One line per module that two wrapper modules require differently (none when aligned)."""
    modules = modules or {name: TOOLS / name for name in WRAPPERS}
    read = {name: pins(path) for name, path in modules.items()}
    found = []
    for a, b in itertools.combinations(read, 2):
        for path in sorted(set(read[a]) & set(read[b])):
            if read[a][path] != read[b][path]:
                found.append(f"{path}: {_show(read[a][path])} in tools/{a}, "
                             f"{_show(read[b][path])} in tools/{b}")
    return found


def _show(pin: Pin) -> str:
    version, replacement = pin
    return f"{version} => {replacement[0]} {replacement[1]}" if replacement else version


def _selection(cwd: Path, workspace: Path | None = None) -> dict[str, Pin]:
    """``go list -m all``: the version Go selects for every module of the build graph."""
    out = _go(["list", "-m", "-json", "all"], cwd, workspace=workspace)
    dec, i, found = json.JSONDecoder(), 0, {}
    while True:
        while i < len(out) and out[i].isspace():
            i += 1
        if i >= len(out):
            return found
        m, i = dec.raw_decode(out, i)
        if not m.get("Main"):
            r = m.get("Replace")
            found[m["Path"]] = (m.get("Version", ""), (r["Path"], r.get("Version", "")) if r
                                else None)


def align(modules: Mapping[str, Path] | None = None, *, rounds: int = 5) -> list[str]:
    """Give every wrapper module the one selection Go makes over all of them; what is left."""
    modules = modules or {name: TOOLS / name for name in WRAPPERS}
    with tempfile.TemporaryDirectory(prefix="gopins.") as tmp:
        work = Path(tmp) / "go.work"
        uses = "\n".join(f"\t{p.resolve()}" for p in modules.values())
        work.write_text(f"go 1.26.0\n\nuse (\n{uses}\n)\n")
        one = _selection(next(iter(modules.values())), workspace=work)
    for _ in range(rounds):
        changed = False
        for name, path in modules.items():
            required = pins(path)
            edits = []
            for module, (version, replacement) in one.items():
                if module not in required or required[module] == (version, replacement):
                    continue
                if version and version != "v0.0.0":
                    edits.append(f"-require={module}@{version}")
                if replacement:
                    edits.append(f"-replace={module}={replacement[0]}@{replacement[1]}")
                elif required[module][1]:
                    edits.append(f"-dropreplace={module}")
            if edits:
                print(f"tools/{name}: {len(edits)} edits", file=sys.stderr)
                _go(["mod", "edit", *edits], path)
                _go(["mod", "tidy"], path)
                changed = True
        if not changed:
            break
    return misaligned(modules)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynatrain.devcluster.gopins",
        description="Keep every Go module that tools/k8s, tools/helm and tools/kueue share at "
                    "one version (and one replacement), so the Go build cache compiles each "
                    "shared package once. Without --check: align them (needs the Go module "
                    "proxy), then check.")
    parser.add_argument("--check", action="store_true",
                        help="only check (reads the go.mod files; no network); exit 1 if any "
                             "shared module differs")
    args = parser.parse_args(argv)
    left = misaligned() if args.check else align()
    for line in left:
        print(f"misaligned: {line}")
    print(f"{len(left)} shared modules differ" if left else
          f"aligned: every module shared by tools/{{{','.join(WRAPPERS)}}} has one version")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())

"""The one Go builder (dynatrain.devcluster.gobuild) on a tiny wrapper module of its own.

The control plane and helm are built by the same code; building them here would take minutes,
so these tests give the builder a two-file module whose ``tool`` is a main package of its own,
and check what the big builds rely on: the cache key ignores comments but not pins, flags or
environment; a cached build is never redone; two builders at once build once; a failed build
names its log; a missing Go says what to install. Without go on PATH they build with the
toolchain :mod:`~dynatrain.devcluster.goinstall` installs (tests/devcluster/test_goinstall.py).
"""

from __future__ import annotations

import os
import threading

import pytest

from dynatrain.devcluster import gobuild, goinstall

# The control plane's go line, so that a machine without Go installs one toolchain, not two.
GO_LINE = goinstall.requirements(gobuild.TOOLS / "k8s" / "go.mod")[0]

GO_MOD = f"""\
// a comment that does not change the pins
module example.com/hello

go {GO_LINE}

tool example.com/hello/cmd/hello
"""

MAIN = """\
package main

import "fmt"

func main() { fmt.Println("hello from a pinned module") }
"""


@pytest.fixture
def module(tmp_path, go):
    src = tmp_path / "mod"
    (src / "cmd" / "hello").mkdir(parents=True)
    (src / "go.mod").write_text(GO_MOD)
    (src / "go.sum").write_text("")
    (src / "cmd" / "hello" / "main.go").write_text(MAIN)
    return gobuild.GoModule(label="hello", module_dir=src, cache_root=tmp_path / "cache",
                            binaries={"hi": "example.com/hello/cmd/hello"},
                            output_names={"hi": "hello"}, env={"CGO_ENABLED": "0"})


def test_builds_once_and_reuses_the_cache(module):
    logs: list[str] = []
    built = gobuild.ensure_built(module, log=logs.append)
    binary = built.path("hi")
    assert binary.is_file() and os.access(binary, os.X_OK)
    assert any("built in" in line for line in logs), logs
    mtime = binary.stat().st_mtime_ns
    logs.clear()
    again = gobuild.ensure_built(module, log=logs.append)
    assert again == built and binary.stat().st_mtime_ns == mtime
    assert logs == []  # nothing was built the second time
    with pytest.raises(KeyError, match="unknown binary 'nope'"):
        built.path("nope")


def test_cache_key_ignores_comments_but_not_pins_flags_or_env(module):
    import dataclasses

    base = gobuild.pins_hash(module)
    go_mod = module.module_dir / "go.mod"
    go_mod.write_text(GO_MOD.replace("a comment", "another comment"))
    assert gobuild.pins_hash(module) == base
    # An older go line: any Go that builds GO_MOD builds this (no other toolchain needed).
    go_mod.write_text(GO_MOD.replace(f"go {GO_LINE}", "go 1.22"))
    assert gobuild.pins_hash(module) != base
    go_mod.write_text(GO_MOD)
    assert gobuild.pins_hash(dataclasses.replace(module, ldflags="-s")) != base
    assert gobuild.pins_hash(dataclasses.replace(module, gcflags="")) != base
    assert gobuild.pins_hash(dataclasses.replace(module, env={})) != base


def test_concurrent_builders_build_once(module):
    logs: list[str] = []
    results = []

    def build():
        results.append(gobuild.ensure_built(module, log=logs.append))

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 3 and len(set(results)) == 1
    assert sum("built in" in line for line in logs) == 1, logs


def test_a_failed_build_names_its_log(module):
    (module.module_dir / "cmd" / "hello" / "main.go").write_text("package main\nfunc main() {")
    with pytest.raises(gobuild.GoBuildError, match=r"build failed with exit code .*build\.log"):
        gobuild.ensure_built(module, log=lambda _: None)
    assert gobuild.cached(module) is None


def test_missing_go_says_what_to_install(module):
    import dataclasses

    no_go = dataclasses.replace(module, go="/nonexistent/go")
    with pytest.raises(gobuild.GoUnavailable, match="install Go"):
        gobuild.ensure_built(no_go)


def test_a_module_dir_without_go_mod_is_refused(tmp_path):
    with pytest.raises(gobuild.GoBuildError, match="no go.mod in module_dir="):
        gobuild.GoModule(label="x", module_dir=tmp_path, cache_root=tmp_path, binaries={})

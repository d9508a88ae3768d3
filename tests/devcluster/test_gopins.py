"""The wrapper Go modules share one version of every module (dynatrain.devcluster.gopins).

Go's build cache reuses a compiled package across the control plane's, helm's and Kueue's
builds only if the package's module, every dependency's, and the build settings are the same
in all of them; a pin moved in one go.mod without `python -m dynatrain.devcluster.gopins`
would silently make CI's cold build compile the shared packages again (minutes). These tests
read the go.mod files with `go mod edit -json` (no network, no build).
"""

from __future__ import annotations

from dynatrain.devcluster import build, gobuild, gopins, helm, kueue


def test_every_module_the_wrappers_share_has_one_version(go):
    left = gopins.misaligned()
    assert left == [], ("tools/{k8s,helm,kueue} require shared modules at different versions "
                        "(run `python -m dynatrain.devcluster.gopins` after moving a pin):\n"
                        + "\n".join(left))
    # the check has something to compare: client-go is in all three
    for name in gopins.WRAPPERS:
        assert "k8s.io/client-go" in gopins.pins(gobuild.TOOLS / name), name


def test_a_module_required_or_replaced_differently_is_named(tmp_path, go):
    def module(name: str, body: str):
        (tmp_path / name).mkdir()
        (tmp_path / name / "go.mod").write_text(f"module example.com/{name}\n\ngo 1.22\n\n{body}")
        return tmp_path / name

    a = module("a", "require (\n\texample.com/x v1.0.0\n\texample.com/y v1.2.0\n"
                    "\texample.com/z v0.1.0\n)\n\nreplace example.com/z => example.com/z v0.1.1\n")
    b = module("b", "require (\n\texample.com/x v1.1.0\n\texample.com/y v1.2.0\n"
                    "\texample.com/z v0.1.0\n)\n")
    left = gopins.misaligned({"a": a, "b": b})
    assert left == ["example.com/x: v1.0.0 in tools/a, v1.1.0 in tools/b",
                    "example.com/z: v0.1.0 => example.com/z v0.1.1 in tools/a, v0.1.0 in tools/b"]


def test_the_three_builds_use_one_build_environment():
    """CGO_ENABLED is part of every package's cache key (net, os/user and all that import
    them): one build with cgo would share nothing with the others."""
    envs = {t.label: dict(t.env) for t in (build.default_toolchain(), helm.default_toolchain(),
                                            kueue.default_toolchain())}
    assert all(env == {"CGO_ENABLED": "0"} for env in envs.values()), envs

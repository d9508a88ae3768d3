"""The image cache's stages: the worker's and the operator's bases start from one Debian stage.

Building for real needs root, debootstrap and minutes (tests/k8s/test_images.py builds and
reads the archives); here the builder's steps are recorded instead, on an empty cache, to check
what is built from what: one debootstrap for both project images, each base a copy of it, and
nothing built again once cached.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynatrain.devcluster import imagebuild, images

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """The steps each build would run, made to leave what the real ones leave in the cache."""
    monkeypatch.setenv("DYNATRAIN_IMAGES_CACHE", str(tmp_path / "cache"))
    calls: list[tuple] = []

    def debian(self, inputs, dest, mirror):
        calls.append(("debian", self.label, dest.name))
        (dest / "rootfs").mkdir(parents=True)
        (dest / "inputs.json").write_text(json.dumps({**inputs, "mirror": mirror}))

    def base(self, inputs, dest, debian, prefix="base"):
        calls.append(("base", self.label, dest.name, debian.name))
        (dest / "rootfs").mkdir(parents=True)
        (dest / "inputs.json").write_text(json.dumps(inputs))

    def project(self, image, repo_root, context, base, archive):
        calls.append(("project", self.label, base.name))
        archive.write_bytes(b"")

    monkeypatch.setattr(imagebuild._Build, "debian", debian)
    monkeypatch.setattr(imagebuild._Build, "base", base)
    monkeypatch.setattr(imagebuild._Build, "project", project)
    monkeypatch.setattr(images, "_read_image", lambda archive, ref: archive)
    return calls


def test_both_project_images_start_from_one_debian_stage(recorded):
    images.operator_image(REPO, mirror="http://mirror.invalid/debian")
    images.worker_image(REPO, mirror="http://mirror.invalid/debian")
    kinds = [c[0] for c in recorded]
    assert kinds == ["debian", "base", "project", "base", "project"], recorded
    (_, first, debian), = [c for c in recorded if c[0] == "debian"]
    assert first == "operator" and debian.startswith("debian-")
    bases = [c for c in recorded if c[0] == "base"]
    assert [(label, stage) for _, label, _, stage in bases] == [("operator", debian),
                                                                 ("worker", debian)]
    # each its own layer 1, under its own name
    assert bases[0][2].startswith("slim-base-") and bases[1][2].startswith("base-")
    # cached: asking again builds nothing
    recorded.clear()
    images.worker_image(REPO)
    images.operator_image(REPO)
    assert recorded == []


def test_a_dependency_change_rebuilds_the_base_but_not_the_debian_stage(recorded,
                                                                       monkeypatch):
    images.worker_image(REPO, mirror="http://mirror.invalid/debian")
    real = images._base_inputs

    def with_one_more(repo_root, kind="worker"):
        inputs = real(repo_root, kind)
        return {**inputs, "dependencies": [*inputs["dependencies"], "pyyaml"]}

    monkeypatch.setattr(images, "_base_inputs", with_one_more)
    recorded.clear()
    images.worker_image(REPO, mirror="http://mirror.invalid/debian")
    assert [c[0] for c in recorded] == ["base", "project"], recorded

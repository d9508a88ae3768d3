"""A real node refuses to start when importing its images would leave the disk below the
kubelet's eviction threshold (dynatrain/devcluster/kubelet.py ``RealNode._check_disk``).

Without the check the kubelet evicts the node's pods for ``ephemeral-storage`` as they start:
a CI emulation here, on a disk that a killed run had left 14 GB fuller, saw only an operator
job that never trained (its operator pod evicted, its replacement unschedulable)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynatrain.devcluster import kubelet
from dynatrain.devcluster.errors import DevClusterError

GIB = 1 << 30


def _node(tmp_path: Path) -> kubelet.RealNode:
    return kubelet.RealNode(kubelet.RealNodeConfig(), workdir=tmp_path, server="https://x",
                            ca=tmp_path / "ca", client=None, lease_s=10,
                            kubelet_binary=tmp_path / "kubelet", start_component=None,
                            log=lambda _: None)


def _image(tmp_path: Path, name: str, size: int):
    archive = tmp_path / f"{name}.tar"
    with open(archive, "wb") as f:
        f.truncate(size)                   # sparse: its size is what counts
    return SimpleNamespace(archive=archive, ref=f"localhost/{name}:dev")


def test_enough_room_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda _: SimpleNamespace(total=100 * GIB, used=0, free=20 * GIB))
    _node(tmp_path)._check_disk([_image(tmp_path, "worker", 6 * GIB)])


def test_too_little_room_is_refused_naming_what_is_needed_and_free(tmp_path, monkeypatch):
    # 12 GiB to import, 1 GiB (1 % of 100) the kubelet keeps: 13.5 GiB free is not enough.
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda _: SimpleNamespace(total=100 * GIB, used=0, free=int(13.5 * GIB)))
    with pytest.raises(DevClusterError) as e:
        _node(tmp_path)._check_disk([_image(tmp_path, "worker", 6 * GIB)])
    text = str(e.value)
    assert "about 12.0 GiB" in text and "13.5 GiB is free" in text and "1%" in text

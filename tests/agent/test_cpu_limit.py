"""A worker's torch threads under a container's CPU limit (dynatrain.spec.hardware.cpu_quota,
agent.worker.fit_threads_to_cpu_limit): the limit is read from the cgroup files as a container
and as the host see them, cgroup v1 and v2, and only ever lowers torch's thread count.
The end-to-end case (a 250m pod on the dev cluster's real node) is in tests/k8s/test_real_node.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dynatrain.agent.worker import fit_threads_to_cpu_limit
from dynatrain.spec.hardware import cpu_quota, threads_for_quota


def v1(root: Path, rel: str, quota: int, period: int = 100000) -> None:
    d = root / "cpu,cpuacct" / rel.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (d / "cpu.cfs_period_us").write_text(f"{period}\n")


def v2(root: Path, rel: str, line: str) -> None:
    d = root / rel.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "cpu.max").write_text(line + "\n")


def proc(tmp_path: Path, text: str) -> str:
    p = tmp_path / "cgroup"
    p.write_text(text)
    return str(p)


def test_v1_as_a_container_sees_it_its_own_cgroup_at_the_root(tmp_path):
    # runc bind-mounts the container's cgroup at the hierarchy's root; /proc/self/cgroup
    # still names the host's path, which does not exist inside.
    root = tmp_path / "fs"
    v1(root, "/", 25000)
    pc = proc(tmp_path, "4:cpu,cpuacct:/kubepods/pod1/abc\n3:memory:/kubepods/pod1/abc\n")
    assert cpu_quota(str(root), pc) == 0.25


def test_v1_as_the_host_sees_it_the_smallest_limit_on_the_path(tmp_path):
    root = tmp_path / "fs"
    v1(root, "/", -1)
    v1(root, "/kubepods", 300000)                # the node's allocatable: 3 cores
    v1(root, "/kubepods/pod1", 150000, 100000)   # the pod: 1.5 cores
    v1(root, "/kubepods/pod1/abc", -1)           # the container: no limit of its own
    pc = proc(tmp_path, "4:cpu,cpuacct:/kubepods/pod1/abc\n")
    assert cpu_quota(str(root), pc) == 1.5


def test_v2_limits_and_none(tmp_path):
    root = tmp_path / "fs"
    v2(root, "/", "max 100000")
    v2(root, "/kubepods.slice/pod2", "50000 100000")
    assert cpu_quota(str(root), proc(tmp_path, "0::/kubepods.slice/pod2\n")) == 0.5
    assert cpu_quota(str(root), proc(tmp_path, "0::/\n")) is None


def test_no_cgroup_files_or_no_limit_is_none(tmp_path):
    root = tmp_path / "fs"
    v1(root, "/", -1)
    assert cpu_quota(str(root), proc(tmp_path, "4:cpu,cpuacct:/\n")) is None
    assert cpu_quota(str(tmp_path / "nothing"), proc(tmp_path, "0::/\n")) is None
    assert cpu_quota(str(root), str(tmp_path / "no-such-file")) is None
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("garbage\n")
    assert cpu_quota(str(root), proc(tmp_path, "4:cpu,cpuacct:/\n")) is None


@pytest.mark.parametrize("quota, cores, threads", [
    (None, 8, 8), (0.25, 2, 1), (1.0, 2, 1), (1.5, 2, 1), (2.0, 2, 2), (3.9, 8, 3),
    (16.0, 8, 8),
])
def test_threads_are_the_whole_cores_of_the_limit_never_more_than_torchs(quota, cores, threads):
    assert threads_for_quota(quota, cores) == threads


def test_the_worker_lowers_torchs_threads_only(capsys):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert fit_threads_to_cpu_limit(3, quota=0.25) == 1
        assert torch.get_num_threads() == 1
        assert "device 3: 1 torch thread(s) for a CPU limit of 0.25 cores" in \
            capsys.readouterr().out
        torch.set_num_threads(2)
        assert fit_threads_to_cpu_limit(3, quota=4.0) == 2       # a limit above: untouched
        assert torch.get_num_threads() == 2 and capsys.readouterr().out == ""
    finally:
        torch.set_num_threads(before)

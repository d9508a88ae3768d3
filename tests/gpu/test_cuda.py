"""The CUDA paths on one GPU (marker ``gpu``; skipped, saying why, where CUDA is unavailable).

World size 1 training on CUDA; the transition engine's adoption and local copies on CUDA
tensors (``dp=1 -> dp=1,zero=1``, NCCL's one-rank group for the commit); a snapshot to pinned
host memory and its restore, also through a recovery's switch; a DCP save and load; and
``dynatrain run`` of a one-GPU job that switches live. The checks are
:mod:`dynatrain.bench.gpu`'s, which ``benchmarks/gpu_check.py`` (``make gpu-check``) also runs.

Each check also runs on the CPU, unmarked, so that the checks themselves keep working on
machines without a GPU (CI): only the device differs.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynatrain.bench import gpu

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_training_world_size_1(device):
    out = gpu.check_training(torch.device(device))
    assert all(math.isfinite(x) for x in out["losses"])


@pytest.mark.parametrize("device", DEVICES)
def test_engine_adopts_and_copies_locally(device):
    out = gpu.check_switch(torch.device(device))
    assert out["bytes_copied"] > 0 and out["bytes_adopted"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_snapshot_to_pinned_memory_and_restore(device):
    out = gpu.check_snapshot(torch.device(device))
    assert out["pinned"] == (device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_dcp_save_and_load(device):
    out = gpu.check_checkpoint(torch.device(device))
    assert out["bytes_written"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_worker_switches_live_on_its_device(device):
    out = gpu.check_run(torch.device(device))
    assert out["pause_seconds"] > 0


@pytest.mark.gpu
def test_pause_against_the_memcpy_floor():
    """Figures, not a timing assertion: the floor is measured and the pause is finite."""
    out = gpu.switch_floor(torch.device("cuda"), model="gpt-tiny", repeats=2,
                           copy_bytes=256 << 20)
    assert out["memcpy_bytes_per_second"] > 0 and out["pause_over_floor"] > 0


def test_gpu_check_says_when_cuda_is_unavailable():
    """``make gpu-check`` on a machine without CUDA: one clear line, exit code 2."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "torch.cuda.is_available() is False" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr

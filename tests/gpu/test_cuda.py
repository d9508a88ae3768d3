"""The CUDA paths on one GPU (marker ``gpu``; skipped, saying why, where CUDA is unavailable).

World size 1 training on CUDA; the transition engine's adoption and local copies on CUDA
tensors (``dp=1 -> dp=1,zero=1``, NCCL's one-rank group for the commit); one-rank NCCL groups
made with ``device_id`` running collectives; a snapshot to pinned host memory and its restore,
also through a recovery's switch; a DCP save and load; four processes sharing the device over
gloo that switch live and that recover from one of them killed (the in-memory snapshots, and on
the CPU also a mirror); and ``dynatrain run`` of a one-GPU job that switches live. The checks
are :mod:`dynatrain.bench.gpu`'s, which ``benchmarks/gpu_check.py`` (``make gpu-check``) also
runs.

Each check also runs on the CPU, unmarked, so that the checks themselves keep working on
machines without a GPU (CI): only the device differs.
"""

import math
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from dynatrain.bench import gpu, gpu_ranks

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
    group = "ProcessGroupNCCL" if device == "cuda" else "ProcessGroupGloo"
    assert out["commit_group"] == f"{group} of 1 rank(s)"


@pytest.mark.parametrize("device", DEVICES)
def test_one_rank_groups_with_device_id(device):
    out = gpu_ranks.check_single_rank_groups(torch.device(device))
    backend = "nccl" if device == "cuda" else "gloo"
    assert out["default_backend"] == backend
    if device == "cuda":
        assert out["bound_device_id"].startswith("cuda:")
        assert out["engine_group"] == "ProcessGroupNCCL of 1 rank(s)"
    else:
        assert out["engine_group"] == "ProcessGroupGloo of 1 rank(s)"
    assert out["default"]["first_all_reduce_seconds"] >= 0


@pytest.mark.parametrize("device", DEVICES)
def test_snapshot_to_pinned_memory_and_restore(device):
    out = gpu.check_snapshot(torch.device(device))
    assert out["pinned"] == (device == "cuda")
    # two exact-size slots made once (reserved as Prepare does), reused by the next
    # generation, returned (unpinned under CUDA) by the trim
    assert out["buffers_made"] == 2 and out["unpinned_bytes"] == out["snapshot_bytes"]


@pytest.mark.parametrize("device", DEVICES)
def test_dcp_save_and_load(device):
    out = gpu.check_checkpoint(torch.device(device))
    assert out["bytes_written"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_worker_switches_live_on_its_device(device):
    out = gpu.check_run(torch.device(device))
    assert out["pause_seconds"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_four_processes_switch_on_one_device(device):
    out = gpu_ranks.check_switch4(torch.device(device))
    assert out["devices"] == [str(gpu._canonical(torch.device(device)))]
    # Placement keeps every new shard where a copy of it is: copies and adoption, no network.
    assert out["bytes_sent"] == 0 and out["bytes_copied"] > 0 and out["bytes_adopted"] > 0
    assert len(out["losses_after"]) == 2 and all(math.isfinite(x) for x in out["losses_after"])
    if device == "cpu":
        assert out["losses_after"] == out["losses_restart"]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_four_processes_recover_from_a_killed_one(device):
    out = gpu_ranks.check_recovery4(torch.device(device))
    assert out["killed"] == 1 and out["restore_step"] == 3
    assert out["devices"] == [str(gpu._canonical(torch.device(device)))]
    assert out["proxies"] == {} and out["bytes_from_mirrors"] == 0   # plain dp: nothing unique
    assert out["bytes_sent"] == 0 and out["bytes_copied"] > 0 and out["bytes_adopted"] > 0


@pytest.mark.slow
def test_four_processes_recover_a_dead_ranks_unique_state_from_its_mirror():
    """ZeRO-1's shards are unique: the dead rank's comes from its buddy's mirror, sent on to
    the survivors whose new ranges cover it (network moves, so the CPU only: gloo does not
    send CUDA tensors)."""
    old, new = gpu_ranks.RECOVERY4_MIRRORED
    out = gpu_ranks.check_recovery4(torch.device("cpu"), old=old, new=new)
    assert out["proxies"] == {"1": 2}                   # rank 1's buddy is rank 2
    assert out["bytes_from_mirrors"] > 0 and out["bytes_sent"] > 0
    assert out["losses_after"] == out["losses_restart"]


def test_a_plan_that_would_send_cuda_tensors_through_gloo_is_refused():
    from types import SimpleNamespace

    from dynatrain.trainer.config import make_config
    from dynatrain.vps.planner import plan_switch
    from dynatrain.vps.rounds import schedule_rounds

    old, new = (make_config("gpt-tiny", t, global_batch_size=12)
                for t in gpu_ranks.RECOVERY4_MIRRORED)
    plan = plan_switch(old.model, old.layout.with_devices(range(4)),
                       new.layout.with_devices([0, 2, 3]), dead=frozenset({1}),
                       proxies={1: 2})
    prepared = SimpleNamespace(rounds=schedule_rounds(plan, 16 << 20))
    sent = gpu_ranks._no_gloo_cuda_sends(prepared, 2, torch.device("cpu"), "the mirrored recovery")
    assert sent > 0
    with pytest.raises(gpu.CheckFailed, match=r"device 2's part of the plan has \d+ network "
                                              r"messages .* gloo cannot carry from CUDA"):
        gpu_ranks._no_gloo_cuda_sends(prepared, 2, torch.device("cuda", 0), "the mirrored recovery")


def _raises_on_rank_1(rank, world, store, results, dev, timeout_s):
    if rank == 1:
        raise ValueError("boom")
    return {"rank": rank}


def _dies_on_rank_1(rank, world, store, results, dev, timeout_s):
    if rank == 1:
        os._exit(3)
    store.wait(["never"], timedelta(seconds=timeout_s))   # a peer waiting on the dead one


def test_the_harness_names_a_failed_or_dead_rank():
    with pytest.raises(gpu.CheckFailed, match=r"rank 1: ValueError: boom"):
        gpu_ranks._run_ranks(_raises_on_rank_1, 2, torch.device("cpu"), {}, what="raises",
                       timeout_s=60)
    with pytest.raises(gpu.CheckFailed, match=r"rank\(s\) \[1\] died without a report "
                                              r"\(exit codes \[3\]"):
        gpu_ranks._run_ranks(_dies_on_rank_1, 2, torch.device("cpu"), {}, what="dies",
                       timeout_s=60)


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

"""The memory and redundancy model (``dynatrain plan --memory``) pinned by hand-computed cases.

gpt-tiny (fp32) has P = 3,716,608 parameters, counted by hand from its architecture: token and
position embeddings 2048*256 + 128*256; per layer two LayerNorms (2 * 2*256), q/k/v and the
output projection with biases (4 * (256*256 + 256)) and the MLP (256*1024 + 1024 + 1024*256 +
256); four layers; a final LayerNorm (2*256); the head tied to the embedding. Its fp32 state
is the parameter, exp_avg and exp_avg_sq (no separate master): 12 bytes per parameter. Every
tensor's byte size is a multiple of the 64-byte alignment, and a slot starts with a 64-byte
header.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from dynatrain.spec.hardware import PROFILES
from dynatrain.controller.memory import (GiB, RedundancyCost, memory_report, pinned_block,
                                         switch_gpu)
from dynatrain.trainer.redundancy import Redundancy, slot_sizes
from dynatrain.vps.layout import bind, parse_layout
from dynatrain.vps.presets import load_model

LAYER = 2 * 2 * 256 + 4 * (256 * 256 + 256) + (256 * 1024 + 1024 + 1024 * 256 + 256)
P = 2048 * 256 + 128 * 256 + 4 * LAYER + 2 * 256
HEADER = 64


@pytest.fixture(scope="module")
def tiny():
    m = load_model("gpt-tiny")
    assert P == 3_716_608 == sum(t.numel for t in m.tensors)
    return m


# A profile with round figures: 1 GB/s to the host and between nodes, 2 devices per node.
ROUND = replace(PROFILES["h100"], name="round", devices_per_node=2, host_bytes_per_second=1e9,
                inter_node_bytes_per_second=1e9, host_memory_bytes=4 * GiB)


def test_pinned_memory_is_reserved_in_powers_of_two():
    # torch's CachingHostAllocator rounds each block up to the next power of two.
    assert [pinned_block(n) for n in (0, 1, 3, 4, 5, 2**30 + 1)] == [0, 1, 4, 4, 8, 2**31]


def test_a_replicated_layout_snapshots_everything_and_mirrors_nothing(tiny):
    layout = parse_layout("dp=2").with_devices([0, 1])
    s = slot_sizes(bind(layout, tiny), 0, 1)
    assert (s.snapshot, s.unique, s.mirror) == (HEADER + 12 * P, HEADER, 0)
    rep = memory_report(tiny, layout, ROUND, global_batch_size=4, seq_len=32)
    (node,) = rep.nodes()                   # both ranks on one node of two
    assert node.ranks == 2 and node.pageable == 0
    assert node.pinned == 2 * 2 * (HEADER + 12 * P)     # exact: what HostBuffers pins
    assert node.pinned_rounded == 2 * 2 * 2**26  # 12P + 64 = 44,599,360 -> 64 MiB blocks
    assert rep.redundancy.copy_seconds == pytest.approx((HEADER + 12 * P) / 1e9)


def test_zero1_mirrors_the_optimizer_half_each_rank_holds_alone(tiny):
    # ZeRO-1 over dp=2: exp_avg and exp_avg_sq split in halves (unique to a rank, mirrored
    # to the buddy), the parameter replicated. One device per node: the mirror crosses.
    layout = parse_layout("dp=2,zero=1").with_devices([0, 1])
    s = slot_sizes(bind(layout, tiny), 1, 1)
    assert (s.snapshot, s.unique, s.mirror) == (HEADER + 8 * P, HEADER + 4 * P,
                                                HEADER + 4 * P)
    one_per_node = replace(ROUND, devices_per_node=1)
    rep = memory_report(tiny, layout, one_per_node, global_batch_size=4, seq_len=32)
    assert [n.ranks for n in rep.nodes()] == [1, 1]
    n = rep.nodes()[0]
    assert n.pinned == 2 * (HEADER + 8 * P) and n.pageable == 2 * (HEADER + 4 * P)
    assert n.pinned_rounded == 2 * 2**25                                  # 8P+64 -> 32 MiB
    r = rep.redundancy
    assert r.copy_seconds == pytest.approx((HEADER + 8 * P) / 1e9)
    assert r.mirror_seconds == pytest.approx((HEADER + 4 * P) / 1e9)


def test_the_slot_sizes_are_what_a_redundancy_allocates(tiny):
    layout = parse_layout("dp=1").with_devices([0])
    r = Redundancy(bind(layout, tiny), 0, None, mirror=False)
    assert r._slots[0].buf.numel() == slot_sizes(bind(layout, tiny), 0).snapshot


def test_a_switch_holds_old_and_new_state_less_what_it_adopts(tiny):
    # dp=2,zero=1 -> dp=1 on device 0: it had the parameter (4P) and half of the optimizer
    # (4P); it gets everything (12P); the parameter is the same tensor before and after.
    old = parse_layout("dp=2,zero=1").with_devices([0, 1])
    new = parse_layout("dp=1").with_devices([0])
    sw = switch_gpu(tiny, old, new, 8)
    assert sw.device == 0
    assert (sw.old_state, sw.new_state, sw.adopted) == (8 * P, 12 * P, 4 * P)
    assert 0 <= sw.staging <= 256 << 20 and sw.peak == 16 * P + sw.staging


def test_the_redundancy_share_and_the_snapshot_interval():
    # On the CPU the copy blocks: exposed = the copy + what of the mirror outlasts a step.
    r = RedundancyCost(copy_seconds=0.5, mirror_seconds=3.0, step_seconds=2.0,
                       copy_overlaps=False)
    assert r.exposed_seconds == 1.5
    assert r.share == 0.75 and r.every_for(0.05) == 15
    assert RedundancyCost(0.04, 0.0, 1.0, copy_overlaps=False).every_for(0.05) == 1
    # On a GPU the copy overlaps the next step and the mirror follows it: exposed = what of
    # copy + mirror outlasts the step.
    g = RedundancyCost(copy_seconds=0.5, mirror_seconds=3.0, step_seconds=2.0)
    assert g.exposed_seconds == 1.5 and g.blocking_share == 0.75
    g = RedundancyCost(copy_seconds=0.5, mirror_seconds=1.0, step_seconds=2.0)
    assert g.exposed_seconds == 0.0 and g.share == 0.0 and g.blocking_share == 0.25


def test_plan_memory_prints_the_built_in_cases_with_the_issue_figures():
    out = subprocess.run([sys.executable, "-m", "dynatrain", "plan", "--memory", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seven, seventy = json.loads(out.stdout)["cases"]
    # llama-7b dp=8 ZeRO-1: ~22 GiB of state per rank, 2 slots x 8 ranks pinned at exact
    # size; torch's caching allocator would have reserved 32 GiB blocks: 512 GiB, exactly.
    assert seven["host_pinned_rounded_per_node"] == 512 * GiB
    assert 21 * GiB < seven["host_pinned_per_node"] / 16 < 23 * GiB
    # The issue's targets: host bytes per node (while a switch keeps the previous
    # generation's slots too) within half of a 2 TiB node, the switch's GPU peak within
    # 80 GB, the modelled redundancy cost within 5% of a step.
    for case in (seven, seventy):
        assert case["host_during_switch_per_node"] <= case["host_bytes_per_node"] / 2
        assert case["switch_gpu_peak"] <= 80e9
        assert case["redundancy_share"] <= 0.05
        assert 0 < case["redundancy_share_blocking"] < 1
    assert seven["host_during_switch_rounded_per_node"] > seven["host_bytes_per_node"] / 2
    assert seventy["layout"] == "dp=4,tp=8,pp=4,zero=1,schedule=1f1b"
    text = subprocess.run([sys.executable, "-m", "dynatrain", "plan", "--memory", "--model",
                           "gpt-tiny", "--from", "dp=2,zero=1", "--to", "dp=1",
                           "--global-batch", "4", "--seq-len", "32", "--profile", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert "GPU, switch to dp=1" in text.stdout and "redundancy per step" in text.stdout
    bad = subprocess.run([sys.executable, "-m", "dynatrain", "plan", "--memory", "--profile",
                          "t4"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--profile='t4' is not a device profile" in bad.stderr

"""The layout solver: candidates, memory accounting, cost-model properties, errors.

Pure and fast: no processes, no torch. Properties are what the controller relies on (the
pick fits and is the best fitting estimate; more devices help; TP stays inside a node), not
the model's absolute numbers, which benchmarks/solver_vs_measured.py checks against the
trainer.
"""

import contextlib
import time
from dataclasses import replace

import pytest

from dynatrain.controller import solver
from dynatrain.controller.costmodel import SolverError, estimate
from dynatrain.spec.hardware import PROFILES, DeviceProfile
from dynatrain.controller.solver import best_for_devices, candidate_layouts, solve
from dynatrain.vps.stagecost import mapping_state_bytes, stage_costs
from dynatrain.vps.layout import Layout, bind, layout_problems, parse_layout
from dynatrain.vps.presets import PRESETS

GPT, MOE, L7 = PRESETS["gpt-tiny"], PRESETS["moe-tiny"], PRESETS["llama-7b"]
H100, CPU = PROFILES["h100"], PROFILES["cpu"]
# A fixed CPU profile (the preset reads this machine's cores and memory).
CPU4 = replace(CPU, shared_cores=4, memory_bytes=16 << 30)
TINY = dict(global_batch_size=8, seq_len=128)


@pytest.mark.parametrize("model, n, gbs, mb", [
    (GPT, 4, 8, 1), (GPT, 8, 16, 2), (GPT, 6, 12, 1), (MOE, 8, 16, 1), (L7, 16, 32, 1),
    (PRESETS["llama-70b"], 32, 64, 1), (PRESETS["mixtral-8x7b"], 16, 16, 1)])
def test_candidates_are_valid_use_all_devices_and_divide_the_batch(model, n, gbs, mb):
    cands = candidate_layouts(model, n, global_batch_size=gbs, micro_batch_size=mb)
    assert cands
    assert len(set(cands)) == len(cands)
    for lay in cands:
        assert lay.world == n
        assert layout_problems(lay, model, n) == []
        assert gbs % (lay.dp * mb) == 0
        assert lay.zero == 0 or lay.dp > 1          # ZeRO with one DP rank shards nothing
        assert lay.stages is None and lay.devices is None


def test_candidates_are_complete_for_a_small_case():
    got = {(c.dp, c.tp, c.pp, c.zero) for c in candidate_layouts(GPT, 4, global_batch_size=8)}
    want = set()
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            if 4 % (tp * pp):
                continue
            dp = 4 // (tp * pp)
            for zero in ((0, 1, 3) if dp > 1 else (0,)):
                want.add((dp, tp, pp, zero))
    assert got == want


def test_max_tp_limits_tensor_parallelism():
    cands = candidate_layouts(L7, 32, global_batch_size=32, max_tp=8)
    assert max(c.tp for c in cands) == 8
    assert max(c.tp for c in candidate_layouts(L7, 32, global_batch_size=32)) == 32


def test_moe_gets_expert_parallel_candidates_and_dense_models_do_not():
    cands = candidate_layouts(MOE, 8, global_batch_size=16)
    eps = {c.ep for c in cands}
    assert eps == {1, 2, 4, 8}
    for c in cands:
        assert c.dp % c.ep == 0 and MOE.num_experts % c.ep == 0
    assert {c.ep for c in candidate_layouts(GPT, 8, global_batch_size=16)} == {1}


@pytest.mark.parametrize("model, text", [
    (GPT, "dp=4"), (GPT, "dp=3,zero=1"), (GPT, "dp=3,zero=3"), (GPT, "dp=2,tp=2,pp=2,zero=1"),
    (GPT, "pp=3"), (GPT, "dp=2,pp=3,zero=3,stages=1+2+1"),
    (MOE, "dp=4,ep=2,zero=1"), (MOE, "dp=4,tp=4,ep=4,zero=3"), (MOE, "dp=2,tp=4,pp=2"),
    (L7, "dp=3,tp=2,pp=2,zero=1"), (L7, "dp=5,pp=3,zero=3"),
    (PRESETS["llama-70b"], "dp=2,tp=16,pp=2,zero=1")])
def test_state_bytes_are_the_mappings_for_the_busiest_rank(model, text):
    lay = parse_layout(text)
    bound = bind(lay, model).layout
    stages = stage_costs(model, replace(bound, devices=None))
    for s, st in enumerate(stages):
        clone = 4 * st.master_elements if model.dtype == "float32" and lay.zero == 1 else 0
        ranks = [lay.rank(s, j, t) for j in range(lay.dp) for t in range(lay.tp)]
        per_rank = [mapping_state_bytes(model, lay, r) for r in ranks[:8]]
        assert st.state_bytes - clone == per_rank[0] == max(per_rank)


def test_solve_picks_the_best_fitting_candidate():
    best = solve(GPT, 4, CPU4, **TINY)
    assert best.fits
    others = [estimate(GPT, c, CPU4, **TINY)
              for c in candidate_layouts(GPT, 4, global_batch_size=8)]
    assert best.tokens_per_second >= max(e.tokens_per_second for e in others if e.fits)
    assert best.layout in [e.layout for e in others]


def test_solve_skips_layouts_that_do_not_fit():
    # llama-7b on 8 devices of 24 GB: only layouts with sharded state and few activations fit
    small = replace(H100, memory_bytes=24 * 10**9)
    kw = dict(global_batch_size=8, seq_len=1024)
    best = solve(L7, 8, small, **kw)
    assert best.fits and best.memory_bytes <= small.memory_bytes
    fastest = max((estimate(L7, c, small, **kw) for c in
                   candidate_layouts(L7, 8, global_batch_size=8, max_tp=8)),
                  key=lambda e: e.tokens_per_second)
    assert not fastest.fits or fastest.layout == best.layout


def test_too_little_memory_names_the_smallest_need():
    tiny = replace(H100, memory_bytes=10**9, reserved_bytes=0)
    kw = dict(global_batch_size=8, seq_len=2048)
    with pytest.raises(SolverError) as err:
        solve(L7, 8, tiny, **kw)
    need = min(estimate(L7, replace(c, schedule=schedule), tiny, **kw).memory_bytes
               for c in candidate_layouts(L7, 8, global_batch_size=8, max_tp=8)
               for schedule in ("gpipe", "1f1b"))   # the solver tries 1F1B where GPipe fails
    msg = str(err.value)
    assert "fits in memory" in msg and f"smallest need is {need / 2**30:.2f} GiB" in msg
    assert "available 0.93 GiB" in msg


def test_llama_7b_on_one_node_of_h100s_needs_no_pipeline():
    best = solve(L7, 8, H100, global_batch_size=8, seq_len=4096)
    assert best.fits
    assert best.layout.pp == 1                     # it fits without pipeline bubbles
    assert best.layout.tp <= 8


def test_more_devices_raise_llama_7b_throughput():
    kw = dict(global_batch_size=32, seq_len=2048)
    tps = [solve(L7, n, H100, **kw).tokens_per_second for n in (8, 16, 32)]
    assert tps[0] < tps[1] < tps[2]


def test_tensor_parallelism_across_nodes_is_slower_than_inside_one():
    lay = parse_layout("dp=2,tp=8")
    kw = dict(global_batch_size=16, seq_len=2048)
    inside = estimate(L7, lay, H100, **kw)
    across = estimate(L7, lay, replace(H100, devices_per_node=4), **kw)
    assert inside.breakdown["tp_comm"] < across.breakdown["tp_comm"]
    assert inside.tokens_per_second > across.tokens_per_second
    # the solver never spreads TP over nodes
    assert solve(L7, 16, H100, **kw).layout.tp <= H100.devices_per_node


def test_tp_inside_nodes_and_pp_across_them_beats_the_other_way_round():
    # 2 nodes of 8 devices. Default order (tp fastest): each TP group of 8 is one node and
    # the two pipeline stages are the two nodes. Order pp-dp-tp: pipeline neighbours share a
    # node and every TP all-reduce crosses nodes. Also TP over all 16 devices crosses nodes.
    kw = dict(global_batch_size=16, seq_len=2048)
    tp_in_node = estimate(L7, parse_layout("tp=8,pp=2"), H100, **kw)
    tp_across = estimate(L7, parse_layout("tp=8,pp=2,order=pp-dp-tp"), H100, **kw)
    tp16 = estimate(L7, parse_layout("tp=16"), H100, **kw)
    assert tp_in_node.tokens_per_second > tp_across.tokens_per_second
    assert tp_in_node.tokens_per_second > tp16.tokens_per_second
    assert tp_in_node.breakdown["tp_comm"] < tp_across.breakdown["tp_comm"]


def test_pipeline_bubble_shrinks_with_more_micro_batches():
    lay = parse_layout("pp=4")
    few = estimate(GPT, lay, H100, global_batch_size=4, seq_len=128)
    many = estimate(GPT, lay, H100, global_batch_size=64, seq_len=128)
    frac = [e.breakdown["bubble"] / e.step_seconds for e in (few, many)]
    assert frac[0] > frac[1] > 0


def test_uneven_shares_are_priced_by_the_rank_with_the_most_micro_batches():
    # On devices alike, 7+7+7+3 of 24 micro-batches takes the step of 7 each (a batch of 28)
    # and trains 24 sequences in it: uneven shares pay only where devices differ (the
    # measured rule, controller/straggler.py, decides that).
    uneven = estimate(GPT, parse_layout("dp=4,shares=7+7+7+3"), H100, global_batch_size=24,
                      seq_len=128)
    seven = estimate(GPT, parse_layout("dp=4"), H100, global_batch_size=28, seq_len=128)
    six = estimate(GPT, parse_layout("dp=4"), H100, global_batch_size=24, seq_len=128)
    assert uneven.step_seconds == pytest.approx(seven.step_seconds, rel=1e-12)
    assert uneven.step_seconds > six.step_seconds
    assert uneven.tokens_per_second == pytest.approx(24 * 128 / uneven.step_seconds)
    with pytest.raises(SolverError, match="shares=7\\+7\\+7\\+3 sum to 24 micro-batches, "
                                          "but a step has global_batch_size / "
                                          "micro_batch_size = 28 / 1 = 28"):
        estimate(GPT, parse_layout("dp=4,shares=7+7+7+3"), H100, global_batch_size=28,
                 seq_len=128)


def test_ranks_sharing_cores_leave_bubbles_to_busy_stages():
    dedicated = replace(CPU4, shared_cores=0)
    shared = replace(CPU4, shared_cores=2)            # 4 ranks on 2 cores
    pp = parse_layout("pp=4")
    d, s = (estimate(GPT, pp, p, **TINY) for p in (dedicated, shared))
    # sharing halves the speed of the full pipeline but not of its fill and drain
    assert s.step_seconds < 2 * d.step_seconds
    dp = parse_layout("dp=4")
    d, s = (estimate(GPT, dp, p, **TINY) for p in (dedicated, shared))
    assert s.breakdown["compute"] == pytest.approx(2 * d.breakdown["compute"])


def test_breakdown_adds_up_and_throughput_follows_from_step_time():
    for text in ("dp=4", "dp=2,tp=2,zero=1", "pp=4", "dp=2,pp=2,zero=3"):
        e = estimate(GPT, parse_layout(text), CPU4, **TINY)
        assert sum(e.breakdown.values()) == pytest.approx(e.step_seconds)
        assert e.tokens_per_second == pytest.approx(8 * 128 / e.step_seconds)
        assert all(v >= 0 for v in e.breakdown.values())
    e = estimate(MOE, parse_layout("dp=4,ep=4"), CPU4, **TINY)
    assert e.breakdown["ep_comm"] > 0


def test_zero_shrinks_state_and_zero3_adds_the_gathered_weights():
    kw = dict(global_batch_size=8, seq_len=1024)
    mem = {z: estimate(L7, Layout(dp=8, zero=z), H100, **kw).memory_breakdown for z in (0, 1, 3)}
    assert mem[0]["state"] > mem[1]["state"] > mem[3]["state"]
    assert mem[3]["zero3_working"] == mem[3]["grads"] > 0 and mem[1]["zero3_working"] == 0
    # bf16 working copy + fp32 master + 2 moments, sharded 8 ways under ZeRO-3
    assert mem[0]["state"] == pytest.approx(L7.num_params * 14, rel=1e-6)
    assert mem[3]["state"] == pytest.approx(L7.num_params * 14 / 8, rel=1e-3)


def test_fixed_layout_is_validated_and_estimated():
    lay = parse_layout("dp=2,tp=2,zero=1")
    e = solve(GPT, 4, CPU4, fixed=lay, **TINY)
    assert e.layout == lay and e.fits
    assert e.tokens_per_second == estimate(GPT, lay, CPU4, **TINY).tokens_per_second
    with pytest.raises(SolverError, match="must equal the number of devices"):
        solve(GPT, 8, CPU4, fixed=lay, **TINY)
    with pytest.raises(SolverError, match="tp=3 must divide the attention heads"):
        solve(GPT, 3, CPU4, fixed=parse_layout("tp=3"), **TINY)
    with pytest.raises(SolverError, match="global_batch_size=6 must be a multiple of dp"):
        solve(GPT, 4, CPU4, fixed=parse_layout("dp=4"), global_batch_size=6, seq_len=128)
    with pytest.raises(SolverError, match=r"needs .* GiB per device"):
        solve(L7, 1, H100, fixed=parse_layout("dp=1"), global_batch_size=1, seq_len=128)
    # a layout already placed on devices (what the controller runs) is accepted as is
    placed = lay.with_devices([7, 3, 5, 1])
    assert solve(GPT, 4, CPU4, fixed=placed, **TINY).layout == placed


def test_a_global_batch_no_dp_divides_is_a_clear_error():
    # gpt-tiny on 64 devices: tp <= 8 heads and pp <= 4 layers force dp >= 2; 9 is odd
    with pytest.raises(SolverError) as err:
        solve(GPT, 64, CPU4, global_batch_size=9, seq_len=128)
    msg = str(err.value)
    assert "global_batch_size=9 is not a multiple of dp * micro_batch_size" in msg
    assert "valid dp values are 2, 4, 8" in msg


def test_bad_batch_geometry_is_rejected():
    with pytest.raises(SolverError, match="seq_len=4096 must be in 1..128"):
        solve(GPT, 4, CPU4, global_batch_size=8, seq_len=4096)
    with pytest.raises(SolverError, match="global_batch_size=0"):
        solve(GPT, 4, CPU4, global_batch_size=0, seq_len=128)


def test_solve_is_deterministic():
    kw = dict(global_batch_size=32, seq_len=2048)
    a = solve(L7, 16, H100, **kw)
    stage_costs.cache_clear()
    b = solve(L7, 16, H100, zero_stages=(3, 1, 0), **kw)
    assert a.layout == b.layout and a.tokens_per_second == b.tokens_per_second
    assert a.memory_bytes == b.memory_bytes and a.breakdown == b.breakdown


def test_ties_prefer_less_memory_then_less_tp():
    # fp32 gpt-tiny: ZeRO-1 (param + master clone) and ZeRO-3 (shard + gathered weights)
    # cost the same in this model; the lower stage wins the tie deterministically
    e1, e3 = (estimate(GPT, Layout(dp=4, zero=z), CPU4, **TINY) for z in (1, 3))
    assert e1.tokens_per_second == e3.tokens_per_second
    key = solver._rank_key
    assert min([e3, e1], key=key).layout.zero == 1
    slow = replace(e1, tokens_per_second=e1.tokens_per_second * 0.9)
    assert min([slow, e3], key=key) is e3


def test_best_for_devices_may_leave_devices_idle():
    kw = dict(global_batch_size=32, seq_len=2048)
    best = best_for_devices(L7, 12, H100, min_devices=4, **kw)
    assert 4 <= best.layout.world <= 12
    for n in range(4, 13):
        with contextlib.suppress(SolverError):
            assert solve(L7, n, H100, **kw).tokens_per_second <= best.tokens_per_second
    # (2 devices fit with 1F1B, which holds 2 of the 32 micro-batches' activations)
    with pytest.raises(SolverError, match="no device count in 1..1"):
        best_for_devices(L7, 1, H100, **kw)


def test_solve_for_llama_7b_on_64_devices_is_fast():
    stage_costs.cache_clear()
    t = time.perf_counter()
    e = solve(L7, 64, H100, global_batch_size=64, seq_len=4096)
    assert time.perf_counter() - t < 2.0
    assert e.fits and e.layout.world == 64


def test_profiles_are_complete():
    for name, p in PROFILES.items():
        assert isinstance(p, DeviceProfile) and p.name == name
        assert p.flops_per_second > 0 and p.memory_bytes > 0
        assert p.intra_node_bytes_per_second >= p.inter_node_bytes_per_second > 0


def test_latency_by_group_size():
    p = replace(CPU4, latency_seconds=1e-3, group_latency_seconds=((2, 2e-3), (4, 5e-3)))
    assert p.latency(1) == 1e-3 and p.latency(2) == 2e-3 and p.latency(3) == 2e-3
    assert p.latency(4) == 5e-3 and p.latency(8) == 5e-3
    assert replace(p, group_latency_seconds=()).latency(4) == 1e-3
    # a slower 4-rank group makes tp=4's many collectives slower
    tp4 = parse_layout("tp=4")
    assert estimate(GPT, tp4, p, **TINY).breakdown["tp_comm"] > \
        2 * estimate(GPT, tp4, replace(p, group_latency_seconds=()), **TINY).breakdown["tp_comm"]


@pytest.mark.parametrize("labels, preset", [
    ({"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, "h100"),
    ({"nvidia.com/gpu.product": "NVIDIA-H200"}, "h200"),
    ({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}, "a100"),
    ({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}, "a100-40gb"),
    # The product alone does not say which A100: its memory label does (MiB).
    ({"nvidia.com/gpu.product": "NVIDIA-A100-PCIE", "nvidia.com/gpu.memory": "40960"},
     "a100-40gb"),
    ({"nvidia.com/gpu.product": "NVIDIA-L40S"}, "l40s"),
    ({"nvidia.com/gpu.product": "NVIDIA-L4"}, "l4"),
    ({"nvidia.com/gpu.product": "Tesla-T4"}, None),
    ({}, None),
])
def test_a_nodes_gpu_labels_pick_its_preset(labels, preset):
    from dynatrain.spec.hardware import profile_for_gpu_name, profile_for_node_labels

    got = profile_for_node_labels(labels)
    assert (got.name if got else None) == preset
    # what CUDA calls the same GPUs
    assert profile_for_gpu_name("NVIDIA A100-SXM4-40GB").name == "a100-40gb"
    assert profile_for_gpu_name("NVIDIA L40S").name == "l40s"


def test_on_40_gb_a100s_the_solver_picks_a_layout_that_fits_40_gb():
    # llama-7b on 8 GPUs at 4k tokens: what fits an 80 GB device does not fit a 40 GB one,
    # so a job priced as an H100 on A100-40GB nodes would run out of memory.
    a40 = PROFILES["a100-40gb"]
    on_h100 = solve(L7, 8, H100, global_batch_size=8, seq_len=4096)
    on_a40 = solve(L7, 8, a40, global_batch_size=8, seq_len=4096)
    assert on_a40.fits and on_a40.memory_bytes <= on_a40.available_bytes <= a40.memory_bytes
    assert on_h100.memory_bytes > a40.memory_bytes, on_h100      # H100's pick would not fit
    assert on_a40.layout.to_text() != on_h100.layout.to_text()

from collections import Counter

from hypothesis import given, settings

from dynatrain.vps.boxes import box_numel, intersect
from dynatrain.vps.layout import bind, parse_layout
from dynatrain.vps.mapping import model_states, rank_shards, shards
from dynatrain.vps.presets import PRESETS

from harness.strategies import layouts, models
from hypothesis import strategies as st


def _held(bound):
    """(tensor, state) -> Counter of how many ranks hold each element (brute force)."""
    out = {}
    for rank, entries in shards(bound).items():
        for rs in entries:
            c = out.setdefault((rs.tensor.name, rs.state), Counter())
            for p in rs.pieces:
                ranges = [range(a, b) for a, b in p.box]
                stack = [()]
                for r in ranges:
                    stack = [s + (i,) for s in stack for i in r]
                c.update(stack)
    return out


@settings(max_examples=40)
@given(st.data())
def test_every_element_is_held_and_pieces_tile_each_local_tensor(data):
    model = data.draw(models())
    bound = bind(data.draw(layouts(model)), model)
    held = _held(bound)
    for t in model.tensors:
        for state in model_states(model):
            c = held[(t.name, state)]
            assert len(c) == t.numel, (t.name, state)  # every element somewhere
    for rank, entries in shards(bound).items():
        for rs in entries:
            local = sum(box_numel(p.local) for p in rs.pieces)
            size = 1
            for n in rs.local_shape:
                size *= n
            assert local == size  # pieces fill the local tensor ...
            for i, a in enumerate(rs.pieces):  # ... without overlapping
                for b in rs.pieces[i + 1:]:
                    assert intersect(a.local, b.local) is None
                    assert intersect(a.box, b.box) is None


def test_megatron_rules_on_gpt_tiny_tp2_pp2():
    bound = bind(parse_layout("tp=2,pp=2"), PRESETS["gpt-tiny"])
    r1 = {(s.tensor.name, s.state): s for s in rank_shards(bound, 1)}  # stage 0, tp rank 1
    assert r1[("layers.0.attn.q.weight", "param")].pieces[0].box == ((128, 256), (0, 256))
    assert r1[("layers.0.attn.o.weight", "param")].pieces[0].box == ((0, 256), (128, 256))
    assert r1[("layers.0.mlp.fc2.bias", "param")].pieces[0].box == ((0, 256),)  # replicated
    assert r1[("embed.tokens", "param")].pieces[0].box == ((1024, 2048), (0, 256))
    assert ("layers.2.attn.q.weight", "param") not in r1  # layer 2 is on stage 1
    r3 = {(s.tensor.name, s.state) for s in rank_shards(bound, 3)}
    assert ("embed.tokens", "param") in r3  # tied embedding: a replica on the last stage


def test_gqa_kv_heads_replicate_when_tp_exceeds_them():
    bound = bind(parse_layout("tp=4"), PRESETS["moe-tiny"])  # 2 kv heads of 32 rows
    boxes = [{s.tensor.name: s for s in rank_shards(bound, r)}["layers.0.attn.k.weight"]
             .pieces[0].box for r in range(4)]
    assert boxes[0] == boxes[1] == ((0, 32), (0, 128))
    assert boxes[2] == boxes[3] == ((32, 64), (0, 128))


def test_ep_splits_experts_and_zero1_shards_over_expert_dp():
    bound = bind(parse_layout("dp=4,ep=2,zero=1"), PRESETS["moe-tiny"])
    by_rank = [{(s.tensor.name, s.state): s for s in rank_shards(bound, r)} for r in range(4)]
    gate = [b[("layers.0.moe.experts.gate", "param")].pieces[0].box[0] for b in by_rank]
    assert gate == [(0, 4), (4, 8), (0, 4), (4, 8)]  # ep_rank = dp index % ep
    # Master of the experts is sharded over the 2 expert-DP replicas: half each.
    m0 = by_rank[0][("layers.0.moe.experts.gate", "exp_avg")]
    assert m0.local_shape == (4 * 256 * 128 // 2,)
    # Dense tensors shard over all 4 DP ranks.
    assert by_rank[0][("layers.0.attn.q.weight", "exp_avg")].local_shape == (128 * 128 // 4,)

"""Hypothesis strategies: small random models and layouts that fit them.

Models are tiny (hidden sizes of 8-32) so that the element-by-element plan verifier runs in
milliseconds, yet they exercise every sharding rule: GQA with replicated kv heads, tied
embeddings, MoE with EP, uneven stages, every rank order and ZeRO stage.
"""

from __future__ import annotations

from hypothesis import strategies as st

from dynatrain.vps.layout import Layout, all_orders, layout_problems
from dynatrain.vps.model import ModelSpec
from dynatrain.vps.presets import PRESETS


@st.composite
def models(draw) -> ModelSpec:
    arch = draw(st.sampled_from(["gpt", "llama"]))
    heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([2, 4]))
    kv = heads if arch == "gpt" else draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
    moe = arch == "llama" and draw(st.booleans())
    return ModelSpec(
        name="random", arch=arch, vocab_size=draw(st.sampled_from([8, 12, 16])),
        hidden_size=heads * head_dim, num_layers=draw(st.integers(1, 5)), num_heads=heads,
        num_kv_heads=kv, ffn_hidden_size=draw(st.sampled_from([4, 8, 12])),
        max_seq_len=4, num_experts=4 if moe else 0, experts_top_k=2 if moe else 0,
        moe_ffn_hidden_size=draw(st.sampled_from([4, 8])) if moe else 0,
        tie_embeddings=draw(st.booleans()), qk_norm=moe and draw(st.booleans()),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])))


@st.composite
def layouts(draw, model: ModelSpec, max_world: int = 8) -> Layout:
    """A layout with at most ``max_world`` ranks that fits ``model``."""
    for _ in range(50):
        tp = draw(st.sampled_from([1, 2, 4]))
        pp = draw(st.integers(1, min(4, model.num_layers)))
        dp = draw(st.sampled_from([1, 2, 3, 4]))
        if tp * pp * dp > max_world:
            continue
        ep = draw(st.sampled_from([e for e in (1, 2, 4) if dp % e == 0])) if model.is_moe else 1
        stages = None
        if pp > 1 and draw(st.booleans()):
            cuts = sorted(draw(st.lists(st.integers(1, model.num_layers - 1), min_size=pp - 1,
                                        max_size=pp - 1, unique=True)))
            bounds = [0, *cuts, model.num_layers]
            stages = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        layout = Layout(dp=dp, tp=tp, pp=pp, ep=ep, zero=draw(st.sampled_from([0, 1, 3])),
                        stages=stages, order=draw(st.sampled_from(all_orders())))
        if not layout_problems(layout, model):
            return layout
    return Layout()


@st.composite
def transitions(draw, max_world: int = 8):
    """(model, old layout with devices, new layout with devices).

    The new layout runs on a random selection of devices: survivors in any order plus joiners.
    """
    model = draw(models())
    old = draw(layouts(model, max_world))
    new = draw(layouts(model, max_world))
    old = old.with_devices(range(old.world))
    pool = list(range(old.world + new.world))
    devices = draw(st.permutations(pool))[: new.world]
    return model, old, new.with_devices(devices)


@st.composite
def recoveries(draw, presets: tuple[str, ...] = ("gpt-tiny", "moe-tiny"), max_world: int = 8):
    """(model, old layout, new layout, dead devices, proxies) for a switch after failures.

    One or two old devices die; the new layout runs on survivors and joiners. Every dead device
    has a proxy among the live devices of either layout (two dead devices may share one), as a
    buddy holding a host-memory mirror of its state would.
    """
    model = PRESETS[draw(st.sampled_from(presets))]
    old = draw(layouts(model, max_world))
    new = draw(layouts(model, max_world))
    old = old.with_devices(range(old.world))
    dead = sorted(draw(st.lists(st.sampled_from(range(old.world)), min_size=1,
                                max_size=min(2, old.world), unique=True)))
    pool = [d for d in range(old.world + new.world) if d not in dead]
    devices = draw(st.permutations(pool))[: new.world]
    live = sorted((set(old.device_of) | set(devices)) - set(dead))
    proxies = {d: draw(st.sampled_from(live)) for d in dead}
    return model, old, new.with_devices(devices), frozenset(dead), proxies


#: Published shapes, dense and MoE, with their layer count cut (pipeline stages still vary;
#: the per-layer shapes that decide every cut are the real ones). Planning is metadata only.
HELD_OUT_PRESETS = ("llama-7b", "llama-70b", "mixtral-8x7b", "qwen3-235b-a22b")


@st.composite
def big_layouts(draw, model: ModelSpec, lo: int, hi: int, max_dp: int = 64) -> Layout:
    """A realistic layout (tp in 1..8, pp in 1..8, ZeRO 0/1, EP for MoE) of ``lo..hi`` ranks."""
    for _ in range(100):
        tp = draw(st.sampled_from([1, 2, 4, 8]))
        pp = draw(st.sampled_from([1, 2, 3, 4, 8]))
        dp = draw(st.integers(1, max_dp))
        if not lo <= tp * pp * dp <= hi:
            continue
        ep = 1
        if model.is_moe:
            ep = draw(st.sampled_from([e for e in (1, 2, 4, 8, 16, 32)
                                       if dp % e == 0 and model.num_experts % e == 0]))
        layout = Layout(dp=dp, tp=tp, pp=pp, ep=ep, zero=draw(st.sampled_from([0, 1])))
        if not layout_problems(layout, model):
            return layout
    return Layout(dp=lo, tp=1, pp=1)


@st.composite
def held_out_transitions(draw, num_layers: int = 16, max_dp: int = 64,
                         kinds: tuple[str, ...] = ("grow", "shrink", "lost")):
    """(kind, model, old, new, dead, proxies) on 16-512 devices, nodes of 8.

    ``num_layers`` cuts the presets' depth and ``max_dp`` the data-parallel degree: both only
    scale the number of records (ZeRO flat ranges of many ranks against a new cut make the
    most), which the element-by-element verifier pays for.

    ``grow``: the new layout has more ranks (joiners after the old devices). ``shrink``: fewer.
    ``lost``: one node or a few devices die; the new layout runs on survivors, and every dead
    device has a buddy on the next node holding its mirror (a proxy), as the agents keep them.
    The new layout's devices are placed as ``dynatrain plan`` places them.
    """
    from dataclasses import replace

    from dynatrain.vps.placement import place_devices

    model = replace(PRESETS[draw(st.sampled_from(HELD_OUT_PRESETS))], num_layers=num_layers)
    kind = draw(st.sampled_from(kinds))
    if kind == "grow":
        old = draw(big_layouts(model, 16, 256, max_dp))
        new = draw(big_layouts(model, old.world + 1, 512, max_dp))
    else:
        old = draw(big_layouts(model, 24 if kind == "lost" else 17, 512, max_dp))
        new = draw(big_layouts(model, 16, old.world - 1, max_dp))
    old = old.with_devices(range(old.world))
    dead: frozenset[int] = frozenset()
    proxies: dict[int, int] = {}
    pool = list(range(max(old.world, new.world)))
    if kind == "lost":
        if draw(st.booleans()):
            node = draw(st.integers(0, old.world // 8 - 1))
            dead = frozenset(range(8 * node, 8 * node + 8))
        else:
            dead = frozenset(draw(st.lists(st.integers(0, old.world - 1), min_size=1,
                                           max_size=4, unique=True)))
        for d in sorted(dead):
            proxies[d] = next(p for p in ((d + 8 * i) % old.world for i in range(1, old.world))
                              if p not in dead)
        pool = [d for d in range(old.world) if d not in dead]
        if new.world > len(pool):
            new = draw(big_layouts(model, 16, len(pool), max_dp))
        pool = pool[: new.world]
    else:
        pool = pool[: new.world]
    new = place_devices(model, old, new, pool)
    return kind, model, old, new, dead, proxies

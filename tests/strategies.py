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

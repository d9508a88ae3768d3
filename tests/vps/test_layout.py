import pytest

from dynatrain.vps.layout import (Layout, LayoutError, bind, default_stages, micro_batch_shares,
                                  parse_layout)
from dynatrain.vps.presets import PRESETS

GPT, MOE, L70 = PRESETS["gpt-tiny"], PRESETS["moe-tiny"], PRESETS["llama-70b"]


def test_parse_full_text_form_and_round_trip():
    lay = parse_layout("dp=4,tp=2,pp=3,ep=2,zero=1,stages=12+10+10,order=tp-pp-dp")
    assert (lay.dp, lay.tp, lay.pp, lay.ep, lay.zero) == (4, 2, 3, 2, 1)
    assert lay.stages == (12, 10, 10) and lay.order == ("tp", "pp", "dp")
    assert parse_layout(lay.to_text()) == lay


def test_defaults_are_one_and_zero_is_zero():
    assert parse_layout("tp=2") == Layout(dp=1, tp=2, pp=1, ep=1, zero=0)


def test_shares_round_trip_and_equal_shares_are_the_even_split():
    lay = parse_layout("dp=4,zero=1,shares=7+7+7+3")
    assert lay.shares == (7, 7, 7, 3)
    assert lay.to_text() == "dp=4,tp=1,pp=1,zero=1,shares=7+7+7+3"
    assert parse_layout(lay.to_text()) == lay
    # 6+6+6+6 is the even split: one value and one text, so no switch is made to it.
    assert parse_layout("dp=4,shares=6+6+6+6") == parse_layout("dp=4")
    assert not lay.same_shape(parse_layout("dp=4,zero=1"))


@pytest.mark.parametrize("text, batch, micro, want", [
    ("dp=4", 24, 1, (6, 6, 6, 6)),
    ("dp=4,shares=7+7+7+3", 24, 1, (7, 7, 7, 3)),
    ("dp=2,shares=1+3", 8, 2, (1, 3)),
    ("dp=3,shares=2+3+3", 8, 1, (2, 3, 3)),      # uneven shares let dp=3 split a batch of 8
])
def test_micro_batch_shares(text, batch, micro, want):
    assert micro_batch_shares(parse_layout(text), batch, micro) == want


@pytest.mark.parametrize("text, batch, micro, fragment", [
    ("dp=3", 8, 1, "global_batch_size=8 must be a multiple of dp * micro_batch_size = 3 * 1 "
                   "(or give uneven shares=..."),
    ("dp=2,shares=1+3", 8, 1, "shares=1+3 sum to 4 micro-batches, but a step has "
                              "global_batch_size / micro_batch_size = 8 / 1 = 8"),
    ("dp=2", 9, 2, "global_batch_size=9 must be a positive multiple of micro_batch_size=2"),
])
def test_micro_batch_shares_that_do_not_split_the_batch_are_named(text, batch, micro, fragment):
    with pytest.raises(LayoutError) as e:
        micro_batch_shares(parse_layout(text), batch, micro)
    assert fragment in str(e.value)


def test_default_stages_front_load_the_remainder():
    assert default_stages(94, 8) == (12, 12, 12, 12, 12, 12, 11, 11)
    assert default_stages(4, 3) == (2, 1, 1)
    assert bind(parse_layout("pp=3"), GPT).layout.stages == (2, 1, 1)


def test_ranks_follow_the_order_tp_fastest_by_default():
    lay = parse_layout("dp=2,tp=2,pp=2")
    assert [lay.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert all(lay.rank(*lay.coords(r)) == r for r in range(8))
    other = parse_layout("dp=2,tp=2,pp=2,order=pp-dp-tp")
    assert other.coords(1) == (1, 0, 0)


@pytest.mark.parametrize("text, fragment", [
    ("dp=4,tp=two", "tp='two' is not an integer"),
    ("dp=4,xp=2", "unknown key 'xp'"),
    ("dp=4,dp=2", "dp is given twice"),
    ("dp4", "'dp4' is not key=value"),
    ("zero=2", "zero=2 is not a ZeRO stage; valid: 0, 1, 3"),
    ("dp=0", "dp=0 must be a positive integer"),
    ("order=tp-dp", "must be a permutation of tp, dp, pp"),
    ("stages=1+x", "layer counts joined by '+'"),
    ("dp=2,shares=3", "shares=3 lists 1 data-parallel ranks but dp=2"),
    ("dp=2,shares=3+0", "every data-parallel rank needs >= 1 micro-batch"),
    ("dp=2,shares=3+x", "micro-batch counts joined by '+'"),
    ("dp=2,ep=2,shares=3+1", "shares=3+1 needs ep=1"),
    ("", "is empty"),
])
def test_malformed_text_is_named(text, fragment):
    with pytest.raises(LayoutError) as e:
        parse_layout(text)
    assert fragment in str(e.value)


@pytest.mark.parametrize("model, text, fragment", [
    (GPT, "tp=3", "tp=3 must divide the attention heads (8)"),
    (L70, "tp=128", "tp=128 must divide the attention heads (64)"),
    (MOE, "tp=4,ep=2", "ep=2 must divide dp=1"),
    (MOE, "dp=3,ep=3", "ep=3 must divide the expert count (8)"),
    (GPT, "dp=2,ep=2", "ep=2 needs an MoE model"),
    (GPT, "pp=2,stages=3+2", "sum to 5, but gpt-tiny has 4 layers"),
    (GPT, "pp=3,stages=2+2", "lists 2 stages but pp=3"),
    (GPT, "pp=2,stages=4+0", "every stage needs >= 1 layer"),
    (GPT, "pp=5", "pp=5 exceeds the 4 layers"),
])
def test_layout_that_does_not_fit_the_model_is_named(model, text, fragment):
    with pytest.raises(LayoutError) as e:
        bind(parse_layout(text), model)
    assert fragment in str(e.value)


def test_gqa_kv_heads_may_be_replicated_but_not_split_unevenly():
    bind(parse_layout("tp=8"), L70)             # 8 kv heads, one each
    bind(parse_layout("tp=4"), MOE)             # 2 kv heads, each on 2 ranks
    with pytest.raises(LayoutError, match="kv heads"):
        bind(parse_layout("tp=4"), PRESETS["mixtral-8x7b"].__class__(
            **{**PRESETS["mixtral-8x7b"].to_dict(), "num_heads": 12, "num_kv_heads": 6,
               "hidden_size": 4092}))


def test_device_count_must_match_world():
    with pytest.raises(LayoutError, match=r"dp\*tp\*pp = 2\*2\*1 = 4 must equal the number of "
                                          r"devices \(6\)"):
        bind(parse_layout("dp=2,tp=2"), GPT, num_devices=6)
    with pytest.raises(LayoutError, match="names a device twice"):
        bind(parse_layout("dp=2").with_devices([3, 3]), GPT)


def test_every_problem_is_reported_at_once():
    with pytest.raises(LayoutError) as e:
        bind(parse_layout("tp=3,pp=9"), GPT)
    assert "tp=3" in str(e.value) and "pp=9" in str(e.value)

"""The training-state API: out of one layout, into another, training goes on unchanged."""

import pytest
import torch

from dynatrain.trainer.config import make_config
from dynatrain.trainer.launch import run_local

from test_equivalence import KW, assert_state_close


@pytest.mark.parametrize("model, first, second", [
    ("gpt-tiny", "dp=2,zero=1", "tp=2,pp=2"),
    ("moe-tiny", "dp=4,ep=2,zero=1", "tp=2,pp=2,zero=3"),
])
def test_continuing_under_another_layout_follows_an_uninterrupted_run(model, first, second):
    whole = run_local(make_config(model, second, **KW), 6, want_state=True)
    part1 = run_local(make_config(model, first, **KW), 3, want_state=True)
    assert part1.full_state.step == 3 and part1.full_state.data_position == 3 * 8
    part2 = run_local(make_config(model, second, **KW), 3, want_state=True,
                      start=part1.full_state)
    for a, b in zip(part1.losses + part2.losses, whole.losses):
        assert abs(a - b) / b < 1e-5, (part1.losses + part2.losses, whole.losses)
    assert part2.full_state.step == 6 and part2.full_state.data_position == 6 * 8
    assert_state_close(part2.full_state.tensors, whole.full_state.tensors, f"{first}->{second}")


def test_a_state_that_does_not_match_the_mapping_is_refused():
    from dynatrain.trainer.groups import ParallelGroups
    from dynatrain.trainer.trainer import LocalState, Trainer

    config = make_config("gpt-tiny", "dp=1", **KW)
    groups = ParallelGroups(rank=0, pp_index=0, dp_index=0, tp_index=0)
    with pytest.raises(KeyError, match="lacks embed.tokens"):
        Trainer(config, groups, state=LocalState({}, 0, 0))
    wrong = LocalState({("embed.tokens", "param"): (torch.zeros(3, 3), ())}, 0, 0)
    with pytest.raises(ValueError, match=r"got shape \(3, 3\), the mapping says \(2048, 256\)"):
        Trainer(config, groups, state=wrong)

"""The planner's quality target on the benchmark suite: busiest device <= 1.10 x lower bound."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import plan_quality  # noqa: E402


def test_suite_is_broad():
    models = {c.model for c in plan_quality.SUITE}
    assert len(plan_quality.SUITE) >= 20
    assert {"mixtral-8x7b", "qwen3-235b-a22b", "llama-70b"} <= models
    assert any(c.to_devices for c in plan_quality.SUITE)  # node loss


@pytest.mark.parametrize("case", plan_quality.SUITE, ids=lambda c: c.name)
def test_busiest_device_is_within_10_percent_of_the_bound(case):
    row = plan_quality.run_case(case)
    assert row["max_rank_bytes"] >= row["lower_bound_max_rank_bytes"]
    assert row["ratio"] <= plan_quality.TARGET, row

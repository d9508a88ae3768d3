"""benchmarks/vs_native.py at a tiny size: both sides run the same model math on the same data
(steps 1 and 2's losses agree), and the table prints a ratio per layout. Timings are not
checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vs_native  # noqa: E402

from dynatrain.trainer.config import ConfigError  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_layout_beside_its_native_peer_computes_the_same_loss(capsys):
    # seq 8, 2 sequences per step: a few seconds per layout, most of it process start-up.
    rc = vs_native.main(["--seq-len", "8", "--global-batch-size", "2", "--warmup", "0",
                         "--steps", "2", "--block", "1", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    result = json.loads(out.out)
    rows = {r["layout"]: r for r in result["rows"]}
    assert set(rows) == set(vs_native.PAIRS)
    for layout, r in rows.items():
        # Same initial weights, same batch: only rounding differs (a wrong head split or
        # different data moves step 1 by far more; a missed gradient all-reduce or tied
        # embedding sum moves step 2, after one AdamW step on each side).
        assert r["loss_step1_rel_diff"] < vs_native.LOSS_REL, (layout, r)
        assert r["loss_step2_rel_diff"] < vs_native.LOSS2_REL, (layout, r)
        assert r["dynatrain_ms"] > 0 and r["native_ms"] > 0
        assert r["ratio"] == pytest.approx(r["dynatrain_ms"] / r["native_ms"])
    lines = vs_native.table(result).splitlines()
    for layout, native in vs_native.PAIRS.items():
        assert any(line.startswith(layout + " ") and native in line and "x " in line
                   for line in lines), (layout, lines)


def test_a_model_the_native_side_cannot_build_is_refused_by_name():
    with pytest.raises(ConfigError, match="moe-tiny"):
        vs_native.bench(model="moe-tiny", layouts=("dp=2",), seq_len=8, global_batch=2,
                        warmup=1, steps=1)


def test_a_layout_without_a_native_peer_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="dp=4.*dp=2"):
        vs_native.bench(layouts=("dp=4",), seq_len=8, global_batch=2, warmup=1, steps=1)

"""benchmarks/vs_torchft.py: a tiny run of both sides (only where torchft is installed; it is a
benchmark-only dependency, ``pip install 'dynatrain[bench]'``) and its figures' arithmetic.
Structural checks only: every step done on both sides, the killed replica gone, figures there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vs_torchft  # noqa: E402


def test_steady_state_leaves_out_warmup_and_the_recovery():
    ends = {s: float(s) for s in range(1, 6)}                 # 1 s steps up to step 5
    ends.update({6: 15.0, 7: 16.0, 8: 16.5, 9: 17.0, 10: 17.5})   # kill at 5.5, recovered at 6
    f = vs_torchft.step_figures(ends, kill_time=5.5, recovered_step=6)
    assert f["steady_step_seconds_before_kill"] == 1.0        # steps 3..5 (1, 2: warm-up)
    assert f["steady_step_seconds_after_kill"] == 0.5         # steps 8..10 (6, 7: recovery)
    assert f["steady_intervals"] == 6


def test_without_torchft_it_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setenv("RUST_LOG", "warn")                     # main() sets it otherwise
    monkeypatch.setitem(sys.modules, "torchft", None)         # import torchft -> ImportError
    assert "pip install" in vs_torchft.torchft_missing()
    assert vs_torchft.main(["--side", "torchft"]) == 2
    assert "torchft==0.2.0" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_both_sides_survive_the_same_kill(tmp_path):
    if why := vs_torchft.torchft_missing():
        pytest.skip(f"needs the torchft package: {why}")
    out = vs_torchft.bench(steps=8, kill_at=4, victim=1, global_batch=12, seq_len=16,
                           timeout_s=150, keep=str(tmp_path))
    for side in ("dynatrain", "torchft"):
        r = out[side]
        assert r["outcome"] == "recovered", (side, r["message"])
        assert r["steps_completed"] == 8
        assert r["killed"] == [1]
        assert (r["workers_before"], r["workers_after"]) == (4, 3)
        assert r["recovered_step"] is not None and r["recovered_step"] > 4 - 1
        assert r["kill_to_next_step_seconds"] > 0
        assert r["steady_step_seconds"] > 0
    assert out["dynatrain"]["layout_after"].startswith("dp=3,")     # held to pure DP
    assert out["torchft"]["killed_exit_code"] == -9
    assert [c for i, c in enumerate(out["torchft"]["exit_codes"]) if i != 1] == [0, 0, 0]
    table = vs_torchft.table(out)
    assert "kill -> next step" in table and "TorchFT (example)" in table

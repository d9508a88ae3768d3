"""The job's story from its rank 0: step lines, and TensorBoard events read back by
TensorBoard's own reader (EventAccumulator), across tenures and a recovery."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dynatrain.agent.training_log import TrainingLog

PHASES = {"compute": 0.06, "communication": 0.03, "redundancy": 0.01}


def _step(log: TrainingLog, step: int, loss: float) -> None:
    log.step(step=step, loss=loss, learning_rate=1e-3, grad_norm=0.5, tokens_per_second=1000.0,
             mfu=0.25, layout="dp=2,tp=1,pp=1", phases=PHASES, seconds=0.1)


def _read(directory) -> EventAccumulator:
    acc = EventAccumulator(str(directory))
    acc.Reload()
    return acc


def test_step_lines_every_n_steps_and_the_last(tmp_path):
    lines = []
    log = TrainingLog("demo", 0, steps=7, log_every=3, out=lambda text, **_: lines.append(text))
    for step in range(1, 8):
        _step(log, step, 10.0 - step)
    steps = [int(line.split("step")[1].split("/")[0]) for line in lines]
    assert steps == [3, 6, 7], lines
    assert "loss 3.000000" in lines[-1] and "mfu 25.00%" in lines[-1]
    assert "compute 60%  communication 30%  redundancy 10%" in lines[-1]
    log.close()                       # no directory: nothing written, nothing to close


def test_events_across_two_tenures_and_a_recovery(tmp_path):
    said = []
    out = lambda text, **_: said.append(text)   # noqa: E731
    first = TrainingLog("demo", 0, steps=20, tensorboard_dir=str(tmp_path), out=out)
    for step in range(1, 6):
        _step(first, step, float(step))
    first.switch(kind="switch", reason="preemption", from_layout="dp=2,tp=1,pp=1",
                 to_layout="dp=1,tp=1,pp=1", step=5, pause_seconds=0.012, generation=2)
    first.end_tenure()                # a switch made another device rank 0
    # The new rank 0 (another process on a cluster) goes on in the same directory; then a
    # recovery goes back to step 7 and trains 8.. again with other losses.
    second = TrainingLog("demo", 1, steps=20, tensorboard_dir=str(tmp_path), out=out)
    second.switch(kind="start", reason="start", from_layout="", to_layout="dp=1,tp=1,pp=1",
                  step=0, pause_seconds=0.1, generation=1)     # logged, never a marker
    for step in range(6, 10):
        _step(second, step, float(step))
    second.end_tenure()
    import time
    time.sleep(1.1)                   # event files are named by their second of creation
    third = TrainingLog("demo", 1, steps=20, tensorboard_dir=str(tmp_path), out=out)
    third.switch(kind="recovery", reason="failure", from_layout="dp=1,tp=1,pp=1",
                 to_layout="dp=1,tp=1,pp=1", step=7, pause_seconds=0.3, generation=3,
                 detail="restored step 7 from memory")
    for step in range(8, 11):
        _step(third, step, 100.0 + step)
    third.close()

    acc = _read(tmp_path)
    losses = {e.step: e.value for e in acc.Scalars("train/loss")}
    # Every step once, the retrained ones as trained last.
    assert losses == {**{s: float(s) for s in range(1, 8)}, 8: 108.0, 9: 109.0, 10: 110.0}
    assert [e.step for e in acc.Scalars("events/pause_ms")] == [5, 7]
    assert [round(e.value, 3) for e in acc.Scalars("events/pause_ms")] == [12.0, 300.0]
    markers = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("events/text_summary")]
    assert len(markers) == 2 and "preemption" in markers[0] and "failure" in markers[1]
    assert "dp=2,tp=1,pp=1 → dp=1,tp=1,pp=1" in markers[0], markers
    for tag in ("train/learning_rate", "train/grad_norm", "train/tokens_per_second",
                "train/mfu"):
        assert len(acc.Scalars(tag)) == 10, tag
    assert any(line.split(": ", 1)[1].startswith("RECOVERY dp=1,tp=1,pp=1 -> dp=1,tp=1,pp=1")
               and "restored step 7" in line for line in said), said
    assert any("START - -> dp=1,tp=1,pp=1" in line for line in said), said


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="log_every=0 must be >= 1"):
        TrainingLog("demo", 0, steps=1, log_every=0)

"""The picture of a local run (``dynatrain.controller.report``), from summaries built by hand:
no worker processes. The figure's text is read back from its artists, so what a reader sees
named (each switch's reason and layouts) is checked without OCR; the PNG is read back to check
that it is an image of the size asked for, and not blank."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.image
import pytest

from dynatrain.cli.app import main
from dynatrain.controller.report import (figure_texts, marks, render, steps_of, summary_lines,
                                         write_report)

QUICKSTART = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")


def _switch(frm, to, reason, step, time, pause, nbytes, **extra):
    return {"from": frm, "to": to, "reason": reason, "step": step, "time": time,
            "pause_seconds": pause, "bytes": nbytes, "result": "success", "generation": 2,
            "phases": {}, **extra}


def _summary(*, switches=True) -> dict:
    """40 steps, step 9 without a time, steps 26-27 trained again after a recovery at step
    25 (listed twice: the later training wins), a start entry and two switches."""
    log = []
    for s in range(1, 41):
        log.append({"step": s, "loss": 7.7 * math.exp(-s / 25) + 2.5,
                    "tokens_per_second": 3000.0 + 50 * (s % 7),
                    "time": None if s == 9 else round(2 + 0.25 * s, 3)})
    # The stale trainings of steps 26 and 27, listed before the ones that count.
    log[25:25] = [{"step": 26, "loss": 99.0, "tokens_per_second": 1.0, "time": 8.0},
                  {"step": 27, "loss": 99.0, "tokens_per_second": 1.0, "time": 8.2}]
    recovery = _switch("dp=3,tp=1,pp=1", "dp=2,tp=1,pp=1", "failure", 25, 8.9, 0.04, 2**20,
                       phases={"recovery_seconds": 0.11, "lost_steps": 2,
                               "from_checkpoint": False})
    start = _switch("", "dp=4,tp=1,pp=1", "start", 0, 1.0, 0.0, 0)
    moves = [_switch("dp=4,tp=1,pp=1", "dp=3,tp=1,pp=1", "preemption", 12, 5.1, 0.0121, 0),
             _switch("dp=2,tp=1,pp=1", "dp=1,tp=2,pp=2", "requested", 33, 10.4, 0.0155,
                     44_600_000)]
    return {"job": "handmade", "steps": 40, "final_loss": log[-1]["loss"], "wall_seconds": 12.5,
            "samples_consumed": 480, "samples_exactly_once": True,
            "switches": [start, *moves] if switches else [],
            "recoveries": [recovery] if switches else [],
            "requests": [{"layout": "dp=1,tp=2,pp=2", "step": 31, "state": "applied",
                          "answer": "applied at step 33", "applied_step": 33}],
            "step_log": log}


def test_the_png_is_an_image_of_the_run(tmp_path):
    path = write_report(_summary(), tmp_path / "new" / "dir")
    assert path == tmp_path / "new" / "dir" / "handmade-run.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (990, 1760)              # 16 x 9 in at 110 dpi
    ink = (pixels[..., :3] < 0.9).any(axis=-1).mean()
    assert 0.02 < ink < 0.5, f"{ink:.1%} of the pixels are not white"


def test_the_figure_names_every_switch_and_recovery():
    summary = _summary()
    texts = figure_texts(render(summary))
    every = "\n".join(texts)
    labels = [t for t in texts if t.startswith("#")]
    # One label per switch or recovery on each of the four plots; the start is not a switch.
    assert len(labels) == 3 * 4
    assert not any("start" in t for t in labels)
    for label, frm, to in (
            ("#1 preemption, 12 ms\ndp=4→dp=3", "dp=4,tp=1,pp=1", "dp=3,tp=1,pp=1"),
            ("#2 recovery, 110 ms\ndp=3→dp=2, 2 steps again", "dp=3,tp=1,pp=1",
             "dp=2,tp=1,pp=1"),
            ("#3 requested, 16 ms\ndp=2→tp=2,pp=2", "dp=2,tp=1,pp=1", "dp=1,tp=2,pp=2")):
        assert labels.count(label) == 4, (label, labels)
        assert f"      {frm}\n    → {to}" in every               # the side panel, in full
    assert "switch: preemption" in texts and "switch: requested" in texts   # the legend
    assert "recovery from a failure" in texts and "steps trained again" in texts
    assert "data: 480 samples,\n  each exactly once" in texts
    assert "1 step(s) without a time (left off" in every
    assert "2 switches, 28 ms paused in all" in every


def test_marks_and_steps_from_the_summary():
    summary = _summary()
    found = marks(summary)
    assert [(m.number, m.kind, m.reason, m.step) for m in found] == [
        (1, "switch", "preemption", 12), (2, "recovery", "failure", 25),
        (3, "switch", "requested", 33)]
    steps = steps_of(summary)
    assert [s["step"] for s in steps] == list(range(1, 41))
    assert steps[8]["time"] is None
    assert steps[25]["loss"] < 10 and steps[26]["loss"] < 10    # the later training of 26, 27


def test_a_run_without_switches_and_an_old_summary_without_a_step_log(tmp_path):
    summary = _summary(switches=False)
    assert "no switches" in summary_lines(summary)
    assert write_report(summary, tmp_path).is_file()
    old = {k: v for k, v in summary.items() if k != "step_log"}
    old["losses"] = [e["loss"] for e in steps_of(summary)]
    assert [s["step"] for s in steps_of(old)] == list(range(1, 41))
    assert write_report(old, tmp_path / "old").is_file()


def test_dynatrain_report_draws_a_saved_summary(tmp_path, capsys):
    saved = tmp_path / "summary.json"
    saved.write_text(json.dumps(_summary()))
    assert main(["report", str(saved), "--out", str(tmp_path / "pics")]) == 0
    assert capsys.readouterr().out.strip() == f"report: {tmp_path / 'pics' / 'handmade-run.png'}"
    assert main(["report", str(saved)]) == 0                  # default: beside the summary
    assert (tmp_path / "handmade-run.png").is_file()


@pytest.mark.parametrize("content, fragment", [
    ("[1, 2]", "not a run summary"),
    ("{not json", "is not a readable JSON file"),
    (json.dumps({"job": "j", "step_log": [{"step": 1, "loss": "high"}]}), "step_log[0]"),
])
def test_dynatrain_report_refuses_what_is_not_a_summary(tmp_path, capsys, content, fragment):
    saved = tmp_path / "summary.json"
    saved.write_text(content)
    assert main(["report", str(saved), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1


def test_a_report_dir_that_is_a_file_is_refused_before_the_run(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("")
    saved = tmp_path / "summary.json"
    saved.write_text(json.dumps(_summary()))
    for argv in (["run", QUICKSTART, "--report", str(taken)],
                 ["run", QUICKSTART, "--report", str(taken / "below")],
                 ["report", str(saved), "--out", str(taken)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"={str(taken if argv[-1] == str(taken) else taken / 'below')!r}" in err
        assert "a file, not a directory" in err
    assert not list(tmp_path.glob("*.png"))

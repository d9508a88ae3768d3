"""The fine-tuning example end to end: a Hugging Face model in, live switches, a model out.

``examples/make_tiny_hf.py`` makes the tiny random Llama and its tokenizer (offline), and
``dynatrain run`` fine-tunes it on the shipped corpus with the example's manifest (schedule,
clipping, text data) under a preemption mid-warmup and a re-layout, then exports it. The test
shortens the job (fewer steps) and points the paths into a temporary directory; everything
else is the example as a user runs it. What comes out must load in ``transformers`` unchanged
and hold trained weights (every tensor moved from the original).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_the_example_fine_tunes_through_switches_and_exports(tmp_path):
    made = subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_hf.py"), "--out",
                           str(tmp_path / "tiny")], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    doc = yaml.safe_load((ROOT / "examples" / "finetune-hf.yaml").read_text())
    spec = doc["spec"]
    spec["model"]["hf"] = str(tmp_path / "tiny" / "model")
    spec["training"]["data"]["path"] = str(tmp_path / "corpus.jsonl")
    spec["training"]["data"]["tokenizer"] = str(tmp_path / "tiny" / "tokenizer")
    spec["training"]["steps"] = 40
    spec["training"]["lrSchedule"]["warmupSteps"] = 10
    spec["output"]["hf"] = str(tmp_path / "finetuned")
    (tmp_path / "corpus.jsonl").write_bytes((ROOT / "examples" / "data" / "corpus.jsonl")
                                            .read_bytes())
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({"initialWorkers": 4, "events": [
        {"atStep": 3, "preempt": {"workers": [3], "noticeSeconds": 30}},
        {"atStep": 20, "layout": "dp=1,tp=3,pp=1"}]}))
    summary = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "-m", "dynatrain", "run", str(job), "--scenario",
                           str(scenario), "--summary-json", str(summary), "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=360)
    print(proc.stdout[-5000:], proc.stderr[-3000:])
    assert proc.returncode == 0, f"exit {proc.returncode}"
    out = json.loads(summary.read_text())
    assert out["samples_exactly_once"] and out["steps"] == 40
    assert [s["reason"] for s in out["switches"]][:1] == ["preemption"]
    assert out["switches"][0]["step"] <= 10, "the preemption is meant to land in warmup"
    losses = out["losses"]
    assert losses[-1] < losses[0] - 0.5, losses            # it fine-tunes
    assert "model: written to" in proc.stdout

    import torch
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny" / "model")
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "finetuned")
    assert (tmp_path / "finetuned" / "tokenizer.json").is_file()       # copied along
    b, a = before.state_dict(), after.state_dict()
    assert b.keys() == a.keys()
    assert all(a[k].shape == b[k].shape for k in b)
    assert sum(not torch.equal(a[k], b[k]) for k in b) == len(b)        # every tensor trained

"""Shuffled, blended data through a preemption, a join and a kill: `dynatrain run` end to end.

The data stream is a pure function of the global sample index (seeded permutation per source
and epoch, a fixed blend schedule), so a run whose layout changes three times, once by
recovering from a worker killed without notice, must read exactly the samples of the run
without events, each once, and follow its losses step for step. The manifest carries the data
as users write it (``spec.training.data: {sources: [...], shuffle, seed}``), so the parsing,
the workers' sources and the audit are all the real ones. The run without events is the
trainer alone (``run_local``) under one fixed layout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from dynatrain.spec.job import job_from_manifest
from dynatrain.trainer.launch import run_local
from dynatrain.vps.layout import parse_layout

pytestmark = pytest.mark.slow

STEPS, GBS, SEQ = 24, 12, 32


def _job(tmp: Path) -> dict:
    rng = np.random.default_rng(0)
    # two sources of different sizes: `a` (a third of the samples) is read in 2.4 epochs
    a, b = tmp / "a.bin", tmp / "b.bin"
    rng.integers(0, 300, 40 * SEQ + 1).astype("uint16").tofile(a)
    rng.integers(300, 600, 400 * SEQ + 1).astype("uint16").tofile(b)
    return {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": "blend"},
            "spec": {"image": "unused", "model": {"preset": "gpt-tiny"},
                     "elastic": {"minWorkers": 1, "maxWorkers": 4},
                     "parallelism": {"mode": "auto"}, "globalBatchSize": GBS,
                     "training": {"steps": STEPS, "seqLen": SEQ, "learningRate": 3e-4,
                                  "data": {"sources": [{"path": str(a), "weight": 1},
                                                       {"path": str(b), "weight": 2}],
                                           "shuffle": True, "seed": 5}}}}


def _run(tmp: Path, name: str, job: Path, *extra: str) -> dict:
    summary = tmp / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "dynatrain", "run", str(job), "--run-dir",
                           str(tmp / name), "--summary-json", str(summary), *extra],
                          capture_output=True, text=True, timeout=600)
    print(proc.stdout[-5000:], proc.stderr[-3000:])
    assert proc.returncode == 0, f"exit {proc.returncode}"
    return json.loads(summary.read_text())


@pytest.mark.timeout(500)
def test_shuffled_blend_through_preemption_join_and_kill_follows_the_run_without(tmp_path):
    doc = _job(tmp_path)
    config = job_from_manifest(doc).train_config(parse_layout("dp=1"))
    assert config.shuffle and config.shuffle_seed == 5 and len(config.data_blend) == 2
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({"initialWorkers": 4, "events": [
        # the joiner's process takes seconds to start, so it is asked for first; it is
        # switched in once up, after the preemption and the kill
        {"atStep": 1, "join": 1},
        {"atStep": 3, "preempt": {"workers": [3], "noticeSeconds": 30}},
        {"atStep": 10, "kill": {"workers": [1]}}]}))
    elastic = _run(tmp_path, "elastic", job, "--scenario", str(scenario))
    # Every event was taken in. How the controller carried them out depends on timing: on a
    # busy machine the kill can come while the preemption's (or the join's) switch is still
    # being prepared, and then one recovery onto the workers left carries out both, which
    # is what it should do; the data and the losses below must not depend on it either way.
    assert sorted(e["kind"] for e in elastic["events"]) == ["join", "kill", "preempt"], \
        elastic["events"]
    assert elastic.get("recoveries"), "the kill is meant to be recovered from"
    assert elastic["samples_exactly_once"] and elastic["samples_consumed"] == STEPS * GBS
    # The run without events: the same job's config, trained by the trainer alone under one
    # fixed layout (cheaper than a second `dynatrain run`, whose workers take ~30 s to start
    # on a busy machine; that comparison measured 8e-8 at most).
    steady = run_local(job_from_manifest(doc).train_config(parse_layout("dp=1")), STEPS).losses
    assert len(elastic["losses"]) == len(steady) == STEPS
    for step, (a, b) in enumerate(zip(elastic["losses"], steady), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} with events, {b} without"

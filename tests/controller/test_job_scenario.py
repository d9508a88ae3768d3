"""Job manifests and scenario files: the examples load, and bad input names its field."""

from pathlib import Path

import pytest
import yaml

from dynatrain.spec.job import JobError, job_from_manifest, load_job
from dynatrain.controller.scenario import ScenarioError, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[2]


def _quickstart() -> dict:
    return yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())


def test_examples_load():
    job = load_job(ROOT / "examples" / "quickstart.yaml")
    assert job.model.name == "gpt-tiny" and job.max_workers == 4 and job.mode == "auto"
    assert job.training.steps == 80 and job.training.seq_len == 64
    sc = load_scenario(ROOT / "examples" / "scenario.yaml")
    assert [e.kind for e in sc.events] == ["preempt", "join", "layout"]
    assert sc.initial_workers == 4


@pytest.mark.parametrize("path, value, field", [
    (("spec", "elastic", "maxWorkers"), 0, "spec.elastic.maxWorkers"),
    (("spec", "elastic", "minWorkers"), 9, "spec.elastic.minWorkers"),
    (("spec", "elastic", "workers"), 7, "spec.elastic.workers"),
    (("spec", "model", "preset"), "gpt-huge", "spec.model.preset"),
    (("spec", "parallelism", "mode"), "magic", "spec.parallelism.mode"),
    (("spec", "parallelism", "layout"), "dp=two", "spec.parallelism.layout"),
    (("spec", "parallelism", "layout"), "tp=3", "spec.parallelism.layout"),
    (("spec", "globalBatchSize"), -1, "spec.globalBatchSize"),
    (("spec", "training", "steps"), 0, "spec.training.steps"),
    (("spec", "training", "learningRate"), "fast", "spec.training.learningRate"),
    (("spec", "training", "seqLen"), 4096, "spec.training.seqLen"),
    (("spec", "agent", "port"), 70000, "spec.agent.port"),
    (("spec", "preemptionPolicy"), "Panic", "spec.preemptionPolicy"),
    (("spec", "training", "precision"), "fp8", "spec.training.precision"),
    (("spec", "training", "gradClip"), -1.0, "spec.training.gradClip"),
    (("spec", "training", "lrSchedule"), {"decay": "step"}, "spec.training.lrSchedule.decay"),
    (("spec", "training", "lrSchedule"), {"warmupSteps": 5, "decaySteps": 5},
     "spec.training.lrSchedule"),
    (("spec", "training", "lrSchedule"), {"minLearningRate": 1.0},
     "spec.training.lrSchedule.minLearningRate"),
    (("spec", "training", "lrSchedule"), {"warmup": 5}, "spec.training.lrSchedule: unknown"),
    (("spec", "training", "data"), {"path": "corpus.jsonl"}, "spec.training.data.tokenizer"),
    (("spec", "training", "data"), {"path": "t.bin", "dtype": "int8"},
     "spec.training.data.dtype"),
    (("spec", "training", "data"), 7, "spec.training.data"),
    (("spec", "model"), {"hf": "/nonexistent/llama"}, "spec.model.hf"),
    (("spec", "model"), {"preset": "gpt-tiny", "hf": "/m"}, "spec.model"),
    (("spec", "model"), {"hf": "/m", "hfConfig": {"architectures": ["GPT2LMHeadModel"]}},
     "spec.model.hfConfig"),
    (("spec", "output", "hf"), "", "spec.output.hf"),
    (("spec", "output", "tensorboard"), "", "spec.output.tensorboard"),
    (("spec", "output", "logEverySteps"), 0, "spec.output.logEverySteps"),
    (("spec", "recovery", "snapshotEverySteps"), 0, "spec.recovery.snapshotEverySteps"),
    (("spec", "recovery", "snapshotEverySteps"), "4", "spec.recovery.snapshotEverySteps"),
    (("kind",), "Job", "kind"),
])
def test_bad_manifest_names_field(path, value, field):
    doc = _quickstart()
    node = doc
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    with pytest.raises(JobError) as e:
        job_from_manifest(doc)
    assert field in str(e.value), e.value
    # The value is named too; for a mapping, the wrong entry (by its value, or by its key
    # when the key is what is wrong).
    entries = value.items() if isinstance(value, dict) else [("", value)]
    assert any(str(v) in str(e.value) or k and k in str(e.value) for k, v in entries), e.value


def test_training_essentials_and_data_reach_the_trainer_config(tmp_path):
    doc = _quickstart()
    doc["spec"]["training"].update(
        precision="bf16", gradClip=1.0, data={"path": str(tmp_path / "tokens.bin"),
                                              "dtype": "uint32"},
        lrSchedule={"warmupSteps": 4, "decay": "cosine", "minLearningRate": 1e-5})
    doc["spec"]["output"] = {"hf": str(tmp_path / "out")}
    (tmp_path / "tokens.bin").write_bytes(bytes(4 * 200))
    job = job_from_manifest(doc)
    assert job.model.dtype == "bfloat16" and job.save_hf == str(tmp_path / "out")
    from dynatrain.vps.layout import parse_layout

    cfg = job.train_config(parse_layout("dp=2"))
    assert (cfg.grad_clip, cfg.data_dtype, cfg.total_steps) == (1.0, "uint32", 80)
    assert cfg.lr_at(0) == pytest.approx(3e-4 / 4)                    # warmup
    assert cfg.lr_at(3) == pytest.approx(3e-4)                        # peak
    assert cfg.lr_at(79) == pytest.approx(1e-5, rel=0.05)             # the floor at the end
    doc["spec"]["training"]["data"] = str(tmp_path / "tokens.bin")    # a plain path: uint16
    assert job_from_manifest(doc).training.data_dtype == "uint16"


def test_every_problem_reported_at_once():
    doc = _quickstart()
    doc["spec"]["elastic"]["maxWorkers"] = 0
    doc["spec"]["training"]["steps"] = -3
    with pytest.raises(JobError) as e:
        job_from_manifest(doc)
    assert "spec.elastic.maxWorkers" in str(e.value) and "spec.training.steps" in str(e.value)


def test_fixed_mode_needs_layout():
    doc = _quickstart()
    doc["spec"]["parallelism"] = {"mode": "fixed"}
    with pytest.raises(JobError, match="spec.parallelism.layout is required"):
        job_from_manifest(doc)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(JobError, match="nope.yaml"):
        load_job(tmp_path / "nope.yaml")


@pytest.mark.parametrize("doc, needle", [
    ({"events": [{"atStep": -1, "join": 1}]}, "events[0].atStep"),
    ({"events": [{"atStep": 3}]}, "exactly one of"),
    ({"events": [{"atStep": 3, "join": 0}]}, "events[0].join"),
    ({"events": [{"atStep": 3, "preempt": {"workers": []}}]}, "events[0].preempt"),
    ({"events": [{"atStep": 3, "preempt": {"workers": [1], "noticeSeconds": 0}}]},
     "noticeSeconds"),
    ({"events": [{"atStep": 3, "evict": {"workers": [1], "graceSeconds": -1}}]},
     "events[0].evict.graceSeconds"),
    ({"events": [{"atStep": 3, "evict": {"workers": [1], "noticeSeconds": 5}}]},
     "events[0].evict must be {workers: [ids], graceSeconds: N}"),
    ({"events": [{"atStep": 3, "layout": "dp=x"}]}, "events[0].layout"),
    ({"events": [{"atStep": 3, "join": 1, "oops": 2}]}, "oops"),
    ({"initialWorkers": 0}, "initialWorkers"),
    ({"event": []}, "unknown keys"),
])
def test_bad_scenario_names_field(doc, needle):
    with pytest.raises(ScenarioError) as e:
        parse_scenario(doc)
    assert needle in str(e.value)


def test_scenario_events_sorted_by_step():
    sc = parse_scenario({"events": [{"atStep": 9, "join": 1},
                                    {"atStep": 2, "preempt": {"workers": [0]}}]})
    assert [e.at_step for e in sc.events] == [2, 9]
    assert sc.events[0].notice_seconds == 30.0


def test_an_eviction_carries_its_grace_period():
    sc = parse_scenario({"events": [{"atStep": 4, "evict": {"workers": [2, 3],
                                                            "graceSeconds": 12}}]})
    (ev,) = sc.events
    assert (ev.kind, ev.workers, ev.notice_seconds) == ("evict", (2, 3), 12.0)
    assert "SIGTERM" in ev.describe() and "12 s grace" in ev.describe()


def test_run_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    from dynatrain.cli import main

    bad = _quickstart()
    bad["spec"]["elastic"]["maxWorkers"] = 0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "spec.elastic.maxWorkers=0" in err and "Traceback" not in err
    sc = tmp_path / "sc.yaml"
    sc.write_text("events: [{atStep: 1, join: 0}]")
    assert main(["run", str(ROOT / "examples" / "quickstart.yaml"), "--scenario", str(sc)]) == 2
    assert "events[0].join" in capsys.readouterr().err
    assert main(["run", str(ROOT / "examples" / "quickstart.yaml"), "--device-profile",
                 "tpu"]) == 2
    assert "per-worker" in capsys.readouterr().err


def test_run_help_shows_an_example(capsys):
    from dynatrain.cli import main

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "--scenario" in out and "examples/quickstart.yaml" in out


@pytest.mark.parametrize("resume, ok", [
    ("/checkpoints/other/step-00000012", True),
    ("other/step-00000012", True),                 # relative to spec.checkpoint.path, kept so
    ("/data/other/step-00000012", False),          # outside the claim
    ("/checkpoints-evil/step-1", False),           # a prefix of the name is not under it
    ("/checkpoints/../etc/step-1", False),
    ("../elsewhere/step-1", False),
])
def test_resume_from_of_a_job_with_a_checkpoint_claim_must_be_on_the_claim(resume, ok):
    doc = _quickstart()
    doc["spec"]["checkpoint"] = {"claimName": "ckpt", "path": "/checkpoints"}
    doc["spec"]["recovery"] = {"resumeFrom": resume}
    if ok:
        assert job_from_manifest(doc).recovery.resume_from == resume
        return
    with pytest.raises(JobError) as e:
        job_from_manifest(doc)
    assert f"spec.recovery.resumeFrom={resume!r}" in str(e.value), e.value
    assert "spec.checkpoint.path='/checkpoints'" in str(e.value), e.value


def test_resume_from_without_a_claim_is_a_local_path():
    doc = _quickstart()                            # no spec.checkpoint: `dynatrain run` only
    doc["spec"]["recovery"] = {"resumeFrom": "../runs/first/checkpoints"}
    assert job_from_manifest(doc).recovery.resume_from == "../runs/first/checkpoints"


def test_a_checkpointing_job_needs_a_name_that_can_be_its_checkpoint_folder():
    doc = _quickstart()
    doc["spec"]["checkpoint"] = {"claimName": "ckpt"}
    doc["metadata"]["name"] = "../other"
    with pytest.raises(JobError, match=r"metadata.name='\.\./other' cannot name the job's "
                                       "checkpoint folder"):
        job_from_manifest(doc)

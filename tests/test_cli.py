"""The `dynatrain` console script as a user runs it: real subprocesses, real exit codes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

DYNATRAIN = [sys.executable, "-m", "dynatrain"]
PLAN_KEYS = {"model", "params", "state_bytes", "ranks_from", "ranks_to", "bytes_local",
             "bytes_network", "max_rank_send_bytes", "max_rank_recv_bytes", "max_rank_bytes",
             "lower_bound_max_rank_bytes", "transfers", "plan_seconds", "modelled_seconds",
             "lower_bound_seconds"}


def run(*args):
    return subprocess.run([*DYNATRAIN, *args], capture_output=True, text=True, timeout=120)


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "dynatrain"
    assert exe.exists(), "pip install should create the `dynatrain` console script"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "plan" in out.stdout


def test_plan_json_has_the_documented_fields():
    out = run("plan", "--model", "gpt-tiny", "--from", "dp=4", "--to", "dp=8", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert PLAN_KEYS <= set(data)
    assert data["bytes_network"] == 4 * data["state_bytes"]
    assert data["max_rank_bytes"] == data["state_bytes"] == data["lower_bound_max_rank_bytes"]


def test_plan_json_reports_the_modelled_pause_on_the_links_given():
    args = ["plan", "--model", "gpt-tiny", "--from", "dp=2", "--to", "dp=4", "--json",
            "--gpus-per-node", "2"]
    fast = json.loads(run(*args).stdout)
    slow = json.loads(run(*args, "--inter-gbps", "100", "--intra-gbps", "900").stdout)
    assert 0 < fast["lower_bound_seconds"] <= fast["modelled_seconds"]
    assert slow["lower_bound_seconds"] == pytest.approx(4 * fast["lower_bound_seconds"])
    assert slow["inter_gbps"] == 100 and fast["intra_gbps"] == 3600


def test_estimate_alone_runs_the_paper_cases():
    out = run("plan", "--estimate", "--json")
    assert out.returncode == 0, out.stderr
    cases = json.loads(out.stdout)["cases"]
    assert {c["model"] for c in cases} == {"llama-70b", "qwen3-235b-a22b"}
    assert any(c["ranks_from"] == 1024 and c["ranks_to"] == 896 for c in cases)
    for c in cases:
        assert 0 < c["lower_bound_seconds"] <= c["modelled_seconds"] <= c["published_seconds"]
    text = run("plan", "--estimate").stdout
    assert "4.36 s" in text and "published" in text


def test_estimate_for_one_switch():
    out = run("plan", "--estimate", "--model", "gpt-tiny", "--from", "dp=2", "--to", "tp=2")
    assert out.returncode == 0, out.stderr
    assert "this switch" in out.stdout and "modelled" in out.stdout


def test_plan_table_and_verify():
    out = run("plan", "--model", "moe-tiny", "--from", "dp=4,ep=4,zero=1",
              "--to", "tp=2,dp=2,ep=2", "--verify")
    assert out.returncode == 0, out.stderr
    assert "busiest device" in out.stdout and "lower bound" in out.stdout
    assert "modelled pause" in out.stdout and "modelled / bound" in out.stdout
    assert "verified" in out.stdout


def test_to_devices_after_losing_a_device():
    out = run("plan", "--model", "gpt-tiny", "--from", "dp=4", "--to", "dp=3",
              "--to-devices", "0,1,2", "--dead-devices", "3", "--json")
    data = json.loads(out.stdout)
    assert out.returncode == 0 and data["bytes_network"] == 0
    assert sorted(data["devices_to"]) == [0, 1, 2]


@pytest.mark.parametrize("args, fragment", [
    (["--model", "gpt-9000", "--from", "dp=1", "--to", "dp=2"], "unknown model 'gpt-9000'"),
    (["--model", "gpt-tiny", "--from", "dp=1", "--to", "tp=3"], "tp=3 must divide"),
    (["--model", "gpt-tiny", "--from", "dp=1", "--to", "dp=2,zero=2"], "zero=2 is not a ZeRO"),
    (["--model", "gpt-tiny", "--from", "dp=2", "--to", "dp=2", "--to-devices", "0,1,2"],
     "2 ranks (dp*tp*pp) but 3 devices"),
    (["--model", "gpt-tiny", "--from", "dp=2", "--to", "dp=2", "--to-devices", "0,x"],
     "not a comma-separated list"),
    (["--model", "gpt-tiny", "--from", "dp=2,zero=1", "--to", "dp=1", "--to-devices", "1",
      "--dead-devices", "0"], "no surviving copy"),
    (["--model", "gpt-tiny", "--from", "dp=2", "--to", "dp=2", "--devices-per-node", "0"],
     "--devices-per-node=0 must be >= 1"),
    (["--model", "gpt-tiny", "--from", "dp=2", "--to", "dp=2", "--inter-gbps", "0"],
     "--inter-gbps=0 must be a positive bandwidth"),
    (["--model", "gpt-tiny", "--from", "dp=2", "--to", "dp=2", "--intra-gbps", "-5"],
     "--intra-gbps=-5 must be a positive bandwidth"),
    (["--model", "gpt-tiny", "--from", "dp=2"], "--to missing"),
])
def test_bad_input_is_one_line_and_exit_2(args, fragment):
    out = run("plan", *args)
    assert out.returncode == 2
    assert fragment in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_models_lists_every_preset():
    out = run("models", "--json")
    names = {m["name"] for m in json.loads(out.stdout)["models"]}
    assert {"gpt-tiny", "moe-tiny", "gpt-125m", "gpt-350m", "llama-7b", "llama-13b",
            "llama-70b", "mixtral-8x7b", "qwen3-235b-a22b"} == names


def test_model_spec_file_on_the_command_line(tmp_path):
    spec = tmp_path / "mine.yaml"
    spec.write_text("arch: llama\nvocab_size: 256\nhidden_size: 64\nnum_layers: 3\n"
                    "num_heads: 4\nffn_hidden_size: 128\n")
    out = run("plan", "--model", str(spec), "--from", "pp=3", "--to", "tp=2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"] == "mine"


def test_run_refuses_a_suspended_job_saying_how_to_run_it(tmp_path):
    import yaml

    doc = yaml.safe_load((Path(__file__).parents[1] / "examples" / "quickstart.yaml")
                         .read_text())
    doc["spec"]["suspend"] = True
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    out = run("run", str(job))
    assert out.returncode == 2, out.stderr
    assert "spec.suspend is true" in out.stderr and "--resume-from" in out.stderr
    assert "Traceback" not in out.stderr

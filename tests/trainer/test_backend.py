"""``--backend auto|nccl|gloo``: which backend and device a worker trains on, and the refusals.

Everything here runs on a machine without CUDA (CUDA is hidden where there is one): a GPU
asked for where ``torch.cuda.is_available()`` is False stops the worker, ``dynatrain run`` and
``dynatrain bench switch`` at start with one line and exit code 2, never a silent fall-back;
the dev cluster's pod runner runs GPU pods' workers on the CPU only when told to.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dynatrain.trainer import backend as b

ROOT = Path(__file__).resolve().parents[2]


def _job(tmp_path, gpus: int, name: str = "job") -> str:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["resources"]["gpus"] = gpus
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.fixture
def no_cuda(monkeypatch):
    """This process sees no CUDA, whatever the machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


# -- the rules ----------------------------------------------------------------------------------
def test_auto_follows_the_jobs_gpus():
    assert b.job_backend("auto", 0) == "gloo"
    assert b.job_backend("auto", 1) == "nccl"
    assert b.job_backend("gloo", 1) == "gloo"          # a GPU job on the CPU, asked for
    assert b.job_backend("nccl", 1) == "nccl"


def test_nccl_for_a_cpu_job_names_the_values():
    with pytest.raises(b.BackendError) as e:
        b.job_backend("nccl", 0)
    assert "--backend nccl" in str(e.value) and "spec.resources.gpus: 0" in str(e.value)
    assert "\n" not in str(e.value)


def test_no_cuda_is_refused_with_what_to_do(no_cuda):
    with pytest.raises(b.BackendError) as e:
        b.torch_device("nccl", 0, asked=b.asked_for("auto", 1))
    msg = str(e.value)
    assert "--backend auto with spec.resources.gpus: 1" in msg
    assert "torch.cuda.is_available() is False" in msg and "--backend gloo" in msg
    assert "\n" not in msg
    assert b.torch_device("gloo") == torch.device("cpu")


def test_bench_auto_picks_gloo_without_enough_gpus(no_cuda):
    assert b.bench_backend("auto", 2) == "gloo"
    with pytest.raises(b.BackendError, match="torch.cuda.is_available\\(\\) is False"):
        b.bench_backend("nccl", 2)
    assert b.bench_backend("nccl-sim", 4) == "nccl-sim"        # the CPU, NCCL's semantics


def test_which_gpu():
    assert b.cuda_index(None, {}) == 0                      # cuda:0 of what the pod sees
    assert b.cuda_index(None, {"LOCAL_RANK": "3"}) == 3
    assert b.cuda_index(1, {"LOCAL_RANK": "3"}) == 1        # --cuda-device wins
    with pytest.raises(b.BackendError, match="LOCAL_RANK"):
        b.cuda_index(None, {"LOCAL_RANK": "x"})
    # The local runner's worker i sees one GPU: the i-th of ours.
    assert b.visible_gpu(2, {}) == "2"
    assert b.visible_gpu(1, {"CUDA_VISIBLE_DEVICES": "4,6"}) == "6"


# -- the commands -------------------------------------------------------------------------------
def _one_error_line(err: str, prog: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"dynatrain {prog}: error: "), err
    return lines[0]


def test_worker_asked_for_a_gpu_without_cuda_exits_2(tmp_path, no_cuda, capsys):
    from dynatrain.agent.worker import main

    job = _job(tmp_path, gpus=1)
    assert main(["--job", job, "--device", "0", "--insecure"]) == 2     # auto
    line = _one_error_line(capsys.readouterr().err, "worker")
    assert "spec.resources.gpus: 1" in line and "CUDA is unavailable" in line
    assert main(["--job", job, "--device", "0", "--insecure", "--backend", "nccl"]) == 2
    assert "--backend nccl" in _one_error_line(capsys.readouterr().err, "worker")


def test_worker_nccl_for_a_cpu_job_exits_2(tmp_path, capsys):
    from dynatrain.agent.worker import main

    assert main(["--job", _job(tmp_path, gpus=0), "--device", "0", "--backend", "nccl"]) == 2
    assert "spec.resources.gpus: 0" in _one_error_line(capsys.readouterr().err, "worker")


def test_worker_process_stops_at_start(tmp_path):
    """The real process, as a pod runs it: CUDA hidden, one line on stderr, exit code 2."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "dynatrain", "worker", "--job",
                          _job(tmp_path, gpus=1), "--device", "0", "--insecure"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "torch.cuda.is_available() is False" in _one_error_line(out.stderr, "worker")


def test_run_refuses_gpus_without_cuda(tmp_path, no_cuda, capsys):
    from dynatrain.cli.app import main

    assert main(["run", _job(tmp_path, gpus=1), "--run-dir", str(tmp_path / "r")]) == 2
    line = _one_error_line(capsys.readouterr().err, "run")
    assert "CUDA is unavailable" in line and "spec.resources.gpus: 0" in line
    assert main(["run", _job(tmp_path, gpus=0), "--backend", "nccl"]) == 2
    assert "spec.resources.gpus: 0" in _one_error_line(capsys.readouterr().err, "run")
    assert not (tmp_path / "r").exists()                # refused before anything started


def test_bench_switch_refuses_nccl_without_cuda(no_cuda, capsys):
    from dynatrain.cli.app import main

    assert main(["bench", "switch", "--model", "gpt-tiny", "--from", "dp=2", "--to", "tp=2",
                 "--backend", "nccl"]) == 2
    assert "--backend nccl" in _one_error_line(capsys.readouterr().err, "bench")


def test_local_runner_passes_the_backend(tmp_path, monkeypatch):
    """``dynatrain run`` hands every worker its --backend; a GPU worker gets one GPU of its
    own through CUDA_VISIBLE_DEVICES (no process is started here)."""
    from dynatrain.controller import local
    from dynatrain.spec.hardware import PROFILES
    from dynatrain.spec.job import load_job
    from dynatrain.controller.scenario import Scenario

    started = []

    class FakeWorker:
        def poll(self):
            return None

    def fake_start(argv, env, log, method):
        started.append((argv, env))
        return FakeWorker()

    monkeypatch.setattr(local, "start_worker", fake_start)
    path = _job(tmp_path, gpus=1)
    runner = local.LocalRunner(load_job(path), path, Scenario(None, ()), run_dir=tmp_path / "r",
                               profile=PROFILES["cpu"], backend="nccl")
    runner._spawn(2, wait=False)
    del runner.workers[0]                              # device 0 is gone: its GPU is free
    runner._spawn(1, wait=False)
    cmds = [c for c, _ in started]
    assert all(c[c.index("--backend") + 1] == "nccl" for c in cmds)
    assert [e["CUDA_VISIBLE_DEVICES"] for _, e in started] == ["0", "1", "0"]


# -- the dev cluster and the operator --------------------------------------------------------
def _pod(gpus: int, command: list[str]):
    from kubernetes import client

    res = client.V1ResourceRequirements(limits={"nvidia.com/gpu": str(gpus)} if gpus else None)
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name="p", namespace="ns", uid="u"),
        spec=client.V1PodSpec(node_name="gpu-node-0", containers=[client.V1Container(
            name="worker", command=command, args=["--device", "0"], resources=res)]),
        status=client.V1PodStatus(pod_ip="127.20.0.5"))


@pytest.mark.parametrize("cpu_for_gpu_pods, gpus, command, rewritten", [
    (True, 1, ["dynatrain", "worker"], True),
    (True, 0, ["dynatrain", "worker"], False),          # a CPU pod: nothing to change
    (True, 1, ["sleep", "60"], False),                   # not a DynaTrain worker
    (False, 1, ["dynatrain", "worker"], False),          # not asked: auto, and it stops
])
def test_pod_runner_runs_gpu_workers_on_cpu_only_when_told(tmp_path, cpu_for_gpu_pods, gpus,
                                                           command, rewritten):
    pytest.importorskip("kubernetes")
    from dynatrain.devcluster.pods import PodRunner

    runner = PodRunner(None, tmp_path, cpu_for_gpu_pods=cpu_for_gpu_pods)
    argv = runner._prepare(_pod(gpus, command)).argv
    assert (argv[-4:] == ["--backend", "gloo", "--threads", "1"]) == rewritten, argv
    # The step floor comes only with the CPU stand-in, and only when set.
    floored = PodRunner(None, tmp_path, cpu_for_gpu_pods=cpu_for_gpu_pods, cpu_step_floor_s=0.2)
    argv = floored._prepare(_pod(gpus, command)).argv
    assert (argv[-2:] == ["--min-step-seconds", "0.2"]) == rewritten, argv


def test_operator_asks_for_auto():
    from dynatrain.operator import cluster as k

    body = {"apiVersion": "dynatrain.io/v1alpha1", "kind": "DynaTrainJob",
            "metadata": {"name": "job", "namespace": "ns", "uid": "u-1"},
            "spec": {"image": "img:1", "resources": {"gpus": 1}, "args": ["--backend", "gloo"]}}
    args = k.worker_pod(body, 0, secret="tok", agent_port=50051)["spec"]["containers"][0]["args"]
    assert args[args.index("--backend") + 1] == "auto"
    assert args[-2:] == ["--backend", "gloo"]            # spec.args come last and win


def test_dev_cluster_gpu_pods_on_cpu_needs_run_pods(capsys):
    from dynatrain.cli.app import main

    assert main(["dev", "cluster", "--gpu-pods-on-cpu", "--kubeconfig", "/dev/null"]) == 2

"""The slim operator image: what it installs, and that the operator runs with only that.

The Dockerfile's ``operator`` target installs operator/requirements.txt and the project's wheel
``--no-deps``; ``make operator-env`` makes the same environment in ``.venv-operator``, from which
the operator tests (tests/harness/operator_process.py) run ``dynatrain operator``. Here: the
requirements are pyproject's own specifiers and name no torch; the environment really has no
torch, and the operator's modules import and its command line answers there; the Dockerfile's
stage installs exactly that file, ``--no-deps``, and the chart runs that image.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "operator" / "requirements.txt"
ENV_PYTHON = ROOT / ".venv-operator" / "bin" / "python"


def _requirements() -> list[str]:
    return [line.strip() for line in REQUIREMENTS.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _name(spec: str) -> str:
    return re.split(r"[<>=!~ \[]", spec, maxsplit=1)[0].lower()


def test_the_requirements_are_pyprojects_own_specifiers_without_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(d): d for d in project["dependencies"]}
    wanted = _requirements()
    assert wanted, REQUIREMENTS
    for spec in wanted:
        assert _name(spec) in declared, f"{spec}: not a dependency in pyproject.toml"
        assert spec == declared[_name(spec)], f"{spec} != pyproject's {declared[_name(spec)]}"
    names = {_name(s) for s in wanted}
    assert not names & {"torch", "numpy", "safetensors", "tokenizers", "pyarrow", "datasets",
                        "matplotlib", "tensorboard"}, names
    assert {"kopf", "kubernetes", "grpcio", "protobuf"} <= names


@pytest.fixture(scope="module")
def env_python() -> str:
    if not ENV_PYTHON.is_file():
        pytest.fail(f"{ENV_PYTHON} is missing: build it with `make operator-env` "
                    "(`make test` does)")
    return str(ENV_PYTHON)


def _run(python: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def test_the_operator_environment_has_no_torch_and_runs_the_operator(env_python):
    no_torch = _run(env_python, "-c", "import torch")
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    # the project is the working tree's (an editable install), not a stale copy
    where = _run(env_python, "-c", "import dynatrain.controller.rendezvous as r; print(r.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()) == ROOT / "dynatrain" / "controller" / "rendezvous.py"
    imports = _run(env_python, "-c", "import dynatrain.operator.handlers, "
                   "dynatrain.operator.runtime, dynatrain.controller.rendezvous")
    assert imports.returncode == 0, imports.stderr[-3000:]
    help_text = _run(env_python, "-m", "dynatrain", "operator", "--help")
    assert help_text.returncode == 0, help_text.stderr[-3000:]
    assert "--rendezvous-host" in help_text.stdout


def test_the_dockerfile_operator_stage_installs_only_that_and_the_chart_runs_it():
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)
    operator = next(s for s in stages if s.split("\n", 1)[0].endswith(" AS operator"))
    assert "-r /tmp/operator-requirements.txt" in operator
    assert "COPY operator/requirements.txt /tmp/operator-requirements.txt" in operator
    installs = re.findall(r"pip install[^\n&]*", operator)
    assert installs and all("-r /tmp/operator-requirements.txt" in i or "--no-deps" in i
                            for i in installs), installs
    # the workers' image stays the default target (the last stage), with every dependency
    assert stages[-1].split("\n", 1)[0].endswith(" AS worker")
    assert "--no-deps" not in stages[-1]
    values = yaml.safe_load((ROOT / "charts" / "dynatrain" / "values.yaml").read_text())
    assert values["image"]["repository"] == "dynatrain-operator"

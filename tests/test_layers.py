"""DESIGN.md's layers as import-linter contracts (pyproject.toml ``[tool.importlinter]``).

import-linter's graph (grimp) walks the root package's directory, but this repository maps
``vps/``, ``agent/`` and ``operator/`` into ``dynatrain`` through setuptools' package-dir
table. So the test lays the same source files out as the one tree Python sees when installed
(copies, not imports: nothing is executed) and runs ``lint-imports`` over it. The contracts'
``ignore_imports`` are today's known violations (#32 removes them); a new one fails here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_imports import ROOT, module_files, package_dirs

LINT = Path(sys.executable).with_name("lint-imports")


def _tree(dest: Path) -> Path:
    """The installed ``dynatrain`` package laid out under ``dest``; returns ``dest``."""
    for module, path in module_files(package_dirs()).items():
        parts = module.split(".")
        out = dest.joinpath(*parts).with_suffix(".py") if path.name != "__init__.py" \
            else dest.joinpath(*parts, "__init__.py")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, out)
    for d in dest.rglob("*"):                  # a namespace directory still needs an __init__
        if d.is_dir() and not (d / "__init__.py").exists():
            (d / "__init__.py").write_text("")
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "pyproject.toml"], cwd=tree, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tree)})


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return _tree(tmp_path_factory.mktemp("layers"))


def test_the_layer_contracts_hold(tree):
    out = _lint(tree)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "5 kept, 0 broken" in out.stdout, out.stdout[-2000:]


@pytest.mark.parametrize("module, line, contract", [
    ("vps/layout.py", "import torch", "vps planning imports no torch"),
    ("agent/client.py", "import dynatrain.operator.runtime", "cli > operator"),
    ("vps/mapping.py", "from dynatrain.trainer import trainer", "cli > operator"),
    ("controller/core.py", "import dynatrain.devcluster.cluster", "the dev cluster is a tool"),
    ("controller/policy.py", "import grpc", "the decisions"),
    ("controller/decide.py", "from dynatrain.agent import client", "the decisions"),
    # the job spec sits below the agent and the controller, which both read it
    ("spec/job.py", "from dynatrain.controller import core", "cli > operator"),
    ("vps/stagecost.py", "import torch", "vps planning imports no torch"),
])
def test_a_new_violation_breaks_its_contract(tmp_path, module, line, contract):
    tree = _tree(tmp_path)
    path = tree / "dynatrain" / module
    path.write_text(path.read_text() + f"\n{line}  # added by the test\n")
    out = _lint(tree)
    assert out.returncode == 1, out.stdout[-3000:]
    summary, _, broken = out.stdout.partition("Broken contracts")
    assert " 0 broken" not in summary, out.stdout[-3000:]
    assert contract in broken and line.split()[-1] in broken, out.stdout[-3000:]

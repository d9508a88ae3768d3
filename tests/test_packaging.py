"""The repository layout our users asked for must not break imports."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_top_level_operator_folder_does_not_shadow_the_standard_library():
    code = "import operator, dynatrain.operator as o; print(operator.__file__); print(o.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    stdlib, ours = out.stdout.split()
    assert not stdlib.startswith(str(ROOT)), stdlib
    assert ours == str(ROOT / "operator" / "__init__.py")


def test_layers_import_under_one_namespace():
    import dynatrain.agent
    import dynatrain.vps

    assert Path(dynatrain.vps.__file__).parent == ROOT / "vps"
    assert Path(dynatrain.agent.__file__).parent == ROOT / "agent"


def test_planning_code_imports_no_torch():
    code = ("import sys, dynatrain.vps.planner, dynatrain.vps.placement, dynatrain.vps.stats, "
            "dynatrain.vps.verify, dynatrain.cli; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr

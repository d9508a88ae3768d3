"""The test harness's process settings (tests/conftest.py) reach the processes tests start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(os.environ.get("OMP_WAIT_POLICY", "PASSIVE") != "PASSIVE",
                    reason="OMP_WAIT_POLICY is set in this shell: the harness keeps it")
def test_openmp_threads_sleep_at_barriers_in_every_process_a_test_starts():
    # A rank with two torch threads on the oversubscribed test machine spins at each barrier
    # unless OpenMP's wait policy is passive (conftest.py says how much that cost).
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['OMP_WAIT_POLICY'])"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"

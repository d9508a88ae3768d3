"""tools/cpu-by-process: the machine's CPU while a command runs, by kind of process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "cpu-by-process"

# One second of CPU in a child, then half a second asleep, so the last samples see it all.
BUSY = ("import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\n"
        "time.sleep(0.5)\nraise SystemExit(3)")


def test_a_childs_cpu_is_counted_under_its_kind_and_its_exit_code_is_returned():
    out = subprocess.run([sys.executable, str(TOOL), "--interval", "0.2", "--",
                          sys.executable, "-c", BUSY], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 3, out.stderr
    rows = {line.split("core-s", 1)[1].strip(): float(line.split()[1])
            for line in out.stderr.splitlines() if line.startswith("[cpu] ") and "core-s  " in line}
    assert 0.8 <= rows["python -c"] <= 1.6, out.stderr
    head = out.stderr.splitlines()[0]
    assert head.startswith("[cpu] ") and ": exit 3, " in head, head


def test_bad_usage_is_named():
    none = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True)
    assert none.returncode == 2 and "no command given" in none.stderr
    missing = subprocess.run([sys.executable, str(TOOL), "--", "/nonexistent/cmd"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "command not found: /nonexistent/cmd" in missing.stderr
    bad = subprocess.run([sys.executable, str(TOOL), "--interval", "0", "--", "true"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--interval 0.0 is not seconds from 0.1 to 60" in bad.stderr

"""tools/cpu-by-process: the machine's CPU while a command runs, by kind of process."""

from __future__ import annotations

import os
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


def test_processes_that_live_between_two_samples_are_counted_through_their_parent(tmp_path):
    # Eight children of 0.15 s of CPU each, every one born and gone between two samples (as a
    # compiler run of `go build` is): their parent's reaped time carries them.
    burn = ("import time\nend = time.process_time() + 0.15\n"
            "while time.process_time() < end: pass")
    loop = f"for i in 1 2 3 4 5 6 7 8; do {sys.executable} -c '{burn}'; done; sleep 2.5"
    timeline = tmp_path / "busy.csv"
    out = subprocess.run([sys.executable, str(TOOL), "--interval", "2", "--timeline",
                          str(timeline), "--", "sh", "-c", loop],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = timeline.read_text().splitlines()
    assert lines[0] == "seconds,busy_cores" and len(lines) >= 2, lines
    first = [float(x) for x in lines[1].split(",")]
    assert 1.5 <= first[0] <= 3.5 and 0.3 <= first[1] <= os.cpu_count() + 0.1, lines
    rows = {line.split("core-s", 1)[1].strip(): float(line.split()[1])
            for line in out.stderr.splitlines() if line.startswith("[cpu] ") and "core-s  " in line}
    children = sum(v for k, v in rows.items() if k.endswith("(children)"))
    assert 1.1 <= children + rows.get("python -c", 0) <= 3.0, out.stderr
    assert children >= 0.6, out.stderr

"""tools/gpu_check.sh stops a step at its time bound with every process the step started, also those in a
session of their own (as torchrun starts its ranks): on a GPU machine a survivor would hold the GPU that the
next step needs, and a session's device time is 15 minutes. Run for real with a stand-in python that starts
such processes and never returns; no GPU, no package imported."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAND_IN = """#!/usr/bin/env bash
case "$2" in "import "*) exit 1 ;; esac  # gpu_check's "has PACKAGE": nothing is installed
setsid sleep 300 & echo $! >>"$PIDS"     # a process in its own session, as torchrun's ranks
sleep 300 & echo $! >>"$PIDS"
wait
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_a_step_past_its_bound_is_stopped_with_every_process_it_started(tmp_path):
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    pids = tmp_path / "pids"
    env = {**os.environ, "PYTHON": str(python), "PIDS": str(pids), "STEPS": "env", "STEP_LIMIT": "2"}
    start = time.monotonic()
    done = subprocess.run(
        ["bash", "tools/gpu_check.sh", str(tmp_path / "out")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - start
    assert "TIMEOUT env (stopped at 2 s" in done.stdout, done.stdout + done.stderr
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 2
    time.sleep(0.5)
    assert not [pid for pid in started if alive(pid)], "a process of the stopped step outlived it"
    assert took < 30, f"the step was not stopped at its bound ({took:.0f} s)"
    assert (tmp_path / "out" / "env.txt").exists()

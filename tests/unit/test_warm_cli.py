"""The tests' warm runner (tests/warm_cli.py) on a GPU machine: no fork (CUDA refuses a forked child), each run a
fresh interpreter with the same argv, environment, working directory and result."""

from __future__ import annotations

import signal
import sys

from tests import warm_cli


def test_on_a_gpu_machine_runs_are_fresh_processes_with_the_same_result(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_cli, "forking_is_unsafe", lambda: True)
    script = tmp_path / "probe.py"
    script.write_text("import os, sys\nprint(sys.argv[1:], os.environ['PROBE'], os.getcwd())\nsys.exit(3)\n")
    monkeypatch.setattr(warm_cli, "WarmCli", None)  # any use of a warm server fails the test
    proc = warm_cli.run_warm(["a", 1], {"PROBE": "yes", "PATH": "/usr/bin:/bin"}, 60, script=script, cwd=tmp_path)
    assert proc.returncode == 3
    assert proc.stdout.strip() == f"['a', '1'] yes {tmp_path}"
    assert proc.args[:2] == [sys.executable, str(script)]


def test_on_a_gpu_machine_a_started_run_can_be_signalled_and_waited_for(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_cli, "forking_is_unsafe", lambda: True)
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    proc = warm_cli.start_warm([], {"PATH": "/usr/bin:/bin"}, 60, script=script, cwd=tmp_path)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM

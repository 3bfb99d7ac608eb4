"""SIGINT and SIGTERM end a run with one line and exit codes 130 / 143, no traceback, and no process of the run
survives them; after a SIGKILL of the run none survives either (workers get the parent-death signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO


def start(run_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dapo_mcore.cli", "train", "examples/smoke_cpu.yaml", "trainer.steps=500",
           "rollout.prompts_per_step=4", "rollout.gen_prompts_per_round=4", "trainer.mini_batch_size=16",
           "trainer.micro_batch_size=16", "checkpoint.save_interval=1", "logging.wandb.mode=disabled",
           "logging.progress=false", f"logging.run_dir={run_dir}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_training(proc: subprocess.Popen, run_dir: Path, rows: int = 2) -> list[psutil.Process]:
    """Once `rows` steps are logged (a save has run), the run's process tree."""
    deadline = time.time() + 180
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    return psutil.Process(proc.pid).children(recursive=True)


def gone(processes: list[psutil.Process], within_s: float = 15.0) -> list[psutil.Process]:
    """The processes still alive after `within_s` seconds."""
    _, alive = psutil.wait_procs(processes, timeout=within_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize(("sig", "code", "name"), [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_signal_ends_the_run_with_one_line_its_exit_code_and_no_child_left(tmp_path, sig, code, name):
    proc = start(tmp_path / "run")
    children = wait_for_training(proc, tmp_path / "run")
    assert children, "the run should have worker processes (verifier workers at least)"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"dapo-mcore: stopped by {name}; every complete save is kept")
    assert gone(children) == []
    assert not (tmp_path / ".run.lock").exists()  # the run-directory lock was released


def test_after_a_sigkill_no_process_of_the_run_is_left(tmp_path):
    proc = start(tmp_path / "run")
    children = wait_for_training(proc, tmp_path / "run")  # verifier workers, the checkpoint writer's manager, ...
    assert children
    proc.kill()
    proc.wait()
    assert gone(children) == []

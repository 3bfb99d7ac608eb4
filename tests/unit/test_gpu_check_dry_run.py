"""tools/gpu_check.sh's dry run (DRY_RUN=1): on this CPU machine, every step's commands are checked without a
GPU and without training (a DAPO run's config and overrides as `dapo-mcore check` reads them, a tool's command
line by its own parser, the plans run), so that the 15 minutes of a lent GPU are not spent on a typo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIRST = ["stack", "shape-7b", "moe-vllm", "offload-resume", "sleep2", "fp8"]  # the six, most valuable first
CPU_ADAM = "tools/bench_cpu_adam.py"


def dry_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "tools/gpu_check.sh", str(tmp_path / "out")],
        cwd=REPO,
        env={**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path), "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_dry_run_checks_every_step_in_order_and_passes(tmp_path):
    done = dry_run(tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("dry-run ")]
    names = [line.split()[2].rstrip(":") for line in lines]
    assert names[: len(FIRST)] == FIRST, done.stdout + done.stderr
    assert len(names) > len(FIRST)  # the benchmarks after them are checked too
    failed = [line for line in lines if not line.startswith("dry-run ok ")]
    if not (REPO / CPU_ADAM).exists():  # being written beside this: its absence is the one failure allowed
        assert failed == [f"dry-run FAILED offload-resume: missing: {CPU_ADAM}"], done.stdout
        assert done.returncode == 1
        return
    assert not failed and done.returncode == 0, done.stdout + done.stderr
    # the plans ran (arithmetic), beside where the runs' metrics will be
    assert "fits: peak" in (tmp_path / "out" / "stack.plan.txt").read_text()
    assert "fits: peak" in (tmp_path / "out" / "shape-7b.plan.txt").read_text()


def test_a_misspelt_override_fails_the_dry_run_of_its_step(tmp_path):
    done = dry_run(tmp_path, STEPS="moe-vllm", EXTRA_OVERRIDES="trainer.stepz=5")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "dry-run FAILED moe-vllm: " in done.stdout
    assert "unknown config key 'trainer.stepz'" in done.stdout and "trainer.steps" in done.stdout


def test_a_misspelt_step_name_is_refused_before_anything_runs(tmp_path):
    done = dry_run(tmp_path, STEPS="stack sleep-2")
    assert done.returncode == 2
    assert "no step 'sleep-2'" in done.stderr
    assert not (tmp_path / "out" / "stack.txt").exists()

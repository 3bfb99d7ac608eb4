"""The private Slurm cluster runs a batch job whose srun starts 2 tasks."""

from __future__ import annotations

from pathlib import Path

SCRIPT = """#!/bin/bash
srun --ntasks=2 bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS"'
"""


def test_batch_job_with_two_srun_tasks(slurm_cluster, tmp_path):
    out = tmp_path / "job.out"
    job_id = slurm_cluster.submit(SCRIPT, sbatch_options=["--ntasks=2", f"--output={out}", "--time=2"])
    record = slurm_cluster.wait(job_id, timeout=120)
    text = out.read_text()
    assert record["JobState"] == "COMPLETED", f"{record}\n{text}"
    assert record["ExitCode"] == "0:0"
    assert record["Restarts"] == "0"
    assert Path(record["StdOut"]) == out
    assert sorted(line for line in text.splitlines() if line.startswith("task ")) == ["task 0 of 2", "task 1 of 2"]

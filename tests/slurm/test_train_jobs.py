"""slurm/train.sbatch on a real Slurm (a private one-node cluster, tests/slurm/cluster.py): scancel saves at the
step boundary; and the job re-queues when srun ends a task still closing down after the save (a stand-in task,
seconds). Whole jobs, the time limit (Slurm's warning, and the run's own stop when the warning comes too late)
and a node that dies run on a cluster of several nodes: tests/slurm/test_multinode.py."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from dapo_mcore.checkpoint.model_checkpoint import verify_complete
from tests.conftest import REPO, free_port
from tests.dist.test_dead_rank import assert_rank_1_named_once
from tests.slurm.jobs import (
    CPU_NODE,
    job_output,
    rows,
    submit,
)


def test_scancel_mid_run_saves_at_the_step_boundary(slurm_cluster, tmp_path):
    job_id, run_dir = submit(slurm_cluster, tmp_path, "cancelled")
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and slurm_cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING")
        time.sleep(0.2)
    slurm_cluster.run("scancel", str(job_id))  # SIGTERM to every process of the job, SIGKILL 30 s later
    record = slurm_cluster.wait(job_id, timeout=120)
    assert record["JobState"] == "CANCELLED"
    task0 = next((tmp_path / "logs").glob("cancelled-*/attempt-0-task-0.log")).read_text()
    stopped = re.search(r"stopped by SIGTERM after step (\d+); saved to (\S+);", task0)
    assert stopped, task0[-3000:]
    next_step, save = int(stopped.group(1)), Path(stopped.group(2))
    assert save.name == f"step_{next_step:06d}" and len(rows(run_dir)) == next_step
    verify_complete(save, checksums=True)


def test_a_task_killed_under_srun_is_named_once_by_a_survivor(slurm_cluster, tmp_path):
    """srun's side of tests/dist/test_dead_rank.py: rank 1 SIGKILLs itself in step 2 (the out-of-memory killer's
    way); rank 0's process serves the store there, and the survivor names rank 1 once for the job."""
    killing = ["algorithm.dynamic_sampling.filter=tests.verifiers:kill_rank_1_in_step_2", "trainer.steps=4"]
    job_id, _ = submit(slurm_cluster, tmp_path, "killed", overrides=killing)
    record = slurm_cluster.wait(job_id, timeout=300)
    out = job_output(tmp_path, "killed", job_id)
    logs = "".join(path.read_text() for path in sorted((tmp_path / "logs").glob("killed-*/attempt-0-task-*.log")))
    assert record["JobState"] == "FAILED", f"{record}\n{out}\n{logs[-4000:]}"
    assert_rank_1_named_once(logs)
    assert "Traceback" not in logs, logs[-4000:]


# Stands in for `python -m dapo_mcore.cli train` (train.sbatch runs `$DAPO_PYTHON -m ...`). Attempt 0 waits for
# the stop file; rank 0 marks the save complete (as the trainer does) and is still closing down when rank 1
# exits 75, so `srun --kill-on-bad-exit` ends rank 0 and reports 143 (the order a CI run met by chance).
# Later attempts end at once with 0.
SLOW_TO_CLOSE_TASK = """#!{python}
import os, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from dapo_mcore.launch import SAVED_STOP_SUFFIX, StoppedToResume, mark_saved_stop
if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
    sys.exit(0)
stop_file = Path(os.environ["DAPO_STOP_FILE"])
(stop_file.parent / ("started-" + os.environ["SLURM_PROCID"])).touch()
while not stop_file.exists():
    time.sleep(0.05)
if os.environ["SLURM_PROCID"] == "0":
    mark_saved_stop(StoppedToResume("Slurm's time-limit warning", 7, Path("step_000007")))
    time.sleep(120)
while not Path(str(stop_file) + SAVED_STOP_SUFFIX).exists():
    time.sleep(0.05)
sys.exit(75)
"""


def test_the_job_requeues_when_srun_ends_a_task_still_closing_after_the_save(slurm_cluster, tmp_path):
    task = tmp_path / "task"
    task.write_text(SLOW_TO_CLOSE_TASK.format(python=sys.executable, repo=str(REPO)))
    task.chmod(0o755)
    env = {"DAPO_PYTHON": str(task), "DAPO_LOG_DIR": str(tmp_path / "logs"), "MASTER_PORT": str(free_port())}
    job_id = slurm_cluster.submit(
        REPO / "slurm/train.sbatch", "examples/smoke_cpu.yaml", env=env, cwd=REPO,
        sbatch_options=[*CPU_NODE, "--job-name=closing", f"--output={tmp_path}/closing-%j.out"],
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while len(list((tmp_path / "logs").glob("closing-*/started-*"))) < 2:
        assert time.monotonic() < deadline, slurm_cluster.job(job_id)
        time.sleep(0.1)
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", str(job_id))  # as Slurm's --signal=B:USR1@N
    record = slurm_cluster.wait(job_id, timeout=180)
    out = job_output(tmp_path, "closing", job_id)
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", f"{record}\n{out}"
    assert "srun ended with 143 after the save: stopped by Slurm's time-limit warning after step 7" in out, out
    assert "saved before the time limit: re-queueing" in out


# Stands in for apptainer (none here): `apptainer exec --nv --bind MOUNTS --pwd DIR IMAGE COMMAND...` says how it
# was called and runs COMMAND, as the image's shell would. The task (DAPO_PYTHON) says what it was given.
FAKE_APPTAINER = """#!/bin/bash
echo "apptainer $*"
[ "$1" = exec ] || exit 90
while [ "$1" != "$APPTAINER_IMAGE" ]; do shift; done
shift
exec "$@"
"""
SAYING_TASK = '#!/bin/sh\necho "the task ran: $*"\n'


def test_apptainer_image_runs_each_task_through_apptainer_exec(slurm_cluster, tmp_path):
    """The container option on a real srun (tests/unit/test_train_sbatch.py checks pyxis's line): each task's
    shell runs inside `apptainer exec --nv` with the repository and the logs mounted, and names its CPUs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("apptainer", FAKE_APPTAINER), ("task", SAYING_TASK)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    logs = tmp_path / "logs"
    env = {"DAPO_PYTHON": str(bin_dir / "task"), "DAPO_LOG_DIR": str(logs), "MASTER_PORT": str(free_port()),
           "APPTAINER_IMAGE": str(tmp_path / "dapo.sif"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}  # fmt: skip
    job_id = slurm_cluster.submit(
        REPO / "slurm/train.sbatch", "examples/smoke_cpu.yaml", env=env, cwd=REPO,
        sbatch_options=[*CPU_NODE, "--job-name=apptainer", f"--output={tmp_path}/apptainer-%j.out"],
    )  # fmt: skip
    record = slurm_cluster.wait(job_id, timeout=180)
    out = job_output(tmp_path, "apptainer", job_id)
    assert record["JobState"] == "COMPLETED", f"{record}\n{out}"
    for rank in (0, 1):
        log = next(logs.glob(f"apptainer-*/attempt-0-task-{rank}.log")).read_text()
        called = f"apptainer exec --nv --bind {REPO}:{REPO},{logs}:{logs} --pwd {REPO} {tmp_path / 'dapo.sif'} bash -c"
        assert log.startswith(called), log
        assert re.search(rf"task {rank} of 2 on \S+ \(.*; \d+ CPUs? \(\S+\) for --cpus-per-task=1\)", log), log
        assert "the task ran: -m dapo_mcore.cli train examples/smoke_cpu.yaml checkpoint.resume=auto" in log, log

"""slurm/train.sbatch's srun line, as DAPO_DRY_RUN=1 prints it (no Slurm needed: the job's variables are set here and
a stand-in `scontrol` names the first node): each task gets the job's --cpus-per-task (Slurm 22.05's srun no longer
takes it from the job), and a container runs the tasks when asked, through pyxis or apptainer. The same script runs
jobs on a real Slurm in tests/slurm/ (apptainer through a stand-in there: neither runtime exists here)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "slurm/train.sbatch"


@pytest.fixture
def dry_run(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")  # `scontrol show hostnames` of the node list
    (bin_dir / "scontrol").chmod(0o755)

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        job = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_NODELIST": "node[1-2]",
               "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "dapo", "SLURM_NTASKS": "16", "SLURM_CPUS_PER_TASK": "8",
               "DAPO_LOG_DIR": str(tmp_path / "logs"), "DAPO_DRY_RUN": "1", **env}  # fmt: skip
        return subprocess.run(["bash", str(SCRIPT), *args], env=job, capture_output=True, text=True, timeout=30)

    return run


def srun_line(done: subprocess.CompletedProcess) -> tuple[dict[str, str], list[str]]:
    """The variables and the argv of the printed line."""
    assert done.returncode == 0, done.stderr
    words = shlex.split(done.stdout.strip().splitlines()[-1])
    env = dict(word.split("=", 1) for word in words[: words.index("srun")])
    return env, words[words.index("srun") :]


def test_srun_is_told_the_jobs_cpus_per_task_and_runs_the_config_with_resume(dry_run, tmp_path):
    env, argv = srun_line(dry_run("examples/smoke_cpu.yaml", "trainer.steps=3"))
    assert env == {"SRUN_CPUS_PER_TASK": "8"}
    output = f"--output={tmp_path}/logs/dapo-7/attempt-0-task-%t.log"
    assert argv == ["srun", "--kill-on-bad-exit=1", output, "bash", "-c", "TASK", "_", "examples/smoke_cpu.yaml",
                    "checkpoint.resume=auto", "trainer.steps=3"]  # fmt: skip
    assert not (tmp_path / "logs").exists()  # a dry run makes nothing
    env, _ = srun_line(dry_run("examples/smoke_cpu.yaml", SRUN_CPUS_PER_TASK="4"))  # a value of one's own wins
    assert env == {"SRUN_CPUS_PER_TASK": "4"}


def test_the_script_asks_each_node_for_its_memory_and_each_task_for_cpus():
    options = re.findall(r"^#SBATCH (\S+)", SCRIPT.read_text(), re.M)
    assert "--mem=0" in options and "--cpus-per-task=8" in options  # the node's whole memory; see `dapo-mcore plan`


def test_container_image_runs_each_task_in_it_through_pyxis_with_the_repository_and_logs_mounted(dry_run, tmp_path):
    logs = tmp_path / "logs"
    _, argv = srun_line(dry_run("examples/smoke_cpu.yaml", CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:25.01-py3",
                                CONTAINER_MOUNTS="/data:/data,/ckpt:/ckpt"))  # fmt: skip
    mounts = f"{REPO}:{REPO},{logs}:{logs},/data:/data,/ckpt:/ckpt"
    assert argv[2:6] == [f"--output={logs}/dapo-7/attempt-0-task-%t.log",
                         "--container-image=nvcr.io#nvidia/pytorch:25.01-py3", f"--container-mounts={mounts}",
                         f"--container-workdir={REPO}"]  # fmt: skip
    assert argv[6:9] == ["bash", "-c", "TASK"]


def test_apptainer_image_runs_each_task_through_apptainer_exec_with_the_gpus(dry_run, tmp_path):
    logs = tmp_path / "logs"
    _, argv = srun_line(dry_run("examples/smoke_cpu.yaml", APPTAINER_IMAGE="/images/dapo.sif"))
    assert argv[3:13] == ["apptainer", "exec", "--nv", "--bind", f"{REPO}:{REPO},{logs}:{logs}", "--pwd", str(REPO),
                          "/images/dapo.sif", "bash", "-c"]  # fmt: skip
    inside = REPO / "logs"  # a log directory inside the repository is mounted with it
    _, argv = srun_line(dry_run("examples/smoke_cpu.yaml", APPTAINER_IMAGE="/i.sif", DAPO_LOG_DIR=str(inside)))
    assert argv[argv.index("--bind") + 1] == f"{REPO}:{REPO}"


def test_both_container_runtimes_at_once_is_refused_in_one_line(dry_run):
    done = dry_run("examples/smoke_cpu.yaml", CONTAINER_IMAGE="a", APPTAINER_IMAGE="b.sif")
    assert done.returncode == 2 and done.stderr.strip() == (
        "set CONTAINER_IMAGE (pyxis) or APPTAINER_IMAGE (apptainer), not both"
    )

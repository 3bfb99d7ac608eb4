"""What the Slurm tests' jobs share: the test recipe (the CPU demo, capped and made deterministic in its time),
the batch script submitted with it, and reading a run's metrics and a job's output."""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
from pathlib import Path

from tests.conftest import REPO

# The jobs have 2 tasks (DP 2). At 4 tasks (TP 2 x DP 2), as they were, the demo recipe trained 0.6-0.8 s a step here,
# after 25-45 s of start-up (4 processes importing torch and Megatron-Core on 2 cores), and 60-90 s beside the heaviest
# of the suite (load average 13-20: seen on fresh clones); at 2 tasks, with the multi-node module's jobs starting at
# once beside another suite's tests (load average 20-30), 0.5-5 s a step after 44-97 s. The multi-node module runs its
# jobs at once (tests/slurm/test_multinode.py), so the time-limited jobs are timed for a start-up of up to 150 s.
# Slurm's timer ticks every 30 s and warns 0-30 s early (tests/slurm/cluster.py). A time-limited job's first attempt
# pauses in every step (its `step_pause`, through tests.verifiers:spread_pausing_in_the_first_attempt, the demo's own
# filter otherwise): slower steps that compute the same thing, so that its STEPS outlast the attempt even after the
# quickest start-up, while a re-queued attempt trains the rest at full speed. At most 2 generation rounds a step:
# uncapped, the late steps of the demo (accuracy 0.9, most groups all-correct) took 6-8 rounds and 2.5-3.5 s
# each (issue 21).
STEPS = 12
# Warned: a 5-minute job warned 90 s ahead gets the warning 180-210 s into its attempt, after the slowest start-up
# (a 3-minute one, warned 60-90 s in, was once warned while its tasks were still starting: nothing to save);
# 12 steps of 18 s pauses take 216 s and more.
TIME_LIMIT = ["--time=5", "--signal=B:USR1@90"]
WARNED_STEP_PAUSE = 18.0
WARNING_ONLY = ["checkpoint.stop_before_time_limit=false"]  # the run's own stop would come first otherwise
# Too late: a warning 5 s ahead (5-35 s: Slurm's tick) is shorter than a paused step and a save; the run reads the
# job's end from squeue (Slurm 22.05 sets no SLURM_JOB_END_TIME) and stops by itself at the first step boundary
# where its longest step (about 17.5 s), the save estimate of 10 s and this margin no longer fit: 50-68 s before
# the end of a 4-minute attempt, 15 s or more before the warning could come, after 1-10 steps. Its 12 steps of
# 17 s pauses take 204 s and more: past that boundary (172 s into the attempt) after any start-up, a warm task's
# 2 s included (with 15 s pauses, 186 s of steps left it 1.5 s short of the boundary, and the job finished).
LATE_WARNING = ["--time=4", "--signal=B:USR1@5"]
OWN_STOP_STEP_PAUSE = 17.0
OWN_STOP_MARGIN = ["checkpoint.time_limit_margin_s=40"]
RECIPE = [
    "examples/smoke_cpu.yaml",
    f"trainer.steps={STEPS}",
    "algorithm.dynamic_sampling.max_rounds=2",
    "algorithm.dynamic_sampling.filter=tests.verifiers:spread_pausing_in_the_first_attempt",  # where asked
    "checkpoint.save_interval=0",  # no periodic save: only the time-limit warning saves
    "logging.wandb.mode=disabled",
    "logging.plot=false",
    "logging.progress=false",
]
# On this 2-core node: 2 tasks of 1 CPU, no GPU (the script's #SBATCH defaults are for 8-GPU nodes).
CPU_NODE = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--gres=none"]


# A job's rendezvous port (MASTER_PORT), below the kernel's ephemeral range (32768-60999): ports from there (as
# free_port gives) are also what a node's own connections take, slurmstepd's and gloo's, and a job's store once
# failed to listen on one (EADDRINUSE on node8, whose previous job had just ended). Each pytest worker has its own
# hundred, each job a port of its own.
_worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_job_ports = itertools.count(21000 + 100 * _worker)


def job_master_port() -> int:
    """The next port of this worker's hundred that is free here (the one-node cluster's jobs run in this machine's
    own network)."""
    for port in _job_ports:
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise AssertionError("unreachable: the count is endless")


def submit(
    cluster,
    tmp_path: Path,
    name: str,
    *options: str,
    step_pause: float = 0.0,
    overrides: list[str] = (),
    shape: list[str] = CPU_NODE,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> tuple[int, Path]:
    """slurm/train.sbatch with the test recipe (+ `overrides`) on `shape` (the sbatch options saying how many
    nodes and tasks) + `options`, its tasks run by `python` (the script's DAPO_PYTHON); the job id and the run
    directory; `env`: more of the job's environment. Task logs go to <tmp_path>/logs/<name>-<id>/."""
    run_dir = tmp_path / name
    env = {"DAPO_PYTHON": python, "DAPO_LOG_DIR": str(tmp_path / "logs"), "MASTER_PORT": str(job_master_port()),
           "PYTHONWARNINGS": "ignore", "DAPO_TEST_STEP_PAUSE": str(step_pause), **(env or {})}  # fmt: skip
    job_id = cluster.submit(
        REPO / "slurm/train.sbatch",
        *RECIPE,
        *overrides,
        f"logging.run_dir={run_dir}",
        sbatch_options=[*shape, f"--job-name={name}", f"--output={tmp_path}/{name}-%j.out", *options],
        env=env,
        cwd=REPO,
    )
    return job_id, run_dir


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_timings(table: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "memory/"))} for row in table]


def job_output(tmp_path: Path, name: str, job_id: int) -> str:
    return (tmp_path / f"{name}-{job_id}.out").read_text()

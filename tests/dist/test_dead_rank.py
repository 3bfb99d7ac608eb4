"""A rank killed from outside under torchrun (the out-of-memory killer's way): a survivor on its host names it,
its pid, host and phase, once for the job, with what to do (it ended in 3-4 s with gloo's and torchrun's
tracebacks only)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import psutil

from tests.conftest import REPO, free_port

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}


def torchrun_demo(run_dir, *extra: str) -> list[str]:
    """A real torchrun of the demo on 2 ranks (this module is about the launcher itself)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        "-m", "dapo_mcore.cli", "train", "examples/smoke_cpu.yaml", "rollout.prompts_per_step=4",
        "rollout.gen_prompts_per_round=4", "trainer.mini_batch_size=32", "trainer.micro_batch_size=32",
        "logging.wandb.mode=disabled", "logging.plot=false", "logging.progress=false", f"logging.run_dir={run_dir}",
        *extra,
    ]  # fmt: skip


def test_a_rank_killed_under_torchrun_is_named_once_by_a_survivor(tmp_path):
    run_dir = tmp_path / "run"
    cmd = torchrun_demo(
        run_dir, "trainer.steps=4", "algorithm.dynamic_sampling.filter=tests.verifiers:kill_rank_1_in_step_2"
    )
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert_rank_1_named_once(output)


def assert_rank_1_named_once(output: str) -> None:
    """One line for the job naming rank 1, killed in step 2 (tests.verifiers:kill_rank_1_in_step_2); also srun's
    test (tests/slurm/test_train_jobs.py)."""
    named = [line for line in output.splitlines() if "from outside this run" in line]
    assert len(named) == 1, output[-4000:]
    assert re.fullmatch(
        r"dapo-mcore: rank 1 \(pid \d+\) on host \S+ ended during \w+ at step 2, from outside this run \(the "
        r"out-of-memory killer, a kill -9 or a crash: the launcher's summary gives its exit code\); every complete "
        r"save is kept: continue with checkpoint.resume=auto",
        named[0],
    ), named[0]


def test_a_sigkill_of_torchruns_process_group_ends_its_ranks(tmp_path):
    """torchrun starts its ranks in sessions of their own: a SIGKILL of its process group left them running 1-3
    minutes, failing on its dead store (one blamed the verifier for it). Now its death is their SIGTERM, and they
    leave without touching its store."""
    run_dir = tmp_path / "run"
    cmd = torchrun_demo(run_dir, "trainer.steps=500", "checkpoint.save_interval=0")
    output = tmp_path / "output.txt"  # the ranks write here after torchrun is gone (they inherit its stderr)
    launcher = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=output.open("w"), stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    ranks = []
    try:
        deadline = time.time() + 300
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert launcher.poll() is None and time.time() < deadline, "the run did not reach its second step"
            time.sleep(0.5)
        ranks = [p for p in psutil.Process(launcher.pid).children() if "dapo_mcore.cli" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's group: its ranks are in sessions of their own
        _, alive = psutil.wait_procs(ranks, timeout=45)  # the step's end and a save, or the 20 s grace
        assert not [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        # quietly: the ranks' calls to the dead store printed c10d's C++ stack traces (84 "frame #" lines)
        said = output.read_text()
        assert "stopped by SIGTERM" in said and "frame #" not in said, said[-4000:]
    finally:  # what this test started and is left: torchrun and its ranks (no children of ours once it is gone);
        # not the worker's other children (the warm CLI server that other tests share)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        for p in ranks:
            with contextlib.suppress(psutil.Error):
                p.kill()

"""The preflight: problems that would otherwise surface hours into a job stop every rank before the model is
built, with one line each, printed once, exit code 2, and nothing created."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from tests.conftest import REPO, free_port
from tests.e2e.test_train_cli import SHORT, cli

TORCHRUN_2 = ("-m", "torch.distributed.run", "--nproc_per_node=2")


def args(run_dir: Path, *extra: str) -> list[str]:
    return ["train", "examples/smoke_cpu.yaml", *SHORT, "logging.wandb.mode=disabled", "logging.progress=false",
            f"logging.run_dir={run_dir}", *extra]  # fmt: skip


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dapo-mcore") or " (rank" in line]


def test_a_layout_that_does_not_divide_the_tasks_stops_every_task_at_once(tmp_path):
    launcher = (*TORCHRUN_2, f"--master_port={free_port()}")
    proc = cli(*args(tmp_path / "run", "parallel.tensor_model_parallel_size=2",
                     "parallel.pipeline_model_parallel_size=2"), launcher=launcher, expect=1)  # fmt: skip
    want = "dapo-mcore: error: parallel layout TP=2 x PP=2 = 4 ranks does not divide the world size 2"
    assert [line for line in proc.stderr.splitlines() if line.startswith("dapo-mcore")] == [
        want + "; launch a multiple of 4 processes or change parallel.tensor_model_parallel_size / "
        "parallel.pipeline_model_parallel_size"
    ]  # printed once (by rank 0); torchrun's exit code is 1 when a worker fails
    assert not (tmp_path / "run").exists()


def test_every_problem_of_every_rank_is_one_line_printed_once(tmp_path):
    """Two ranks, a model directory without its weights and a checkpoint directory under a regular file."""
    (tmp_path / "model").mkdir()
    shutil.copy(REPO / "examples/models/tiny-arith/config.json", tmp_path / "model")
    (tmp_path / "a_file").write_text("not a directory")
    launcher = (*TORCHRUN_2, f"--master_port={free_port()}")
    proc = cli(*args(tmp_path / "run", f"model.hf_path={tmp_path}/model", f"checkpoint.dir={tmp_path}/a_file/ckpt",
                     "checkpoint.save_interval=1"), launcher=launcher, expect=1)  # fmt: skip
    lines = errors(proc.stderr)
    assert lines[0] == "dapo-mcore: error: preflight found problems before training:"
    assert lines[1].startswith(f"  model.hf_path {tmp_path}/model: no readable *.safetensors weights (model.init=hf)")
    assert lines[2].startswith(f"  checkpoint directory {tmp_path}/a_file/ckpt: cannot write in {tmp_path}/a_file")
    assert all(line.endswith(f" (ranks 0,1 on {socket.gethostname()})") for line in lines[1:])
    assert len(lines) == 3, proc.stderr[-3000:]  # once, by rank 0
    assert not (tmp_path / "run").exists()


def test_a_missing_model_directory_is_one_line(tmp_path):
    proc = cli(*args(tmp_path / "run", f"model.hf_path={tmp_path}/nowhere"), expect=2)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"dapo-mcore: error: model.hf_path: no config.json at {tmp_path}/nowhere/config.json"
    )


def test_a_read_only_checkpoint_directory_is_refused(tmp_path):
    import subprocess

    import pytest

    disk = tmp_path / "ro"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        proc = cli(*args(tmp_path / "run", f"checkpoint.dir={disk}/ckpt", "checkpoint.save_interval=1"), expect=2)
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    assert (
        f"checkpoint directory {disk}/ckpt: cannot write in {disk} (Read-only file system) (rank 0 on " in proc.stderr
    )

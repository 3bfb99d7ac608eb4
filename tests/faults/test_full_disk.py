"""A save that does not fit: on a small tmpfs, a save that fails mid-write (written in the training process or
in the background) removes its partial directory and a save that cannot fit is refused before writing; each
stops the run with one line, keeps every earlier save, and the next resume=auto needs no manual step.
Skipped where tmpfs cannot be mounted (needs root)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dapo_mcore.checkpoint.model_checkpoint import verify_complete
from tests.e2e.test_train_cli import SHORT, cli, read_rows


@pytest.fixture
def small_disk(tmp_path):
    mounted = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk-{size}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


def args(run_dir: Path, ckpt_dir: Path, *extra: str) -> list[str]:
    return ["train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=4", "checkpoint.save_interval=2",
            f"checkpoint.dir={ckpt_dir}", "logging.wandb.mode=disabled", "logging.progress=false",
            f"logging.run_dir={run_dir}", *extra]  # fmt: skip


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_that_fails_mid_write_leaves_no_partial_directory(small_disk, tmp_path, async_save):
    # a save of the demo model takes 2.3 MiB; the preflight's estimate (weights + Adam state) is 2.08 MiB
    disk, run_dir = small_disk("2200k"), tmp_path / "run"
    proc = cli(*args(run_dir, disk, f"checkpoint.async_save={async_save}"), expect=2)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dapo-mcore: error: saving checkpoint {disk}/step_000002 failed: rank 0: ")
    assert "MiB were free" in last and "the partial save was removed" in last
    assert "Traceback" not in proc.stderr
    assert list(disk.iterdir()) == []
    steps = [r["step"] for r in read_rows(run_dir)]
    # a background save's failure is found when the run next looks at it: after a later step, or at the end
    assert steps == [1, 2] if not async_save else steps in ([1, 2], [1, 2, 3], [1, 2, 3, 4])
    # the next run starts with no manual step (no save to resume from: from step 0)
    again = cli(*args(run_dir, disk, "checkpoint.resume=auto", "checkpoint.save_interval=0"))
    assert "no complete save" in again.stderr


def test_a_save_that_cannot_fit_is_refused_before_writing_and_the_earlier_one_resumes(small_disk, tmp_path):
    disk, run_dir = small_disk("4m"), tmp_path / "run"  # room for one save, not two
    proc = cli(*args(run_dir, disk), expect=2)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dapo-mcore: error: not enough space for checkpoint {disk}/step_000004: the last save")
    assert sorted(p.name for p in disk.iterdir()) == ["latest", "step_000002"]
    assert verify_complete(disk / "step_000002", checksums=True) > 0
    resumed = cli(*args(run_dir, disk, "checkpoint.resume=auto", "checkpoint.save_interval=0"))
    assert "step_000002 at step 2" in resumed.stderr
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3, 4]


def test_the_preflight_refuses_a_checkpoint_directory_without_room_for_one_save(small_disk, tmp_path):
    disk, run_dir = small_disk("1m"), tmp_path / "run"
    proc = cli(*args(run_dir, disk / "ckpt"), expect=2)
    assert f"checkpoint directory {disk}/ckpt: 1.0 MiB free, a save of this model needs about 2.1 MiB" in proc.stderr
    assert not run_dir.exists() and list(disk.iterdir()) == []  # refused before anything was created

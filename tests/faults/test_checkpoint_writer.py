"""The processes behind a background save (checkpoint.async_save), killed outright in step 1: the manager
process of Megatron's write-results queue. Killed while no save is in flight, it is replaced at the step
boundary and the run goes on (it used to be found only by the next save, which failed with a message about disk
space); killed with a save in flight (step 0's), that save is lost: the run saves in its own process and stops
with one line naming the process."""

from __future__ import annotations

from pathlib import Path

from dapo_mcore.checkpoint.model_checkpoint import verify_complete
from tests.e2e.test_train_cli import SHORT, cli, read_rows


def run(run_dir: Path, interval: int, expect: int):
    return cli("train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=2", "checkpoint.async_save=true",
               f"checkpoint.save_interval={interval}", "logging.wandb.mode=disabled", "logging.progress=false",
               "algorithm.dynamic_sampling.filter=tests.verifiers:kill_checkpoint_writer_manager",
               f"logging.run_dir={run_dir}", expect=expect)  # fmt: skip


def test_a_dead_write_results_manager_between_saves_is_replaced_and_the_next_save_completes(tmp_path):
    run_dir = tmp_path / "run"
    proc = run(run_dir, interval=2, expect=0)
    pid = (run_dir / "killed-writer-manager").read_text()
    assert f"the write-results manager process (pid {pid}) was killed by signal 9; started a new one" in proc.stderr
    assert [r["step"] for r in read_rows(run_dir)] == [0, 1]
    assert verify_complete(run_dir / "checkpoints" / "step_000002", checksums=True) > 0


def test_a_save_in_flight_when_its_manager_dies_is_saved_again_in_process_and_the_run_stops(tmp_path):
    run_dir = tmp_path / "run"
    proc = run(run_dir, interval=1, expect=2)
    pid = (run_dir / "killed-writer-manager").read_text()
    ckpt = run_dir / "checkpoints"
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        f"dapo-mcore: error: the background save {ckpt}/step_000001 was lost: rank 0: the write-results manager "
        f"process (pid {pid}) was killed by signal 9; its partial directory was removed, `latest` and every "
        f"earlier save are kept; saved step 2 here instead, to {ckpt}/step_000002: run the same command again "
        "(checkpoint.resume=auto) to continue"
    )
    assert verify_complete(ckpt / "step_000002", checksums=True) > 0
    assert (ckpt / "latest").read_text().strip() == "step_000002"
    assert [r["step"] for r in read_rows(run_dir)] == [0, 1]

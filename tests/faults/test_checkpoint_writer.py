"""The processes behind a background save (checkpoint.async_save), killed outright: the manager process of
Megatron's write-results queue. One run (saves every 2 steps) has it killed twice: in step 1, while no save is in
flight, it is replaced at the step boundary and the run goes on (it used to be found only by the next save, which
failed with a message about disk space); in step 2, with step 2's save in flight, that save is lost: the run
saves in its own process and stops with one line naming the process."""

from __future__ import annotations

from dapo_mcore.checkpoint.model_checkpoint import verify_complete
from tests.e2e.test_train_cli import SHORT, cli, read_rows


def test_a_dead_write_results_manager_is_replaced_and_a_save_it_took_down_is_made_again_in_process(tmp_path):
    run_dir = tmp_path / "run"
    proc = cli("train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=3", "checkpoint.async_save=true",
               "checkpoint.save_interval=2", "logging.wandb.mode=disabled", "logging.progress=false",
               "algorithm.dynamic_sampling.filter=tests.verifiers:kill_checkpoint_writer_manager",
               f"logging.run_dir={run_dir}", expect=2)  # fmt: skip
    idle, in_flight = ((run_dir / f"killed-{step}").read_text() for step in (1, 2))
    assert f"the write-results manager process (pid {idle}) was killed by signal 9; started a new one" in proc.stderr
    ckpt = run_dir / "checkpoints"
    assert proc.stderr.strip().splitlines()[-1] == (
        f"dapo-mcore: error: the background save {ckpt}/step_000002 was lost: rank 0: the write-results manager "
        f"process (pid {in_flight}) was killed by signal 9; its partial directory was removed, `latest` and every "
        f"earlier save are kept; saved step 3 here instead, to {ckpt}/step_000003: run the same command again "
        "(checkpoint.resume=auto) to continue"
    )
    # Megatron's writer process, which could not hand its results over, ends without its own traceback
    assert "Traceback" not in proc.stderr and "EOFError" not in proc.stderr, proc.stderr[-3000:]
    assert verify_complete(ckpt / "step_000003", checksums=True) > 0
    assert (ckpt / "latest").read_text().strip() == "step_000003"
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3]


def test_with_synchronous_saves_a_dead_write_results_manager_is_replaced_before_the_save_needs_it(tmp_path):
    """checkpoint.async_save=false (the default): the manager killed in step 1 and again in step 2 is replaced at
    each step boundary, and step 2's save is made (it failed with ConnectionRefusedError and a line about free
    disk space, losing every step since the last save)."""
    run_dir = tmp_path / "run"
    proc = cli("train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=3", "checkpoint.save_interval=2",
               "logging.wandb.mode=disabled", "logging.progress=false",
               "algorithm.dynamic_sampling.filter=tests.verifiers:kill_checkpoint_writer_manager",
               f"logging.run_dir={run_dir}")  # fmt: skip
    for step in (1, 2):
        pid = (run_dir / f"killed-{step}").read_text()
        assert f"the write-results manager process (pid {pid}) was killed by signal 9; started a new one" in proc.stderr
    ckpt = run_dir / "checkpoints"
    assert verify_complete(ckpt / "step_000002", checksums=True) > 0
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2, 3]

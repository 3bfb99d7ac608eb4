"""A save is valid at any step, also before the first optimizer update (every group filtered out), and a run
resumes from it exactly."""

from __future__ import annotations

import shutil

from dapo_mcore.checkpoint.model_checkpoint import verify_complete
from tests.e2e.test_checkpoints import without_timings
from tests.e2e.test_train_cli import SHORT, cli, read_rows

# operands no tiny-arith answer gets right: every group is all-wrong, dynamic sampling keeps none
HARD = ["data.min_operand=5000", "data.max_operand=9000", "algorithm.dynamic_sampling.max_rounds=1"]


def args(run_dir, *extra):
    return ["train", "examples/smoke_cpu.yaml", *SHORT, "checkpoint.save_interval=1", "logging.wandb.mode=disabled",
            "logging.progress=false", f"logging.run_dir={run_dir}", *extra]  # fmt: skip


def test_a_save_before_any_update_is_written_and_resumes_exactly(tmp_path):
    first = tmp_path / "first"
    cli(*args(first, *HARD, "trainer.steps=1"))
    assert read_rows(first)[0]["dynamic_sampling/kept_groups"] == 0  # no update was made
    assert verify_complete(first / "checkpoints" / "step_000001", checksums=True) > 0

    untouched = shutil.copytree(first, tmp_path / "untouched")
    cli(*args(first, *HARD, "trainer.steps=2", "checkpoint.resume=auto"))
    straight = tmp_path / "straight"
    cli(*args(straight, *HARD, "trainer.steps=2"))
    assert without_timings(read_rows(first)) == without_timings(read_rows(straight))

    # the same save, resumed on problems the model can learn from: the first update runs from it
    cli(*args(untouched, "trainer.steps=2", "checkpoint.resume=auto"))
    assert read_rows(untouched)[-1]["actor/train_tokens"] > 0

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
    straight = tmp_path / "straight"  # 2 steps, saving after each: the save after step 0 precedes any update
    cli(*args(straight, *HARD, "trainer.steps=2"))
    assert read_rows(straight)[0]["dynamic_sampling/kept_groups"] == 0  # no update was made
    assert verify_complete(straight / "checkpoints" / "step_000001", checksums=True) > 0

    def resumed_copy(name: str, *extra: str):
        run_dir = shutil.copytree(straight, tmp_path / name)
        cli(*args(run_dir, *extra, "trainer.steps=2", f"checkpoint.resume={run_dir}/checkpoints/step_000001"))
        return run_dir

    assert without_timings(read_rows(resumed_copy("resumed", *HARD))) == without_timings(read_rows(straight))
    # the same save, resumed on problems the model can learn from: the first update runs from it
    assert read_rows(resumed_copy("learnable"))[-1]["actor/train_tokens"] > 0

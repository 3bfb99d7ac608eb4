"""What changed between a save and its resume is said, not passed over: a data file cut short or reordered is
refused in one line naming the file and the change (unless data.allow_changed_data), a config that changes the
experiment is refused by resume=auto (resume=force lists every changed key in one warning), a run that fails to
start moves nothing aside; and rollout.verify_weights says what it checked at every push. Before: the changed
file was used silently (or a resume past its end crashed with IndexError), config changes were one warning, and
a passing check printed nothing. The tests share one saved run (1 step) and
resume copies of it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_cli import SHORT, cli, read_rows
from tests.warm_cli import cli_env


def write_prompts(path: Path, operands: range) -> Path:
    rows = [{"prompt": f"What is {a}+{a + 1}?\n", "answer": 2 * a + 1} for a in operands]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def train(run_dir: Path, data: Path, *extra: str, expect: int = 0):
    return cli("train", "examples/smoke_cpu.yaml", *SHORT, f"data.source={data}", "checkpoint.save_interval=1",
               "logging.wandb.mode=disabled", "logging.progress=false", f"logging.run_dir={run_dir}", *extra,
               expect=expect)  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(run directory holding a save at step 1, the first run's output); data in <run dir>/../sums.jsonl."""
    root = tmp_path_factory.mktemp("saved")
    data, run_dir = write_prompts(root / "sums.jsonl", range(12)), root / "run"
    return run_dir, train(run_dir, data, "trainer.steps=1", "rollout.verify_weights=true")


def resumable_copy(saved, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the saved run and its data file, at paths of this test's own (the save records the data
    file by content, the config by value: the copy's own paths appear as config changes)."""
    run_dir = tmp_path / "run"
    shutil.copytree(saved[0], run_dir)
    return run_dir, shutil.copy(saved[0].parent / "sums.jsonl", tmp_path / "sums.jsonl")


def test_a_verified_weight_push_says_what_it_checked(saved):
    run_dir, first = saved
    assert first.stderr.count("weight push verified: ") == 2  # the first push, then one after the step
    assert "taken by the engine match the actor's checksums" in first.stderr
    assert all(r["weight_sync/verified_tensors"] > 0 and r["weight_sync/verified_mib"] > 0 for r in read_rows(run_dir))


def test_a_data_file_changed_since_the_save_is_refused_unless_allowed(saved, tmp_path):
    run_dir, data = resumable_copy(saved, tmp_path)
    size = data.stat().st_size
    write_prompts(data, range(3))  # cut to fewer rows than the save's position in it
    resume = ["checkpoint.resume=auto", "trainer.steps=2"]
    refused = train(run_dir, data, *resume, expect=2)
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"dapo-mcore: error: data file {data} changed since the save (bytes {size} -> {data.stat().st_size}; "
        "rows 12 -> 3; the rows' content or order differs (sha256)): the save's position (epoch 0, prompt "
    )
    assert last.endswith("would point at other prompts; restore the file, or set data.allow_changed_data=true "
                         "to continue with it")  # fmt: skip
    assert "Traceback" not in refused.stderr
    checked = cli("check", "examples/smoke_cpu.yaml", *SHORT, f"data.source={data}", f"logging.run_dir={run_dir}",
                  *resume, expect=2)  # fmt: skip
    assert f"  - data file {data} changed since the save (bytes {size}" in checked.stderr  # "ready to launch" before

    allowed = train(run_dir, data, *resume, "data.allow_changed_data=true")
    assert "data.allow_changed_data=true: continuing at the save's position" in allowed.stderr
    assert "(past its end: the next epoch starts)" in allowed.stderr
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2]


def test_resume_auto_refuses_a_changed_experiment_and_force_takes_it_listing_every_change(saved, tmp_path):
    """A recipe edited (or derived from another without a name of its own) and run again with resume=auto used
    to continue the old run's weights, metrics and wandb run, with one warning."""
    run_dir, data = resumable_copy(saved, tmp_path)
    changed = ["algorithm.clip_high=0.3", "trainer.micro_batch_size=8"]  # trainer.steps=1: nothing left to run
    refused = train(run_dir, data, "checkpoint.resume=auto", "trainer.steps=1", *changed, expect=2)
    last = refused.stderr.strip().splitlines()[-1]
    assert last == (
        f"dapo-mcore: error: checkpoint.resume=auto: {run_dir}/checkpoints/step_000001 is another experiment: 1 "
        "config keys differ from its save (algorithm.clip_high: 0.28 -> 0.3); give this run its own name (or "
        "logging.run_dir), or set checkpoint.resume=force to continue that run with the new values"
    )
    assert "Traceback" not in refused.stderr
    proc = train(run_dir, data, "checkpoint.resume=force", "trainer.steps=1", *changed)
    (warning,) = [line for line in proc.stderr.splitlines() if "config keys changed since the save" in line]
    assert "resuming from step_000001 with 4 config keys changed since the save: " in warning
    for change in (f"data.source: '{saved[0].parent}/sums.jsonl' -> '{data}'", "algorithm.clip_high: 0.28 -> 0.3",
                   "trainer.micro_batch_size: 16 -> 8", "rollout.verify_weights: True -> False"):  # fmt: skip
        assert change in warning, change
    # what every continuation changes is not listed (it was, on every ordinary extension of a run)
    assert "checkpoint.resume" not in warning and "logging.run_dir" not in warning and "trainer.steps" not in warning
    # Megatron-Core's loader calls torch's deprecated name on every resume (parallel/state.py _BENIGN_WARNINGS)
    assert "load_state_dict` is deprecated" not in proc.stderr


def test_a_run_that_fails_its_checks_leaves_the_earlier_run_where_it_was(saved, tmp_path):
    """The earlier run used to be moved to run.prev-* before the data, the engine and the model were checked:
    the next resume=auto then started from step 0."""
    run_dir, data = resumable_copy(saved, tmp_path)
    before = sorted(p.name for p in run_dir.iterdir())
    proc = train(run_dir, data, "data.max_prompt_len=1", expect=2)  # fails on the prompts, after the preflight
    assert "longer than the 1 allowed (data.max_prompt_len)" in proc.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in run_dir.iterdir()) == before and not list(tmp_path.glob("run.prev-*"))


def test_check_says_which_save_a_resume_takes_and_refuses_a_changed_experiment(saved, tmp_path):
    run_dir, data = resumable_copy(saved, tmp_path)
    args = ["check", "examples/smoke_cpu.yaml", *SHORT, f"data.source={data}", f"logging.run_dir={run_dir}",
            "checkpoint.resume=auto", "trainer.steps=2"]  # fmt: skip
    shown = {k: v for k, v in cli_env().items() if k != "PYTHONWARNINGS"}  # warnings on, as a user has them
    ready = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", *args], cwd=REPO, env=shown,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ready.returncode == 0, ready.stderr[-3000:]
    assert f"resumes {run_dir}/checkpoints/step_000001 at step 1 of 2" in ready.stdout
    assert "Warning" not in ready.stderr, ready.stderr  # Megatron's TE/Apex notes as it reads the save: 4 were
    refused = cli(*args, "algorithm.clip_high=0.3", expect=2)
    assert f"  - checkpoint.resume=auto: {run_dir}/checkpoints/step_000001 is another experiment: 1 config" in (
        refused.stderr
    )

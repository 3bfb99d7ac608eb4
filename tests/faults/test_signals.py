"""Signals end a run with one line, no traceback, the lock released and no process of the run left: SIGINT / SIGTERM /
SIGUSR1 after saving at the next step boundary (exit 75), or at once (SIGINT 130, others 143) when the step does not
end within checkpoint.sigterm_grace_s (SIGTERM), at a second signal (tests/unit/test_launch.py), or with
checkpoint.save_on_signal=false, saying which step was lost. After a SIGKILL of the run no process of it survives
either (workers get the parent-death signal), and the run continues from its newest save. wandb is offline, the
default: its service process is one of the run's, and a clean stop keeps the wandb run as far as it got."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from dapo_mcore.checkpoint.model_checkpoint import verify_complete
from dapo_mcore.checkpoint.run_checkpoint import find_latest_complete
from dapo_mcore.utils.processes import run_tmp_of
from tests.e2e.test_quiet_output import wandb_history_steps
from tests.e2e.test_train_cli import read_rows
from tests.warm_cli import REPO, WarmProcess, cli_env, start_warm

SIGNAL_IN_PHASE = REPO / "tests" / "faults" / "signal_in_phase.py"


def start(run_dir: Path, *extra: str, signal_in: list[str] | None = None) -> WarmProcess:
    """The CLI run, forked from a warm server (tests/warm_cli.py: the run is a process of its own, as started by
    `python -m dapo_mcore.cli`, without paying the imports). signal_in: PHASE SIGNAL NTH HOLD_S, the run signals
    itself in that phase (signal_in_phase.py of tests/faults)."""
    argv = ["train", "examples/smoke_cpu.yaml", "trainer.steps=500",
            "rollout.prompts_per_step=4", "rollout.gen_prompts_per_round=4", "trainer.mini_batch_size=16",
            "trainer.micro_batch_size=16", "checkpoint.save_interval=1", "logging.progress=false",
            f"logging.run_dir={run_dir}", *extra]  # fmt: skip
    if signal_in:
        return start_warm([*signal_in, "--", *argv], cli_env(), timeout=600, script=SIGNAL_IN_PHASE)
    return start_warm(argv, cli_env(), timeout=600)


def wait_for_training(proc: WarmProcess, run_dir: Path, rows: int = 2) -> list[psutil.Process]:
    """Once `rows` steps are logged (a save has run), the run's process tree."""
    deadline = time.time() + 180
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    return psutil.Process(proc.pid).children(recursive=True)


def gone(processes: list[psutil.Process], within_s: float = 15.0) -> list[psutil.Process]:
    """The processes still alive after `within_s` seconds."""
    _, alive = psutil.wait_procs(processes, timeout=within_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def stopped(proc: WarmProcess, sig: int, code: int, children: list[psutil.Process], run_dir: Path) -> str:
    """Send `sig`; check the exit code, no traceback (wandb's exit hook printed one after a Ctrl-C), no child
    left, the lock released, wandb's rows closed; returns the last line."""
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    proc.stderr_text = err
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert_wandb_kept_the_rows(run_dir)
    assert gone(children) == []
    assert not run_dir.with_name(f".{run_dir.name}.lock").exists()  # the run-directory lock was released
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("sig", "extra", "code", "name"),
    [
        (signal.SIGINT, ["checkpoint.save_on_signal=false"], 130, "SIGINT"),
        (signal.SIGTERM, ["checkpoint.sigterm_grace_s=0"], 143, "SIGTERM"),  # no time for the step to end
        (signal.SIGTERM, ["checkpoint.save_on_signal=false"], 143, "SIGTERM"),
        (signal.SIGUSR1, ["checkpoint.save_on_signal=false"], 143, "SIGUSR1"),
    ],
)
def test_a_signal_that_stops_at_once_ends_with_one_line_its_exit_code_and_no_child_left(
    tmp_path, sig, extra, code, name
):
    proc = start(tmp_path / "run", *extra)
    children = wait_for_training(proc, tmp_path / "run", rows=1)  # stopping at once: one step is enough
    assert children, "the run should have worker processes (verifier workers at least)"
    line = stopped(proc, sig, code, children, tmp_path / "run")
    assert line.startswith(f"dapo-mcore: stopped by {name}; the saves already complete are kept")
    lost = re.search(rf"stopped at once by {name} during step (\d+): (.*)", proc.stderr_text)
    assert lost, proc.stderr_text[-2000:]
    saved = find_latest_complete(tmp_path / "run" / "checkpoints")
    if saved is None:  # stopped in step 1 or its save: nothing to continue from
        assert lost.group(2) == "no save was complete yet, so a rerun starts from step 0"
    else:
        assert f"checkpoint.resume=auto continues from the save of step {int(saved.name[5:])}" in lost.group(2)


@pytest.mark.parametrize(
    ("sig", "name"), [(signal.SIGTERM, "SIGTERM"), (signal.SIGUSR1, "SIGUSR1"), (signal.SIGINT, "SIGINT")]
)
def test_sigterm_sigusr1_and_ctrl_c_save_at_the_step_boundary_and_exit_75(tmp_path, sig, name):
    """Ctrl-C stopped at once and lost every step since the last save."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "checkpoint.save_interval=1000")  # no periodic save: the stop's save is the only one
    children = wait_for_training(proc, run_dir)
    line = stopped(proc, sig, 75, children, run_dir)
    match = re.fullmatch(rf"dapo-mcore: stopped by {name} after step (\d+); saved to (\S+); run the same .*", line)
    assert match, line
    next_step, save = int(match.group(1)), Path(match.group(2))
    assert save.name == f"step_{next_step:06d}" and len(read_rows(run_dir)) == next_step
    verify_complete(save, checksums=True)


def assert_wandb_kept_the_rows(run_dir: Path) -> None:
    """The offline wandb run was closed and holds the steps of metrics.jsonl; the newest may be missing (the
    signal can land between the row's write to metrics.jsonl and its wandb.log)."""
    steps, logged = [row["step"] for row in read_rows(run_dir)], wandb_history_steps(run_dir)
    assert logged == steps[: len(logged)] and len(logged) >= len(steps) - 1, (logged, steps)


def test_after_a_sigkill_no_process_of_the_run_is_left_and_the_run_continues(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir)
    children = wait_for_training(proc, run_dir, rows=2)  # verifier workers, the writer's manager, wandb, ...
    assert children
    proc.kill()
    proc.wait()
    assert gone(children) == []
    # the killed run's temporary files are in its own directory (multiprocessing's pymp-* stayed in /tmp for good)
    run_tmp = run_tmp_of(str(run_dir), 0)
    assert list(run_tmp.glob("pymp-*")), sorted(p.name for p in run_tmp.iterdir())
    newest = int(find_latest_complete(run_dir / "checkpoints").name.removeprefix("step_"))  # SIGKILL: one may be cut
    resumed = start(run_dir, "checkpoint.resume=auto", f"trainer.steps={newest + 1}")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert not run_tmp.exists()  # removed by the next start (its owner gone) and the normal end
    assert f"at step {newest}" in err and [row["step"] for row in read_rows(run_dir)][-1] == newest + 1


# (phase, signal, the phase's call in which it comes: step 2's; the run's first push is before step 1)
PHASE_SIGNALS = [
    ("generation", "SIGTERM", 2),
    ("old_logprobs", "SIGTERM", 2),
    ("update", "SIGTERM", 2),
    ("push", "SIGTERM", 3),
    ("save", "SIGTERM", 2),
    ("generation", "SIGINT", 2),
    ("push", "SIGINT", 3),
]


@pytest.mark.parametrize(("phase", "name", "nth"), PHASE_SIGNALS)
def test_a_signal_in_any_phase_of_a_step_saves_that_step_and_exits_75(tmp_path, phase, name, nth):
    """Step 2 is saved whatever phase the signal came in (step 1 too when the save is the phase): the run
    stops at the boundary, the lock released. A signal after the update skips the weight push and the held-out
    check, which the save does not need (at the recipes' shapes they outlast SIGTERM's grace: the step was lost).
    """
    run_dir = tmp_path / "run"
    saves = "checkpoint.save_interval=1" if phase == "save" else "checkpoint.save_interval=1000"
    held_out = tmp_path / "held_out.jsonl"  # four problems: a held-out check after every step costs little
    held_out.write_text("".join((REPO / "examples/data/sums-eval64.jsonl").read_text().splitlines(True)[:4]))
    proc = start(run_dir, saves, "trainer.eval_interval=1", "trainer.eval_k=1", f"data.eval_files={held_out}",
                 signal_in=[phase, name, str(nth), "1"])  # fmt: skip
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75 and "Traceback" not in err, err[-3000:]
    assert not run_dir.with_name(f".{run_dir.name}.lock").exists()
    last = err.strip().splitlines()[-1]
    step_2 = run_dir / "checkpoints" / "step_000002"
    saved = "nothing trained since the newest save" if phase == "save" else f"saved to {step_2}"
    assert last.startswith(f"dapo-mcore: stopped by {name} after step 2; {saved}"), last
    verify_complete(step_2, checksums=True)
    rows = read_rows(run_dir)
    assert [row["step"] for row in rows] == [0, 1, 2], err[-3000:]
    skipped = rows[2].get("weight_sync/skipped_for_stop") == 1.0
    assert skipped == (phase in ("generation", "old_logprobs", "update")), rows[2]
    assert any(key.startswith("eval/") for key in rows[2]) == (phase == "save"), rows[2]  # (push: skipped too)


def test_a_phase_that_outlasts_the_grace_loses_its_step_with_one_line_and_releases_the_lock(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "checkpoint.sigterm_grace_s=1", signal_in=["update", "SIGTERM", "2", "5"])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert not run_dir.with_name(f".{run_dir.name}.lock").exists()
    assert ("stopped at once by SIGTERM during step 2: the steps after 1 are lost; checkpoint.resume=auto continues "
            "from the save of step 1") in err, err[-3000:]  # fmt: skip

"""Bad input gives one line naming the file (and row), never a traceback or silence: over-long prompts under
each data.long_prompts policy, non-UTF-8 data, a run_dir that is a file, a damaged HF directory, a run directory
the system refuses to write (its lock, config.yaml, metrics; samples and curves cost a warning; a save)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_cli import SHORT, cli, read_rows
from tests.warm_cli import cli_env, run_warm

MODEL = REPO / "examples/models/tiny-arith"  # 128 positions; the demo's responses take up to 32 of them


def prompts_file(path: Path, long_row: bool = True) -> Path:
    rows = [{"prompt": f"What is {a}+{a}?\n", "answer": 2 * a} for a in range(8)]
    if long_row:
        rows.insert(1, {"prompt": "What is " + "1+" * 150 + "1?\n", "answer": 151})  # about 310 tokens
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train(tmp_path: Path, *extra: str, expect: int = 0):
    return cli("train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=1", "logging.wandb.mode=disabled",
               f"logging.run_dir={tmp_path / 'run'}", *extra, expect=expect)  # fmt: skip


def last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


def test_an_over_long_prompt_is_an_error_naming_file_and_row_by_default(tmp_path):
    data = prompts_file(tmp_path / "long.jsonl")
    proc = train(tmp_path, f"data.source={data}", expect=2)
    assert last_line(proc).startswith("dapo-mcore: error: long.jsonl:2: the prompt is ")
    assert "longer than the 96 allowed (the model's 128 positions minus max_response_len)" in last_line(proc)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(("policy", "said"), [("drop", "left out"), ("truncate_left", "cut to their last tokens")])
def test_over_long_prompts_can_be_dropped_or_cut_and_are_counted(tmp_path, policy, said):
    data = prompts_file(tmp_path / "long.jsonl")
    proc = train(tmp_path, f"data.source={data}", f"data.long_prompts={policy}")
    assert "1 prompts longer than 96 tokens" in proc.stderr and said in proc.stderr
    assert len(read_rows(tmp_path / "run")) == 1


def test_non_utf8_data_is_one_line_naming_file_and_row(tmp_path):
    data = prompts_file(tmp_path / "bytes.jsonl", long_row=False)
    data.write_bytes(data.read_bytes().replace(b"What is 2+2", b"What is \xff+2", 1))
    proc = train(tmp_path, f"data.source={data}", expect=2)
    assert last_line(proc) == f"dapo-mcore: error: {data}:3: not UTF-8 text (byte 20: b'\\xff')"


def test_a_run_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    proc = train(tmp_path, expect=2)
    assert last_line(proc) == f"dapo-mcore: error: logging.run_dir: {tmp_path / 'run'} exists and is not a directory"


def test_a_damaged_hf_directory_is_one_line_naming_the_file(tmp_path):
    bad_json = shutil.copytree(MODEL, tmp_path / "bad-json")
    (bad_json / "config.json").write_text('{"model_type": "llama", ')
    proc = train(tmp_path, f"model.hf_path={bad_json}", expect=2)
    assert last_line(proc).startswith(f"dapo-mcore: error: {bad_json / 'config.json'} is not valid JSON")

    cut = shutil.copytree(MODEL, tmp_path / "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = train(tmp_path, f"model.hf_path={cut}", expect=2)
    assert last_line(proc).startswith(f"dapo-mcore: error: {weights} is not a readable safetensors file")


# ---- a run directory the system refuses to write: read-only, no permission, a quota, a full disk -------------------
# A real read-only mount where one can be made (root: a tmpfs), a path under a regular file, a file where a directory
# should be; each errno at the real call otherwise (tests/faults/os_error_at.py: root ignores permissions, and a
# quota needs one set up).
OS_ERROR_AT = REPO / "tests/faults/os_error_at.py"


@pytest.fixture
def read_only_dir(tmp_path):
    where = tmp_path / "ro"
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {proc.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=False)


def refusing(pattern: str, code: str, nth: int, *args: str, expect: int, timeout: float = 300):
    """The CLI with the NTH write of a file named PATTERN refused with errno CODE (tests/faults/os_error_at.py)."""
    proc = run_warm([pattern, code, str(nth), "--", *args], cli_env(), timeout, script=OS_ERROR_AT)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def run_args(run_dir: Path, *extra: str, ckpt: Path | None = None) -> list[str]:
    ckpt = ckpt or run_dir.parent / "ckpt"
    return ["train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=2", "logging.wandb.mode=disabled",
            "logging.progress=false", f"logging.run_dir={run_dir}", f"checkpoint.dir={ckpt}", *extra]  # fmt: skip


def lock_line(run_dir: Path, where: Path, reason: str, what: str = "create its lock file") -> str:
    return (f"dapo-mcore: error: logging.run_dir {run_dir}: cannot {what} {where} ({reason}); choose a "
            "logging.run_dir where this job can write")  # fmt: skip


def test_a_read_only_run_directory_is_one_line_naming_the_lock(read_only_dir, tmp_path):
    """It was a traceback ending `OSError: [Errno 30] Read-only file system: .../.RO2.lock`, exit 1."""
    run_dir = read_only_dir / "RO2"
    proc = cli(*run_args(run_dir, ckpt=tmp_path / "ckpt"), expect=2)
    assert last_line(proc) == lock_line(run_dir, read_only_dir / ".RO2.lock", "Read-only file system")
    assert "Traceback" not in proc.stderr


def test_the_lock_a_run_could_not_make_is_found_without_making_it(read_only_dir, tmp_path):
    """RunLock.write_problem, for `dapo-mcore check`: the same refusal, nothing created."""
    from dapo_mcore.utils.run_lock import RunLock

    (tmp_path / "afile").write_text("not a directory")
    for run_dir, where, reason in (
        (read_only_dir / "RO2", read_only_dir, "Read-only file system"),
        (tmp_path / "afile" / "sub" / "run", tmp_path / "afile", "Not a directory"),
    ):
        assert RunLock(run_dir).write_problem() == (
            f"logging.run_dir {run_dir}: cannot create its lock file {run_dir.parent / f'.{run_dir.name}.lock'}: "
            f"{where} ({reason}); choose a logging.run_dir where this job can write"
        )
    assert RunLock(tmp_path / "new" / "run").write_problem() is None and not (tmp_path / "new").exists()


@pytest.mark.parametrize(("code", "reason"), [("EACCES", "Permission denied"), ("EDQUOT", "Disk quota exceeded")])
def test_a_run_lock_the_system_refuses_is_one_line_naming_it(tmp_path, code, reason):
    run_dir = tmp_path / "run"
    proc = refusing(".run.lock", code, 1, *run_args(run_dir), expect=2)
    assert last_line(proc) == lock_line(run_dir, tmp_path / ".run.lock", reason)
    assert "Traceback" not in proc.stderr and not run_dir.exists()


@pytest.mark.parametrize("code", ["EROFS", "EACCES", "EDQUOT", "ENOSPC"])
def test_each_errno_of_the_lock_is_one_error_naming_the_path(tmp_path, monkeypatch, code):
    import errno
    import os

    from dapo_mcore.utils import run_lock
    from dapo_mcore.utils.errors import RunLockError

    def refused(path, *args):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), str(path))

    monkeypatch.setattr(run_lock.os, "open", refused)
    with pytest.raises(RunLockError) as caught:
        run_lock.RunLock(tmp_path / "run").acquire()
    assert str(caught.value) == lock_line(tmp_path / "run", tmp_path / ".run.lock", os.strerror(getattr(errno, code))
                                          ).removeprefix("dapo-mcore: error: ")  # fmt: skip


def test_a_run_dir_under_a_regular_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    run_dir = tmp_path / "afile" / "sub" / "run"
    proc = cli(*run_args(run_dir, ckpt=tmp_path / "ckpt"), expect=2)
    assert last_line(proc).startswith(f"dapo-mcore: error: logging.run_dir {run_dir}: ")
    assert str(tmp_path / "afile") in last_line(proc) and "Traceback" not in proc.stderr


def test_a_config_yaml_that_cannot_be_written_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "config.yaml").mkdir(parents=True)  # a directory where the file goes: EISDIR at the real write
    proc = cli(*run_args(run_dir), expect=2)
    assert last_line(proc) == (f"dapo-mcore: error: logging.run_dir {run_dir}: cannot write {run_dir / 'config.yaml'} "
                               "(Is a directory); choose a logging.run_dir where this job can write")  # fmt: skip
    assert "Traceback" not in proc.stderr


def test_metrics_the_system_refuses_stop_the_run_with_one_line_naming_the_file(tmp_path):
    """A quota reached at step 2: the row of step 1 and the run lock's release are kept, no traceback."""
    run_dir = tmp_path / "run"
    proc = refusing("metrics.jsonl", "EDQUOT", 2, *run_args(run_dir), expect=2)
    assert last_line(proc) == (
        f"dapo-mcore: error: cannot write the metrics of step 2 to {run_dir / 'metrics.jsonl'} (Disk quota exceeded); "
        "the rows before it are kept, and so is every complete save: make room (or fix the mount), then run the "
        "same command again with checkpoint.resume=auto"
    )
    assert "Traceback" not in proc.stderr
    assert [r["step"] for r in read_rows(run_dir)] == [1]
    assert not (tmp_path / ".run.lock").exists()


def test_samples_and_curves_the_system_refuses_cost_a_warning_naming_the_file(tmp_path):
    """Optional output. curves.png refused at the run's end was a traceback, and the process never exited: the
    engine and the verifier workers were left open."""
    run_dir = tmp_path / "run"
    proc = refusing(".step_000001.jsonl.tmp", "ENOSPC", 1, *run_args(run_dir), expect=0)
    samples = run_dir / "samples"
    warning = f"step 1: the samples were not written ([Errno 28] No space left on device: '{samples}/.step_000001"
    assert warning + ".jsonl.tmp'); training on" in proc.stderr
    assert sorted(p.name for p in samples.iterdir()) == ["step_000002.jsonl"]  # no partial file
    proc = refusing("curves.png", "EROFS", 1, *run_args(tmp_path / "run2", "logging.plot=true"), expect=0,
                    timeout=120)  # fmt: skip
    assert f"the curves were not drawn to {tmp_path / 'run2' / 'curves.png'} (Read-only file system)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_save_the_system_refuses_is_one_line_naming_the_file(tmp_path):
    run_dir = tmp_path / "run"
    proc = refusing("*.distcp", "EDQUOT", 1, *run_args(run_dir, "checkpoint.save_interval=1"), expect=2)
    ckpt = tmp_path / "ckpt"
    assert last_line(proc).startswith(f"dapo-mcore: error: saving checkpoint {ckpt}/step_000001 failed: rank 0: ")
    assert f"Disk quota exceeded: '{ckpt}/.step_000001.tmp/__0_0.distcp'" in last_line(proc)
    assert "Traceback" not in proc.stderr and list(ckpt.iterdir()) == []


def test_check_refuses_a_run_directory_train_could_not_lock(tmp_path):
    """`check` says what train's lock would meet (a run directory under a regular file), nothing created."""
    (tmp_path / "afile").write_text("not a directory")
    run_dir = tmp_path / "afile" / "run"
    proc = cli("check", "examples/smoke_cpu.yaml", f"logging.run_dir={run_dir}", expect=2)
    assert f"logging.run_dir {run_dir}: cannot create its lock file" in proc.stderr
    assert "(Not a directory)" in proc.stderr and "Traceback" not in proc.stderr

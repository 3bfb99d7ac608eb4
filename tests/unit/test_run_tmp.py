"""A run's own temporary directory (utils/processes.adopt_run_tmp) holds what a run leaves behind when it is
killed, not the caches later runs reuse."""

from __future__ import annotations

import os
import tempfile

from dapo_mcore.utils import processes


def test_the_compile_cache_stays_in_the_system_temporary_directory(tmp_path, monkeypatch):
    """torch's compile cache defaults to <tempdir>/torchinductor_<user>: inside the run's directory, every run
    and resume compiled its graphs again."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(processes, "_SYSTEM_TMP", str(tmp_path / "system"))
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)  # adopt_run_tmp sets it; given back after
    monkeypatch.setenv("TMPDIR", os.environ.get("TMPDIR", "/tmp"))
    (tmp_path / "system").mkdir()
    run_tmp = processes.adopt_run_tmp(str(tmp_path / "run"), rank=0)
    assert tempfile.gettempdir() == os.environ["TMPDIR"] == str(run_tmp)
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert os.path.dirname(cache) == str(tmp_path / "system") and os.path.basename(cache).startswith("torchinductor_")

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == cache  # what torch compiles into


def test_a_users_own_compile_cache_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    processes.keep_caches_out_of_the_run_tmp()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_run_called_from_python_gives_the_temporary_directory_back(tmp_path, monkeypatch):
    """The suite calls `main(["train", ...])` in its workers: the TMPDIR a run adopted stayed, and every process
    started from that worker later (warm servers, torchrun, Slurm jobs) made its files in that run's directory,
    where the run directory of its own was not found."""
    monkeypatch.setattr(processes, "_SYSTEM_TMP", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with processes.run_tmp(str(tmp_path / "run"), rank=1) as path:
        assert os.environ["TMPDIR"] == tempfile.gettempdir() == str(path) and path.parent == tmp_path
    assert os.environ["TMPDIR"] == str(tmp_path) and tempfile.tempdir is None
    assert path.is_dir()  # removed at the process's exit (atexit), not here: wandb's exit handler may still use it


def test_a_second_start_into_a_live_runs_directory_leaves_the_live_runs_files_alone(tmp_path, monkeypatch):
    """A second run into a live run's directory (refused by the run lock after this) removed, at its exit, the
    temporary directory the live run was using: the live run failed at its next temporary file (seen in a suite
    run). The live owner here: this test's parent process."""
    monkeypatch.setattr(processes, "_SYSTEM_TMP", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    live = processes.run_tmp_of(str(tmp_path / "run"), rank=0)
    live.mkdir()
    (live / "pid").write_text(f"{os.getppid()}\n")
    (live / "in_use").write_text("the live run's file")
    killed = live.with_name(f"{live.name}-pid999999999")  # an earlier second start, killed: its owner is gone
    killed.mkdir()
    (killed / "pid").write_text("999999999\n")
    with processes.run_tmp(str(tmp_path / "run"), rank=0) as path:
        assert path == live.with_name(f"{live.name}-pid{os.getpid()}")
    assert (live / "in_use").exists() and (live / "pid").read_text() == f"{os.getppid()}\n"
    assert not killed.exists()

"""Saves damaged after they were written (same size, different bytes) are caught by their CRC-32: named by
`dapo-mcore checkpoint verify`, skipped by resume=auto for the newest intact save, refused when named."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dapo_mcore.checkpoint.model_checkpoint import verify_complete
from tests.e2e.test_checkpoints import reference, train_args, without_timings  # noqa: F401 (fixture)
from tests.e2e.test_train_cli import cli, read_rows


def flip_bytes(path: Path, count: int = 4096) -> None:
    """Overwrite up to `count` bytes in the middle of a file with their complement: same size, other bytes."""
    data = bytearray(path.read_bytes())
    start = len(data) // 4
    end = min(start + count, len(data))
    data[start:end] = bytes(b ^ 0xFF for b in data[start:end])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "common.pt"])
def test_same_size_damage_is_caught_and_resume_auto_falls_back_to_the_older_save(reference, tmp_path, name):  # noqa: F811
    run_dir = shutil.copytree(reference, tmp_path / "run")
    damaged = run_dir / "checkpoints" / "step_000006"
    size = (damaged / name).stat().st_size
    flip_bytes(damaged / name)
    assert (damaged / name).stat().st_size == size
    verify_complete(damaged)  # sizes alone cannot see it
    check = cli("checkpoint", "verify", str(run_dir), expect=2)
    assert f"DAMAGED  checkpoint {damaged} is damaged: {name} fails its CRC-32 check" in check.stdout
    assert check.stdout.count("ok ") == 2  # step_000002 and step_000004

    named = cli(*train_args(run_dir, f"checkpoint.resume={damaged}"), expect=2)
    assert (
        named.stderr.strip().splitlines()[-1]
        == f"dapo-mcore: error: checkpoint {damaged} is damaged: {name} fails its CRC-32 check"
    )

    resumed = cli(*train_args(run_dir, "checkpoint.resume=auto"))
    assert f"skipping step_000006: checkpoint {damaged} is damaged: {name} fails its CRC-32 check" in resumed.stderr
    assert "step_000004 at step 4" in resumed.stderr
    assert without_timings(read_rows(run_dir)) == without_timings(read_rows(reference))
    assert [p.name[:11] for p in (run_dir / "checkpoints" / "set_aside").iterdir()] == ["step_000006"]
    assert verify_complete(run_dir / "checkpoints" / "step_000006", checksums=True) > 0  # the new save, intact


def test_eval_refuses_a_damaged_save_unless_told_not_to_verify(reference, tmp_path):  # noqa: F811
    """Two swapped 8 KiB blocks of a shard (same size) were scored (avg@4 0.0000 against 0.1375 healthy)."""
    run_dir = shutil.copytree(reference, tmp_path / "run")
    damaged = run_dir / "checkpoints" / "step_000006"
    flip_bytes(damaged / "__0_0.distcp")
    args = ("eval", str(damaged), "--data", "examples/data/sums.jsonl", "--k", "1", "--max-new-tokens", "4")
    refused = cli(*args, expect=2)
    assert refused.stderr.strip().splitlines()[-1] == (
        f"dapo-mcore: error: checkpoint {damaged} is damaged: __0_0.distcp fails its CRC-32 check"
    )
    assert "converting" not in refused.stdout  # nothing read before the check
    cli(*args, "--no-verify")  # the user's choice: read as it is
    healthy = cli("eval", str(run_dir / "checkpoints" / "step_000004"), *args[2:])
    assert "files match their CRC-32 checksums" in healthy.stdout


def test_resume_auto_with_every_save_damaged_is_refused_not_started_over(reference, tmp_path):  # noqa: F811
    """It moved the run aside and retrained from step 0 with exit 0, the skips logged as warnings only."""
    run_dir = shutil.copytree(reference, tmp_path / "run")
    saves = sorted((run_dir / "checkpoints").glob("step_*"))
    flip_bytes(saves[-1] / "common.pt")  # the newest damaged (its checksum), the others cut short (no manifest)
    for save in saves[:-1]:
        (save / "MANIFEST.json").unlink()
    refused = cli(*train_args(run_dir, "checkpoint.resume=auto"), expect=2)
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dapo-mcore: error: checkpoint.resume=auto: none of the {len(saves)} saves in ")
    assert "set checkpoint.resume=none to start over" in last and "Traceback" not in refused.stderr
    assert run_dir.is_dir() and not list(tmp_path.glob("run.prev-*"))  # nothing moved aside
    checked = cli("check", *train_args(run_dir, "checkpoint.resume=auto")[1:], expect=2)
    # check verifies the CRC-32 of every file but the shards (a login node does not checksum terabytes): train's line
    assert f"  - {last.removeprefix('dapo-mcore: error: ')}" in checked.stderr.splitlines()
    (saves[-1] / "MANIFEST.json").unlink()  # every save cut short: check names them as train does
    checked = cli("check", *train_args(run_dir, "checkpoint.resume=auto")[1:], expect=2)
    assert f"  - checkpoint.resume=auto: none of the {len(saves)} saves in " in checked.stderr

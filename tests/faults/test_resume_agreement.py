"""`check` and `train` agree on every resume: over the same saves, `dapo-mcore check ... checkpoint.resume=auto`
says "ready to launch" exactly when `train ... checkpoint.resume=auto` resumes, and otherwise names the problem
in the very line train stops with. And a refusal that one rank alone meets at resume (the file of its engine
replica, its replica's groups) stops every rank alike: the same line, printed once, exit code 2 on every rank,
no traceback. It was rank 0's line (exit 2) and rank 1's gloo traceback ("Connection closed by peer", exit 1),
which torchrun then named as the root cause; and `check` said "ready to launch" of such saves, and of a
dp_reshardable save made at TP 2 resumed at TP 1, which train refuses.

The saves: a two-rank partial-rollout run saved after each of 3 steps, cut back to the newest save that holds
unfinished groups (each engine replica's in a file of its own), and a two-rank TP 2 run saved at step 2 in the
default optimizer format. Each case copies one and damages the copy. The two-rank resumes start each rank as a
process of its own (env://, as srun starts tasks), so that every rank's exit code and output are its own: a
launcher ends the other ranks once the first fails, and reports one code (torchrun's summary lists the ranks it
saw fail before it ended the others, and adds a traceback of its own).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dapo_mcore.checkpoint.model_checkpoint import file_crc32
from tests.conftest import free_port
from tests.e2e.test_train_cli import cli
from tests.warm_cli import cli_env, rank_environment, run_warm, start_warm

BASE = [
    "examples/smoke_cpu.yaml",
    "rollout.prompts_per_step=4",
    "rollout.gen_prompts_per_round=4",
    "trainer.mini_batch_size=32",
    "trainer.micro_batch_size=16",
    "logging.wandb.mode=disabled",
    "logging.progress=false",
    "logging.plot=false",
]
# partial rollout with 2x over-sampling: rounds stop at the step's groups with answers unfinished
PARTIAL = ["rollout.partial_rollout=true", "rollout.partial_oversample=2", "algorithm.mismatch.tis=token"]
RESUME = "checkpoint.resume=auto"
ERROR = "dapo-mcore: error: "


@dataclass(frozen=True)
class Saved:
    run_dir: Path
    step: int  # the save's: the newest in run_dir
    pending: str = ""  # a file of an engine replica's unfinished groups in it

    @property
    def save(self) -> Path:
        return self.run_dir / "checkpoints" / f"step_{self.step:06d}"


@pytest.fixture(scope="module")
def partial_save(tmp_path_factory) -> Saved:
    """A run directory of 2 ranks with partial rollout, 3 steps saved after each, cut back to the newest save that
    holds unfinished groups (in a file of their replica's: which replica and which step depend on the answers)."""
    run_dir = tmp_path_factory.mktemp("partial") / "run"
    cli("train", *BASE, *PARTIAL, "trainer.steps=3", "checkpoint.save_interval=1", "checkpoint.keep_last=3",
        f"logging.run_dir={run_dir}", ranks=2)  # fmt: skip
    saves = sorted((run_dir / "checkpoints").glob("step_*"), reverse=True)
    with_pending = [save for save in saves if list(save.glob("rollout_pending/*.pt"))]
    assert with_pending, "no save holds unfinished groups: the cases prove nothing"
    for later in saves[: saves.index(with_pending[0])]:
        shutil.rmtree(later)
    pending = min(with_pending[0].glob("rollout_pending/*.pt"))
    return Saved(run_dir, int(with_pending[0].name.removeprefix("step_")), str(pending.relative_to(with_pending[0])))


@pytest.fixture(scope="module")
def tp2_save(tmp_path_factory) -> Saved:
    """A run directory: TP 2, saved at step 2 in the default optimizer format (dp_reshardable)."""
    run_dir = tmp_path_factory.mktemp("tp2") / "run"
    cli("train", *BASE, "trainer.steps=2", "checkpoint.save_interval=2", "parallel.tensor_model_parallel_size=2",
        f"logging.run_dir={run_dir}", ranks=2)  # fmt: skip
    return Saved(run_dir, 2)


# ----- damaging a copy ----------------------------------------------------------------------------------------
def rewrite_manifest(save: Path, change: Callable[[dict], None]) -> None:
    manifest = json.loads((save / "MANIFEST.json").read_text())
    change(manifest["files"])
    (save / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))


def without_pending_file(save: Path, pending: str) -> None:
    """A replica's file deleted, and its manifest entry with it (a copy that left it out)."""
    (save / pending).unlink()
    rewrite_manifest(save, lambda files: files.pop(pending))


def with_an_edited_group(save: Path, pending: str) -> None:
    """A token id of a replica's groups edited by hand to -5, the manifest rewritten to match: only that replica's
    rank reads the file, halfway through the resume."""
    groups = torch.load(save / pending, weights_only=True)
    sample = next(s for g in groups for s in g["samples"] if len(s["response_ids"]))
    sample["response_ids"][0] = -5
    torch.save(groups, save / pending)
    size, crc = (save / pending).stat().st_size, file_crc32(save / pending)
    rewrite_manifest(save, lambda files: files.update({pending: {"bytes": size, "crc32": crc}}))


def with_a_damaged_pending_file(save: Path, pending: str) -> None:
    """One byte of a replica's file flipped in place (same size): its CRC-32 fails."""
    data = bytearray((save / pending).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (save / pending).write_bytes(bytes(data))


def with_a_damaged_manifest(save: Path, pending: str) -> None:
    (save / "MANIFEST.json").write_text('{"version": 1, "files": ')


def with_every_manifest_damaged(save: Path, pending: str) -> None:
    for each in save.parent.glob("step_*"):
        with_a_damaged_manifest(each, pending)


@dataclass(frozen=True)
class Case:
    source: str  # the fixture of the save copied
    damage: Callable[[Path, str], None] | None
    ranks: int
    extra: tuple[str, ...] = ()  # train's and check's settings beside BASE


CASES = {
    "intact": Case("partial_save", None, 2, tuple(PARTIAL)),
    "pending_file_missing": Case("partial_save", without_pending_file, 2, tuple(PARTIAL)),
    "pending_group_edited": Case("partial_save", with_an_edited_group, 2, tuple(PARTIAL)),
    "pending_file_damaged": Case("partial_save", with_a_damaged_pending_file, 2, tuple(PARTIAL)),
    "manifest_damaged": Case("partial_save", with_a_damaged_manifest, 2, tuple(PARTIAL)),
    "every_manifest_damaged": Case("partial_save", with_every_manifest_damaged, 2, tuple(PARTIAL)),
    # made at TP 2 in the default optimizer format, resumed at TP 1 (one process)
    "tp2_save_at_tp1": Case("tp2_save", None, 1),
}


# ----- running both -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ranks:
    """Each rank's exit code and output."""

    codes: list[int]
    stdout: list[str]
    stderr: list[str]

    @property
    def errors(self) -> list[str]:
        return [line for err in self.stderr for line in err.splitlines() if line.startswith("dapo-mcore: error")]


def train_on_every_rank(args: list[str], ranks: int, timeout: float = 300) -> Ranks:
    """`dapo-mcore train ARGS` as `ranks` processes of an env:// rendezvous on this host (srun's tasks; torchrun's
    workers get the same variables), each forked from a warm server of its rank's environment."""
    for _ in range(3):  # free_port's port may be taken before rank 0's store listens on it
        env = {**cli_env(), "MASTER_PORT": str(free_port())}
        if ranks == 1:
            procs = [start_warm(["train", *args], env, timeout)]
        else:
            procs = [start_warm(["train", *args], {**env, **rank_environment(rank, ranks)}, timeout)
                     for rank in range(ranks)]  # fmt: skip
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
        if not any("EADDRINUSE" in err for _, err in outputs):
            break
    return Ranks([proc.returncode for proc in procs], [out for out, _ in outputs], [err for _, err in outputs])


def check(args: list[str], ranks: int) -> subprocess.CompletedProcess:
    return run_warm(["check", args[0], "--gpus", str(ranks), *args[1:]], cli_env(), 300)


def problems_listed(proc: subprocess.CompletedProcess) -> list[str]:
    """check's problems, one a line ("  - ..." under "the run would not start"); [] when it is ready to launch."""
    if proc.returncode == 0:
        assert "is ready to launch" in proc.stdout, proc.stdout + proc.stderr
        return []
    text = proc.stderr
    assert proc.returncode == 2 and "the run would not start" in text, proc.stdout + text
    return [line.removeprefix("  - ") for line in text.split("the run would not start", 1)[1].splitlines()[1:]]


@dataclass(frozen=True)
class Outcome:
    saved: Saved  # the copy's
    checked: subprocess.CompletedProcess
    trained: Ranks


@pytest.fixture(scope="module")
def outcome(request, tmp_path_factory) -> Callable[[str], Outcome]:
    """check and train of a case's copy (each once a module)."""
    done: dict[str, Outcome] = {}

    def of(name: str) -> Outcome:
        if name not in done:
            case, source = CASES[name], request.getfixturevalue(CASES[name].source)
            saved = Saved(tmp_path_factory.mktemp(name) / "run", source.step, source.pending)
            shutil.copytree(source.run_dir, saved.run_dir)
            if case.damage is not None:
                case.damage(saved.save, saved.pending)
            steps = f"trainer.steps={saved.step + 1}"
            args = [*BASE, *case.extra, steps, "checkpoint.save_interval=0", f"logging.run_dir={saved.run_dir}", RESUME]
            checked = check(args, case.ranks)  # first: train changes the run directory
            done[name] = Outcome(saved, checked, train_on_every_rank(args, case.ranks))
        return done[name]

    return of


# ----- the tests ----------------------------------------------------------------------------------------------
def test_a_refusal_one_rank_meets_at_resume_stops_every_rank_with_the_same_line(outcome, partial_save):
    """A replica's file of unfinished groups gone from a two-rank save (with its manifest entry): its rank refused
    in one line and the other, whose replica's groups were not in it, went on into the next collective and died
    with gloo's traceback (exit 1). Now every rank refuses before loading weights, with the same line."""
    found = outcome("pending_file_missing")
    saved, ranks = found.saved, found.trained
    groups = len(torch.load(partial_save.save / saved.pending, weights_only=True))
    replica = int(saved.pending.split("replica_")[1][:5])
    assert ranks.codes == [2, 2], ranks.stderr
    assert ranks.errors == [  # printed once, by rank 0
        f"{ERROR}checkpoint {saved.save}: its run state lists {groups} unfinished group{'s' * (groups != 1)} of "
        f"engine replica {replica} in {saved.pending}, a file the save does not hold (not on disk, not in its "
        "manifest); restore it from a copy of the save, or resume an earlier save (checkpoint.resume=PATH)"
    ], ranks.stderr
    for err in ranks.stderr:
        assert "Traceback" not in err and "Connection closed" not in err, err


def test_under_torchrun_every_rank_ends_with_the_refusals_exit_code(partial_save, tmp_path):
    """The same save under a real torchrun, whose summary lists each failed rank's exit code: 2 for both (rank 1,
    still tearing down when torchrun sent its closing SIGTERM, was listed as -15; before, as the root cause with
    exit 1). The only traceback left is torchrun's own ChildFailedError."""
    run_dir = shutil.copytree(partial_save.run_dir, tmp_path / "run")
    without_pending_file(run_dir / "checkpoints" / partial_save.save.name, partial_save.pending)
    args = [*BASE, *PARTIAL, f"trainer.steps={partial_save.step + 1}", f"logging.run_dir={run_dir}", RESUME]
    launcher = ("-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}")
    proc = cli("train", *args, launcher=launcher, expect=1)  # torchrun's code when a worker fails
    found = re.findall(r"rank\s+: (\d) \(local_rank: \d\)\n\s+exitcode\s+: (-?\d+)", proc.stderr)
    assert sorted(found) == [("0", "2"), ("1", "2")], proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dapo-mcore: error")]
    assert len(errors) == 1 and f"in {partial_save.pending}, a file the save does not hold" in errors[0], errors
    assert "Connection closed" not in proc.stderr and "[rank" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") == 1 and "ChildFailedError" in proc.stderr, proc.stderr[-3000:]


def test_a_refusal_one_rank_meets_halfway_through_the_resume_is_every_ranks(outcome):
    """A group of a replica edited by hand (the manifest rewritten to match): only that replica's rank reads the
    file, after the weights are loaded; every rank stops with its line."""
    found = outcome("pending_group_edited")
    ranks = found.trained
    assert ranks.codes == [2, 2], ranks.stderr
    assert len(ranks.errors) == 1 and f"in {found.saved.pending} (prompt " in ranks.errors[0], ranks.stderr
    assert ranks.errors[0].endswith(": token id -5 (ids are >= 0)"), ranks.stderr
    for err in ranks.stderr:
        assert "Traceback" not in err and "Connection closed" not in err, err


@pytest.mark.parametrize("name", list(CASES))
def test_check_and_train_agree_on_the_resume(outcome, name):
    """Both accept, or both refuse with the same line."""
    found = outcome(name)
    listed, ranks = problems_listed(found.checked), found.trained
    refused = [line.removeprefix(ERROR) for line in ranks.errors]
    assert listed == refused, f"check: {found.checked.stdout}{found.checked.stderr}\ntrain: {ranks.stderr}"
    if listed:
        assert ranks.codes == [2] * CASES[name].ranks, ranks.stderr
        assert not any("Traceback" in err for err in ranks.stderr), ranks.stderr
    else:  # and from the same save (a damaged newest one skipped by both)
        assert ranks.codes == [0] * CASES[name].ranks, ranks.stderr
        save, step = re.search(r"resumes (\S+) at step (\d+) of ", found.checked.stdout).groups()
        assert f"resuming from {save} at step {step}" in ranks.stderr[0]
        if CASES[name].damage is None:
            assert (save, int(step)) == (str(found.saved.save), found.saved.step)
        else:
            assert int(step) < found.saved.step and f"skipping {found.saved.save.name}: " in ranks.stderr[0]

"""Run checkpoints through the command line: exact resume after SIGKILL, saves cut short, layout changes."""

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

from dapo_mcore.checkpoint.model_checkpoint import read_format, verify_complete
from dapo_mcore.checkpoint.run_checkpoint import find_latest_complete
from dapo_mcore.utils.errors import CheckpointError
from tests.conftest import REPO
from tests.e2e.test_train_cli import SHORT, cli, read_rows
from tests.warm_cli import cli_env, run_warm, start_warm

STEPS = 6
# Saves after steps 2, 4 and 6 (step_000002 ... step_000006: the next step to run), all three kept.
SAVING = [
    *SHORT,
    f"trainer.steps={STEPS}",
    "checkpoint.save_interval=2",
    "checkpoint.keep_last=3",
    "logging.wandb.mode=disabled",
    "logging.progress=false",
]


def train_args(run_dir: Path, *extra: str) -> list[str]:
    return ["train", "examples/smoke_cpu.yaml", *SAVING, f"logging.run_dir={run_dir}", *extra]


def without_timings(rows: list[dict]) -> list[dict]:
    # wall-clock times and memory readings differ between runs; every other metric must be identical
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "memory/"))} for row in rows]


def hf_weights(export_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for shard in sorted(export_dir.glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


@pytest.fixture
def reference(checkpoint_reference) -> Path:
    """An uninterrupted run of STEPS steps that saves every 2 steps and exports HF weights at the end
    (tests/conftest.py: made once per session, shared with tests/faults/test_damaged_saves.py)."""
    return checkpoint_reference


def run_until_killed(run_dir: Path, kill_after_rows: int, *extra: str) -> list[int]:
    """Start a run (in a process group of its own, forked from a warm server: tests/warm_cli.py) and SIGKILL the
    whole group, as Slurm does at the time limit, as soon as `kill_after_rows` steps are logged: the run is then
    in the middle of the next step (or, on a loaded machine, one more was logged first). The steps it logged."""
    proc = start_warm(train_args(run_dir, "checkpoint.hf_export_interval=3", *extra), cli_env(), timeout=300)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after_rows:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, (
        f"the run ended on its own ({proc.returncode}): " + proc.communicate()[1][-3000:]
    )
    return [row["step"] for row in read_rows(run_dir)]


@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_a_run_killed_mid_step_resumes_to_identical_metrics_and_weights(reference, tmp_path, save_mode):
    run_dir = tmp_path / "run"
    mode = [f"checkpoint.async_save={save_mode == 'async'}"]
    logged = run_until_killed(run_dir, 5, *mode)  # killed during step 6
    assert not (run_dir / "checkpoints" / "step_000006").exists()
    proc = cli(*train_args(run_dir, "checkpoint.resume=auto", "checkpoint.hf_export_interval=3", *mode))
    # the newest save is step_000004; a background save of it may not have been completed before the kill
    resumed_at = int(re.search(r"step_00000\d at step (\d)", proc.stderr).group(1))
    assert resumed_at == 4 or (save_mode == "async" and resumed_at == 2)
    # every step's metrics equal the uninterrupted run's, exactly (CPU, fp32, deterministic)
    assert without_timings(read_rows(run_dir)) == without_timings(read_rows(reference))
    rolled_back = [
        json.loads(line)["step"] for line in (run_dir / "metrics.rolled_back.jsonl").read_text().splitlines()
    ]
    # logged before the kill, run again after the resume (a suite run at a load average of 30 logged step 6 too)
    assert rolled_back == [step for step in logged if step > resumed_at] and rolled_back[0] == resumed_at + 1
    want, got = hf_weights(reference / "checkpoints/hf/step_000006"), hf_weights(run_dir / "checkpoints/hf/step_000006")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


# Partial rollout with 2x over-sampling: rounds stop at the step's 4 kept groups, with answers unfinished.
PARTIAL = ["rollout.partial_rollout=true", "rollout.gen_prompts_per_round=8"]


def test_a_run_killed_with_unfinished_answers_saved_continues_them_to_identical_metrics(tmp_path):
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    cli(*train_args(reference, *PARTIAL))
    rows = read_rows(reference)
    assert rows[3]["rollout/unfinished_groups"] > 0  # step 4, whose save holds unfinished answers
    assert rows[4]["rollout/continued_answers"] > 0  # and step 5 continues them
    run_until_killed(run_dir, 5, *PARTIAL)  # killed during step 6
    proc = cli(*train_args(run_dir, "checkpoint.resume=auto", *PARTIAL))
    assert "step_000004 at step 4" in proc.stderr
    assert without_timings(read_rows(run_dir)) == without_timings(rows)


def damage(save: Path, how: str) -> str:
    """Cut a save short the way a killed job or a full disk does; returns what the error must say."""
    if how == "missing_shard":
        next(save.glob("*.distcp")).unlink()
        return r"incomplete: __\d+_\d+\.distcp is missing"
    if how == "truncated_file":
        shard = next(save.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return r"damaged: __\d+_\d+\.distcp has \d+ bytes, the manifest says \d+"
    if how == "missing_metadata":
        (save / ".metadata").unlink()
        return r"incomplete: \.metadata is missing"
    if how == "no_manifest":  # killed before the save finished
        (save / "MANIFEST.json").unlink()
        return r"incomplete: no MANIFEST.json \(the save did not finish\)"
    raise ValueError(how)


@pytest.mark.parametrize("how", ["missing_shard", "truncated_file", "missing_metadata", "no_manifest"])
def test_a_save_cut_short_is_named_and_the_previous_complete_one_is_found(reference, tmp_path, how):
    root = shutil.copytree(reference / "checkpoints", tmp_path / "checkpoints")
    verify_complete(root / "step_000006")
    message = damage(root / "step_000006", how)
    with pytest.raises(CheckpointError, match=message):
        verify_complete(root / "step_000006")
    assert find_latest_complete(root) == root / "step_000004"  # `latest` names step_000006: skipped


def test_resume_auto_falls_back_past_a_damaged_save_and_a_named_one_is_an_error(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    damage(run_dir / "checkpoints" / "step_000006", "truncated_file")
    proc = cli(*train_args(run_dir, "checkpoint.resume=auto"))
    assert "skipping step_000006" in proc.stderr and "step_000004 at step 4" in proc.stderr
    assert without_timings(read_rows(run_dir)) == without_timings(read_rows(reference))
    # the damaged later save was moved aside (kept, never pruned), and the new step_000006 is `latest`
    assert [p.name[:11] for p in (run_dir / "checkpoints" / "set_aside").iterdir()] == ["step_000006"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000006"
    verify_complete(run_dir / "checkpoints" / "step_000006")
    damaged = run_dir / "checkpoints" / "step_000006"
    shutil.rmtree(damaged)
    shutil.copytree(reference / "checkpoints" / "step_000006", damaged)
    damage(damaged, "missing_shard")
    proc = cli(*train_args(tmp_path / "other", f"checkpoint.resume={damaged}"), expect=2)
    assert "Traceback" not in proc.stderr and "is incomplete" in proc.stderr and "is missing" in proc.stderr
    # a fresh run pointed at another run's saves refuses rather than pruning them
    proc = cli(*train_args(tmp_path / "third", f"checkpoint.dir={run_dir / 'checkpoints'}"), expect=2)
    assert "holds saves of an earlier run" in proc.stderr


def test_a_save_at_dp2_resumes_at_dp1_as_the_canonical_format_does_and_another_tp_is_refused(tmp_path):
    """The default optimizer format (dp_reshardable: each rank writes and reads its own share, nothing gathered)
    reloads at another data-parallel size into the state the canonical per-parameter format (fully_reshardable)
    gives: the same run saved both ways at DP 2 and resumed at DP 1 takes the same next step. At another TP it
    cannot reload, and says so in one line before reading the shards."""
    resumed = {}
    for optimizer_format in ("dp_reshardable", "fully_reshardable"):
        saved_dir, resumed_dir = tmp_path / f"{optimizer_format}-dp2", tmp_path / f"{optimizer_format}-dp1"
        cli(*train_args(saved_dir, "trainer.steps=2", f"checkpoint.optimizer_format={optimizer_format}"), ranks=2)
        save = saved_dir / "checkpoints" / "step_000002"
        assert read_format(save)["optimizer_format"] == optimizer_format
        # Megatron's fully parallel save: the weights both ranks hold are written half by each (observed 1.20 and
        # 1.19 MB here; without it the first rank wrote them all: 1.50 against 0.89 MB)
        written = [sum(f.stat().st_size for f in save.glob(f"__{rank}_*.distcp")) for rank in (0, 1)]
        if optimizer_format == "dp_reshardable":  # (the other gathers the optimizer state onto the first rank)
            assert min(written) > 0.8 * max(written), written
        proc = cli(*train_args(resumed_dir, "trainer.steps=3", f"checkpoint.resume={save}"))
        assert "saved at layout {'tp': 1, 'pp': 1, 'vpp': 1, 'dp': 2}" in proc.stderr
        (resumed[optimizer_format],) = read_rows(resumed_dir)
    shards, canonical = resumed["dp_reshardable"], resumed["fully_reshardable"]
    assert shards["step"] == canonical["step"] == 3
    for key in ("rollout/accuracy", "rollout/response_len_mean", "dynamic_sampling/kept_groups"):
        assert shards[key] == canonical[key], key
    # Adam's moments and the master weights restored from two shards, or from the gathered canonical form
    for key in ("loss/policy", "actor/grad_norm", "actor/entropy", "actor/update_norm"):
        if key in canonical:
            assert shards[key] == pytest.approx(canonical[key], rel=1e-6), key
    refused = cli(
        *train_args(tmp_path / "tp2", "parallel.tensor_model_parallel_size=2",
                    f"checkpoint.resume={tmp_path / 'dp_reshardable-dp2' / 'checkpoints' / 'step_000002'}"),
        ranks=2,
        expect=2,
    )  # fmt: skip
    assert "checkpoint.optimizer_format=dp_reshardable" in refused.stderr
    assert "'tp': 2" in refused.stderr and "Traceback" not in refused.stderr


def test_a_save_at_tp2_resumes_at_pp2_with_the_same_next_step(tmp_path):
    ref_dir, moved_dir = tmp_path / "tp2", tmp_path / "pp2"
    cli(
        *train_args(
            ref_dir, "trainer.steps=3", "parallel.tensor_model_parallel_size=2",
            "checkpoint.optimizer_format=fully_reshardable",  # reloads at any layout
        ),
        ranks=2,
    )  # fmt: skip
    save = ref_dir / "checkpoints" / "step_000002"
    proc = cli(
        *train_args(
            moved_dir, "trainer.steps=3", "parallel.pipeline_model_parallel_size=2", f"checkpoint.resume={save}"
        ),
        ranks=2,
    )
    assert "saved at layout {'tp': 2, 'pp': 1" in proc.stderr
    # both two-rank runs trained (the CLI at TP 2 and at PP 2; under a real torchrun: faults/test_preflight.py,
    # dist/test_dead_rank.py, the Slurm tier's torchrun across hosts) and recorded their layout
    for run_dir, layout in ((ref_dir, (2, 1)), (moved_dir, (1, 2))):
        assert all(row["actor/train_tokens"] > 0 for row in read_rows(run_dir))
        parallel = yaml.safe_load((run_dir / "config.yaml").read_text())["parallel"]
        assert (parallel["tensor_model_parallel_size"], parallel["pipeline_model_parallel_size"]) == layout
    (resumed,) = read_rows(moved_dir)
    reference = read_rows(ref_dir)[2]
    assert resumed["step"] == 3
    # the same rollouts (sampled from weights equal to ~1e-8), so the same batch
    for key in ("rollout/accuracy", "rollout/response_len_mean", "dynamic_sampling/kept_groups"):
        assert resumed[key] == reference[key], key
    # Observed: 4e-8 relative on the loss (TP and PP sum in different orders). Tolerance 1e-5.
    for key in ("loss/policy", "actor/grad_norm", "actor/entropy"):
        assert resumed[key] == pytest.approx(reference[key], rel=1e-5), key


def test_training_from_a_converted_checkpoint_equals_training_from_the_hf_directory(tmp_path):
    convert = ["examples/models/tiny-arith", str(tmp_path / "mcore")]  # the tool forks from the warm server
    proc = run_warm(convert, cli_env(), 300, script=REPO / "tools/convert_hf_to_mcore.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    one_step = ["trainer.steps=1", "checkpoint.save_interval=0"]
    cli(*train_args(tmp_path / "hf", *one_step))
    cli(*train_args(tmp_path / "mc", *one_step, "model.init=mcore", f"model.mcore_path={tmp_path / 'mcore'}"))
    assert without_timings(read_rows(tmp_path / "mc")) == without_timings(read_rows(tmp_path / "hf"))


def test_eval_takes_a_run_directory_and_converts_its_newest_save(reference, tmp_path):
    out = tmp_path / "eval.json"
    cli("eval", str(reference), "--data", "examples/data/sums.jsonl", "--k", "2", "--max-new-tokens", "16",
        "--out", str(out))  # fmt: skip
    results = json.loads(out.read_text())
    assert results["converted_from"] == str(reference / "checkpoints" / "step_000006")
    assert results["files"]["examples/data/sums.jsonl"]["problems"] == 20


def test_an_attempt_whose_job_ends_before_a_step_and_a_save_stops_at_once_instead_of_requeueing(tmp_path):
    """Under Slurm a resumed attempt knows what a step takes (metrics.jsonl): when the job ends before one step
    and a save could, it says so in one line and exits 2, which the batch script does not re-queue. (It stopped
    with nothing saved and exit 75: re-queued, to stop the same way, for ever.)"""
    run_dir = tmp_path / "run"
    cli(*train_args(run_dir, "trainer.steps=2"))
    job = {"SLURM_JOB_ID": "4242", "SLURM_JOB_END_TIME": str(int(time.time()) + 60)}  # 60 s < margin 120 s
    proc = run_warm(train_args(run_dir, "trainer.steps=4", "checkpoint.resume=auto"), {**cli_env(), **job}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "stopping before the first step of this attempt: the job's time limit (a step of up to" in proc.stderr
    assert "resubmit with a longer --time" in proc.stderr and "Traceback" not in proc.stderr
    assert [row["step"] for row in read_rows(run_dir)] == [1, 2]  # nothing trained, nothing lost

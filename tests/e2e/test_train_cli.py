"""Whole runs through the command line, as a user starts them (single process and under torchrun)."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo_mcore.config import load_config
from dapo_mcore.config.presets import COMPONENTS_OFF
from tests.conftest import REPO, run_ranks
from tests.warm_cli import cli_env, run_warm

REQUIRED_METRICS = (
    "step",
    "rollout/accuracy",
    "rollout/reward_mean",
    "rollout/response_len_mean",
    "dynamic_sampling/kept_groups",
    "dynamic_sampling/rounds",
    "loss/policy",
    "actor/clip_frac_high",
    "actor/clip_frac_low",
    "actor/entropy",
    "actor/grad_norm",
    "actor/padding_efficiency",
    "time/step_s",
    "mismatch/abs_logp_diff_max",
    "mismatch/k3_kl",
    "memory/after_generate_gb",
    "memory/after_update_gb",
)
# A short run of the demo recipe: 3 steps of 4 prompts x 8 samples.
SHORT = [
    "trainer.steps=3",
    "rollout.prompts_per_step=4",
    "rollout.gen_prompts_per_round=4",
    "trainer.mini_batch_size=16",
    "trainer.micro_batch_size=16",
    "checkpoint.save_interval=0",  # tests/e2e/test_checkpoints.py covers saving
    "logging.plot=false",  # about 1.3 CPU-s a drawing; the demo and validation tests draw curves.png
]


def cli(*args, launcher=(), ranks=0, timeout=600, expect=0, fresh=False):
    """`python [launcher] -m dapo_mcore.cli ARGS`; runs fork from a warm server (tests/warm_cli.py) unless `fresh`
    (the test is about the command's own start and exit) or `launcher` (a real torchrun: the test is about it).
    `ranks`: that many ranks on this host, as `torchrun --nproc_per_node=ranks` starts them."""
    env = cli_env()
    if ranks:
        proc = run_ranks(list(args), ranks, timeout, env)
    elif launcher or fresh:
        cmd = [sys.executable, *launcher, "-m", "dapo_mcore.cli", *args]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    else:
        proc = run_warm(list(args), env, timeout)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_demo_recipe_writes_config_metrics_plot_and_offline_wandb(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SHORT, "logging.plot=true", f"logging.run_dir={run_dir}"]
    proc = cli("train", "examples/smoke_cpu.yaml", *args, fresh=True)
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]  # updates done
    for row in rows:
        assert set(REQUIRED_METRICS) <= set(row), set(REQUIRED_METRICS) - set(row)
        assert 0.0 <= row["rollout/accuracy"] <= 1.0 and row["dynamic_sampling/kept_groups"] <= 4
        assert 0.0 < row["actor/padding_efficiency"] <= 1.0  # packed rows: the fullest row rounded up to 8
        # The engine samples with the weights pushed after the last update: fresh samples' log-probs agree
        # with the actor's to fp32 round-off (observed ~1e-7). A stale or partial push shows up here.
        assert row["mismatch/abs_logp_diff_mean"] < 1e-5 and abs(row["mismatch/ratio_max"] - 1) < 1e-3
    resolved = load_config(run_dir / "config.yaml")
    assert resolved.trainer.steps == 3 and resolved == load_config("examples/smoke_cpu.yaml", args)
    assert (run_dir / "curves.png").stat().st_size > 10_000
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb offline run missing"
    assert "step 3/3" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr  # also none at exit (wandb's exit handler needs its service process)


def test_rerun_into_the_same_directory_keeps_the_earlier_run(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "train",
        "examples/smoke_cpu.yaml",
        *SHORT,
        "trainer.steps=1",
        f"logging.run_dir={run_dir}",
        "logging.wandb.mode=disabled",
    ]
    cli(*args)
    cli(*args)
    kept = list(tmp_path.glob("run.prev-*"))
    assert len(kept) == 1 and (kept[0] / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").exists()


def test_steps_count_updates_done_in_the_console_metrics_saves_and_a_finished_rerun(tmp_path):
    """One convention: step N = N updates done. The console counted from 1, metrics.jsonl from 0, the saves and
    stop messages in updates done; a finished run started again said "run finished" though nothing ran."""
    run_dir = tmp_path / "run"
    args = ["train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=2", "checkpoint.save_interval=1",
            f"logging.run_dir={run_dir}", "logging.wandb.mode=disabled", "logging.progress=false"]  # fmt: skip
    first = cli(*args)
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2]
    assert "step 1/2 | " in first.stderr and "step 2/2 | " in first.stderr and "step 0/2" not in first.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]
    assert f"dapo-mcore: run finished: step 1-2 trained; metrics and config in {run_dir}" in first.stdout
    assert not (run_dir / "curves.png").exists()  # logging.plot=false (SHORT)
    again = cli(*args, "checkpoint.resume=auto")
    assert f"dapo-mcore: nothing to train: {run_dir} is at step 2 already" in again.stdout
    assert [r["step"] for r in read_rows(run_dir)] == [1, 2]


# Two-process runs under torchrun: TP 2 and PP 2 in tests/e2e/test_checkpoints.py (a save at TP 2 resumed at PP 2),
# DP 2 in test_validation_is_split_over_data_parallel_engine_replicas_with_partial_rollout below.


@pytest.mark.parametrize("component", sorted(COMPONENTS_OFF))
def test_smoke_recipe_runs_with_each_dapo_component_off(tmp_path, component):
    run_dir = tmp_path / "run"
    cli(
        "train",
        "examples/smoke_cpu.yaml",
        *SHORT,
        "trainer.steps=2",
        *COMPONENTS_OFF[component],
        f"logging.run_dir={run_dir}",
        "logging.wandb.mode=disabled",
    )
    rows = read_rows(run_dir)
    assert len(rows) == 2 and all(r["actor/train_tokens"] > 0 for r in rows)
    resolved = load_config(run_dir / "config.yaml")
    assert resolved == load_config(
        "examples/smoke_cpu.yaml",
        COMPONENTS_OFF[component]
        + SHORT
        + ["trainer.steps=2", f"logging.run_dir={run_dir}", "logging.wandb.mode=disabled"],
    )
    if component == "dynamic_sampling":
        assert "dynamic_sampling/all_correct_groups" not in rows[0]


@pytest.mark.parametrize(
    ("policy_loss", "tis", "metric"),
    [("gspo", "sequence", "mismatch/tis_weight_mean"), ("cispo", "token_reject", "mismatch/token_masked_frac"),
     ("sapo", "token", "mismatch/tis_weight_mean")],
)  # fmt: skip
def test_each_policy_loss_trains_with_a_rollout_correction(tmp_path, policy_loss, tis, metric):
    run_dir = tmp_path / "run"
    cli("train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=2", f"algorithm.policy_loss={policy_loss}",
        f"algorithm.mismatch.tis={tis}", f"logging.run_dir={run_dir}", "logging.wandb.mode=disabled")  # fmt: skip
    rows = read_rows(run_dir)
    assert len(rows) == 2 and all(r["actor/train_tokens"] > 0 and r["actor/grad_norm"] > 0 for r in rows), rows
    assert all(math.isfinite(r["loss/policy"]) and metric in r for r in rows), rows
    assert load_config(run_dir / "config.yaml").algorithm.policy_loss == policy_loss


def test_round_cap_continues_by_default_and_stops_cleanly_in_strict_mode(tmp_path):
    common = [
        "train",
        "examples/smoke_cpu.yaml",
        *SHORT,
        "trainer.steps=2",
        "logging.wandb.mode=disabled",
        "algorithm.dynamic_sampling.filter=tests.verifiers:drop_every_group",
        "algorithm.dynamic_sampling.max_rounds=2",
    ]
    proc = cli(*common, f"logging.run_dir={tmp_path}/lenient")
    rows = read_rows(tmp_path / "lenient")
    assert [(r["dynamic_sampling/kept_groups"], r["dynamic_sampling/cap_hit"]) for r in rows] == [(0.0, 1.0)] * 2
    assert "no group to train on" in proc.stderr
    proc = cli(*common, f"logging.run_dir={tmp_path}/strict", "algorithm.dynamic_sampling.on_cap=error", expect=2)
    assert "Traceback" not in proc.stderr
    assert "dapo-mcore: error: step 1: dynamic sampling kept 0 of 4 groups after 2 rounds" in proc.stderr


def test_a_reward_check_that_never_returns_does_not_hang_the_run(tmp_path):
    run_dir = tmp_path / "run"
    cli(
        "train",
        "examples/smoke_cpu.yaml",
        *SHORT,
        "trainer.steps=1",
        "rollout.prompts_per_step=2",  # 16 answers: 12 checks time out (4 prompts: 87, 20 s of timeouts)
        "rollout.gen_prompts_per_round=2",
        f"logging.run_dir={run_dir}",
        "logging.wandb.mode=disabled",
        "algorithm.reward.verifier=tests.verifiers:hang_on_hmm",
        "algorithm.reward.timeout_s=0.5",
        "algorithm.reward.workers=4",
        timeout=300,
    )
    (row,) = read_rows(run_dir)
    assert row["reward/timeouts"] > 0  # the demo model pads some answers with "hmm, "


def test_kl_penalty_builds_a_reference_model_only_when_beta_is_positive(tmp_path):
    common = ["train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=2", "logging.wandb.mode=disabled"]
    proc = cli(*common, f"logging.run_dir={tmp_path}/kl", "algorithm.kl.beta=0.1", "algorithm.kl.estimator=mse")
    assert "reference model built" in proc.stderr
    rows = read_rows(tmp_path / "kl")
    # two updates per step: the reference equals the policy only before the first one
    assert 0.0 < rows[0]["actor/kl"] < rows[1]["actor/kl"]
    proc = cli(*common, f"logging.run_dir={tmp_path}/nokl")
    assert "no reference model" in proc.stderr and "actor/kl" not in read_rows(tmp_path / "nokl")[0]


def test_offloading_the_actor_while_generating_changes_no_metric(tmp_path):
    """rollout.offload_actor frees the DDP grad buffers and moves the optimizer moments to the host during
    generation and restores them for the update: the run must be the same step for step (CPU, fp32)."""
    runs = {}
    for offload in (False, True):
        run_dir = tmp_path / f"offload-{offload}"
        args = [*SHORT, "logging.wandb.mode=disabled", f"logging.run_dir={run_dir}"]
        cli("train", "examples/smoke_cpu.yaml", *args, f"rollout.offload_actor={str(offload).lower()}")
        runs[offload] = [
            {k: v for k, v in row.items() if not k.startswith(("time/", "memory/"))} for row in read_rows(run_dir)
        ]
    assert runs[True] == runs[False] and len(runs[True]) == 3


def test_validation_during_training_logs_held_out_metrics_and_draws_them(tmp_path):
    run_dir, held_out = tmp_path / "run", tmp_path / "held.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"What is {a}+{a + 2}?\n", "answer": 2 * a + 2}) + "\n"
                                for a in range(4)))  # fmt: skip
    evaluation = [
        f"data.eval_files={held_out}",
        "trainer.eval_interval=2",
        "trainer.eval_k=4",
        "trainer.eval_top_p=1.0",
    ]
    cli("train", "examples/smoke_cpu.yaml", *SHORT, *evaluation, "logging.plot=true", f"logging.run_dir={run_dir}")
    rows = read_rows(run_dir)
    with_eval = [r["step"] for r in rows if "eval/held/avg@4" in r]
    assert with_eval == [0, 2, 3]  # before the first update, every 2 steps, and the trained weights
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "rollout/accuracy" not in rows[0]  # row 0: eval only
    assert all(r["eval/held/problems"] == 4 and 0 <= r["eval/held/pass@1"] <= r["eval/held/pass@4"] <= 1
               for r in rows if "eval/held/avg@4" in r)  # fmt: skip
    assert (run_dir / "curves.png").stat().st_size > 0
    # the validation measures what `dapo-mcore eval` measures: same model, answers, seeds and metrics at step 0
    out = tmp_path / "eval.json"
    cli("eval", "examples/models/tiny-arith", "--data", str(held_out), "--k", "4", "--top-p", "1.0",
        "--max-new-tokens", "32", "--out", str(out))  # fmt: skip
    standalone = json.loads(out.read_text())["files"][str(held_out)]
    assert {k: rows[0][f"eval/held/{k}"] for k in standalone} == pytest.approx(standalone)


def test_validation_is_split_over_data_parallel_engine_replicas_with_partial_rollout(tmp_path):
    """Two processes at DP 2 (one run for both): two engine replicas, each holding its own unfinished groups
    and writing them into the save, resumed by one process (one replica, which continues them all); and the
    held-out validation split over the replicas."""
    run_dir, held_out = tmp_path / "run", tmp_path / "held.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"What is {a}+1?\n", "answer": a + 1}) + "\n" for a in range(5)))
    evaluation = [f"data.eval_files={held_out}", "trainer.eval_interval=2", "trainer.eval_k=2"]
    partial = ["rollout.partial_rollout=true", "rollout.gen_prompts_per_round=8", "checkpoint.save_interval=2"]
    common = ["train", "examples/smoke_cpu.yaml", *SHORT, *evaluation, *partial, f"logging.run_dir={run_dir}",
              "logging.wandb.mode=disabled"]  # fmt: skip
    cli(*common, "trainer.steps=2", ranks=2)
    rows = read_rows(run_dir)
    training = [r for r in rows if "actor/train_tokens" in r]
    assert len(training) == 2 and all(r["actor/train_tokens"] > 0 for r in training)
    assert all(r["dynamic_sampling/kept_groups"] == 4 and "rollout/unfinished_groups" in r for r in training)
    assert [r["step"] for r in rows if "eval/held/avg@2" in r] == [0, 2]
    assert all(r["eval/held/problems"] == 5 for r in rows if "eval/held/avg@2" in r)  # an odd count over 2 replicas
    pending = int(training[-1]["rollout/unfinished_groups"])
    files = sorted((run_dir / "checkpoints/step_000002/rollout_pending").glob("*.pt"))  # one a replica holding any
    assert sum(len(torch.load(f, weights_only=True)) for f in files) == pending
    assert len(files) <= 2 and all(f.name.endswith("_of_00002.pt") for f in files)
    print("pending groups at the save:", pending)
    cli(*common, "trainer.steps=3", "checkpoint.resume=auto", ranks=1)
    resumed = read_rows(run_dir)[-1]
    assert resumed["step"] == 3 and (resumed["rollout/continued_answers"] > 0) == (pending > 0)


def test_context_parallel_2_trains_the_demo_with_the_data_parallel_2_first_step(tmp_path):
    """`torchrun --nproc_per_node 2 -m dapo_mcore.cli train examples/smoke_cpu.yaml parallel.context_parallel_size=2`
    (docs/design/context_parallel.md, steps 4-5): each sequence split over the 2 ranks (packed rows as THD), the
    loss's per-sequence sums over both. Same samples as DP 2 at the same world size (the engine and its seed do not
    depend on the actor's layout), so the first step's loss and gradient norm are DP 2's to fp32 round-off."""
    rows = {}
    for name, extra in (("dp2", []), ("cp2", ["parallel.context_parallel_size=2"])):
        run_dir = tmp_path / name
        cli("train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=1", f"logging.run_dir={run_dir}", *extra,
            ranks=2)  # fmt: skip
        rows[name] = read_rows(run_dir)[0]
    for key in ("loss/policy", "actor/grad_norm", "actor/entropy", "actor/ratio_mean"):
        assert rows["cp2"][key] == pytest.approx(rows["dp2"][key], rel=1e-5), key
    assert rows["cp2"]["actor/train_tokens"] == rows["dp2"]["actor/train_tokens"]


def test_a_save_at_context_parallel_2_resumes_at_context_parallel_1(tmp_path):
    """CP changes no weight's layout, and the distributed optimizer shards over DP x CP: a CP 2 save (its default
    dp_reshardable optimizer format) resumes at CP 1 x DP 2 and takes step 2 as the CP 2 run did, the same answers
    (the same weights, bit for bit) and the update to fp32 round-off."""
    common = ("train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=2", "checkpoint.save_interval=1",
              "checkpoint.keep_last=5")  # fmt: skip
    cp_dir, resumed_dir = tmp_path / "cp2", tmp_path / "resumed"
    cli(*common, f"logging.run_dir={cp_dir}", "parallel.context_parallel_size=2", ranks=2)
    shutil.copytree(cp_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step_000002")
    cli(*common, f"logging.run_dir={resumed_dir}", "checkpoint.resume=auto", ranks=2)
    want, got = read_rows(cp_dir)[-1], read_rows(resumed_dir)[-1]
    assert got["step"] == want["step"] == 2
    for key in ("rollout/accuracy", "rollout/response_len_mean", "actor/train_tokens"):
        assert got[key] == want[key], key
    for key in ("loss/policy", "actor/grad_norm", "actor/entropy"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key

"""The scale rehearsal (dapo-mcore rehearse, per-rank mode) on the demo recipe at 2 and 4 processes, each rank's
own share of the step held: at step 1, as the code is, what a rank holds and receives stays flat as the ranks
double; at step 2 a cause of the paper-scale issue is put back (every chosen sample sent to every rank, as
before the exchange fix: rehearsal_faults/sitecustomize.py), and the report names it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

REPO = Path(__file__).resolve().parents[2]
FAULTS = Path(__file__).with_name("rehearsal_faults")
# 4 GPUs' worth of the demo recipe: each rank's share is 8 prompts x 8 answers of about 128 tokens a step,
# its exchange about 0.06 MB (every sample to every rank: 0.12 MB at N=2, 0.24 at N=4, whose rise clears the
# report's 64 KB floor twice over). Rounds of twice the step's prompts, as the recipes over-sample (3x): a step
# takes one round where rounds of the step's count took two (dynamic sampling drops some groups), and each
# round's phases (generate, reward, summaries) cost every rank a census of its objects, 0.4 s each
ARGS = [
    "rollout.sampling.max_response_len=256", "rollout.prompts_per_step=32", "rollout.gen_prompts_per_round=64",
    "trainer.mini_batch_size=256", "logging.progress=false",
    "rollout.carry_surplus=false",  # as the recipes: carried groups go to every rank (docs/rehearsal.md)
    "--gpus", "4", "--world-size", "2", "4", "--mean-len", "128", "--load", "1", "--steps", "2",
    "--micro-batches", "0", "--no-save",
]  # fmt: skip
STEP_PATH = ("step", "generate", "reward", "summaries", "exchange", "old_logprobs", "update", "weight_push")


def test_per_rank_memory_and_bytes_stay_flat_as_ranks_double_and_a_gather_of_every_sample_is_named(
    tmp_path, monkeypatch
):
    out = tmp_path / "rehearsal"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAULTS), str(REPO)]),
           "DAPO_TEST_FAULT": "every_sample_to_every_rank_from_step_2"}  # fmt: skip
    cmd = [sys.executable, "-m", "dapo_mcore.cli", "rehearse", "examples/smoke_cpu.yaml", *ARGS, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report, text = json.loads((out / "report.json").read_text()), (out / "report.md").read_text()
    step1, step2 = report["growth_by_step"]["1"], report["growth_by_step"]["2"]

    def grown(table: list[dict], quantity: str) -> list[str]:
        # the exchange's bytes are judged per kept token: "received MB per kept token (x N=2's share)"
        return [
            g["phase"] for g in table if g["quantity"].startswith(quantity) and g["grows"] and g["phase"] in STEP_PATH
        ]

    def exchange(table: list[dict]) -> list[float]:
        return next(g["values"] for g in table if g["phase"] == "exchange" and g["quantity"].startswith("received MB"))

    assert exchange(step1)[0] > 0.03  # the bytes are counted (a flat zero would pass the checks below)
    # as the code is: flat
    assert not grown(step1, "received MB") and not grown(step1, "peak RSS MB"), text
    assert exchange(step1)[1] < 1.15 * exchange(step1)[0]
    # every sample to every rank: the exchange's bytes double with the ranks, and the report names it
    assert "exchange" in grown(step2, "received MB") and exchange(step2)[1] > 1.8 * exchange(step2)[0]
    assert "- exchange: received MB per kept token (x N=2's share) grows with the ranks" in text
    # the same runs judged again without running anything (the command in this process: a fresh interpreter
    # would import torch for nothing but the report)
    from dapo_mcore.cli import main

    monkeypatch.chdir(REPO)  # the recipe's path in args.json is the first command's, relative to REPO
    (out / "report.json").unlink()
    with patch("subprocess.run", side_effect=AssertionError("--report-only ran something")):
        assert main(["rehearse", "--report-only", "--out", str(out)]) == 0
    assert json.loads((out / "report.json").read_text())["growth_by_step"] == report["growth_by_step"]


# The 7B recipe at CP 2 (the recipe's TP 2 x CP 2 x DP 2 on 8 GPUs), rehearsed on 2 processes: one DP rank split
# over a CP pair, its share of 1 prompt x 16 answers of about 64 tokens, every micro-batch computed (about 20 s)
CP_ARGS = [
    "parallel.context_parallel_size=2", "logging.progress=false",
    "--model-config", "examples/models/Qwen2.5-7B", "--world-size", "2", "--load", "0.004", "--mean-len", "64",
    "--steps", "1", "--no-save", "--micro-batches", "0",
]  # fmt: skip
KV_LINE = "K/V all-gather (context parallel)"


def test_a_rehearsal_at_context_parallel_2_counts_the_kv_gathers_within_the_planners_line(tmp_path):
    from dapo_mcore.config import load_config
    from dapo_mcore.plan import plan_memory

    out = tmp_path / "rehearsal"
    cmd = [sys.executable, "-m", "dapo_mcore.cli", "rehearse", "examples/dapo_qwen2.5_7b_h100.yaml", *CP_ARGS]
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report, text = json.loads((out / "report.json").read_text()), (out / "report.md").read_text()
    assert "the recipe's CP 2, rehearsed at CP 2" in text
    ran = load_config(out / "N2" / "config.yaml")
    assert ran.parallel.context_parallel_size == 2 and ran.parallel.tensor_model_parallel_size == 1
    (world,) = report["worlds"]
    assert world["counts"]["prompts_per_step"] == 1  # one DP rank's share: the pair splits it, not doubles it
    old = world["phases"]["old_logprobs"]["values"]
    # the old log-probs' forward: each rank sends its half of every layer's K and V and receives the whole
    assert old["sent_mb"] > 0.1 and 1.6 < old["received_mb"] / old["sent_mb"] < 2.2, old
    # within the planner's: its K/V line at the rehearsal's own config (K, V and their gradients of the longest
    # sequence, one layer at a time) bounds what a layer of a micro-batch gathers in the forward (K and V: half
    # the line), over the shrunk model's 2 layers and at most one micro-batch an answer (16)
    plan = plan_memory(ran, json.loads((out / "model" / "config.json").read_text()), 80.0, 2)
    (kv_line,) = [line for phase in plan.phases for line in phase.lines if line.name == KV_LINE]
    assert old["received_mb"] * 2**20 <= 16 * 2 * kv_line.bytes / 2, (old, kv_line)

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

"""examples/mixed_sources_cpu.yaml as a user runs it (docs/data.md): a file of two data sources, each judged by
its own verifier, one of them verl's compute_score form returning graded scores with named parts. The run logs
each source's accuracy and the reward's parts, validates each source of the held-out file, and `dapo-mcore eval`
of its save reports the same sources."""

import json

import pytest

from dapo_mcore.config import load_config
from tests.conftest import REPO
from tests.e2e.test_train_cli import cli, read_rows

RECIPE = "examples/mixed_sources_cpu.yaml"
SHORT = ["trainer.steps=2", "trainer.eval_interval=2", "trainer.eval_k=2", "checkpoint.save_interval=2",
         "rollout.prompts_per_step=8", "rollout.gen_prompts_per_round=8", "logging.plot=false",
         "logging.samples_per_step=64"]  # fmt: skip


def test_a_mixed_file_trains_with_a_verifier_per_source_and_is_evaluated_per_source(tmp_path):
    run_dir = tmp_path / "run"
    cli("train", RECIPE, *SHORT, f"logging.run_dir={run_dir}")
    rows = read_rows(run_dir)
    trained = [r for r in rows if "rollout/accuracy" in r]
    assert len(trained) == 2
    for row in trained:
        assert {"rollout/accuracy/sums", "rollout/accuracy/differences"} <= set(row)
        # only the graded verifier returns parts; its "acc" is its verdict, a mean of 0 / 1
        assert {"reward_part/closeness", "reward_part/has_number", "reward_part/acc"} <= set(row)
        assert 0 <= row["reward_part/closeness"] <= 1
    # the graded scores are the rewards: not only +1 / -1 (the sums' verdicts) on the differences' rows
    samples = [json.loads(line) for path in sorted((run_dir / "samples").glob("*.jsonl"))
               for line in path.read_text().splitlines()]  # fmt: skip
    differences = [s for s in samples if s["data_source"] == "differences"]
    assert differences and all("-" in s["prompt"] and "closeness" in s["reward_parts"] for s in differences)
    assert any(s["verifier_reward"] not in (1.0, -1.0) for s in differences)
    assert all(s["verifier_reward"] in (1.0, -1.0) and not s["reward_parts"] for s in samples
               if s["data_source"] == "sums")  # fmt: skip
    held = {k for r in rows for k in r if k.startswith("eval/heldout")}
    assert {"eval/heldout/avg@2", "eval/heldout[sums]/avg@2", "eval/heldout[differences]/avg@2"} <= held
    last = rows[-1]
    assert last["eval/heldout[sums]/problems"] == last["eval/heldout[differences]/problems"] == 40

    out = tmp_path / "eval.json"
    verifier = load_config(REPO / RECIPE).algorithm.reward.verifiers["differences"]
    cli("eval", str(run_dir), "--data", "examples/data/mixed/heldout.jsonl", "--k", "2", "--max-new-tokens", "32",
        "--source-verifier", f"differences={verifier}", "--out", str(out))  # fmt: skip
    files = json.loads(out.read_text())["files"]
    name = "examples/data/mixed/heldout.jsonl"
    assert {name, f"{name}[sums]", f"{name}[differences]"} <= set(files)
    # the whole file's avg@k is the mean of its two equal halves'
    halves = (files[f"{name}[sums]"]["avg@2"] + files[f"{name}[differences]"]["avg@2"]) / 2
    assert files[name]["avg@2"] == pytest.approx(halves)

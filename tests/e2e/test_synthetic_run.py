"""The demo recipe trained 3 steps on the synthetic engine (rollout.engine=synthetic, rehearsals and tests only),
through the command line in this process: the real loop takes its answers (lengths growing with the step, some
cut at the cap), its verdicts through the synthetic reward rule, its weight pushes; and `check` accepts it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_mcore import build
from dapo_mcore.cli import main
from dapo_mcore.rollout.synthetic_engine import SyntheticSettings

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "examples/smoke_cpu.yaml")
SYNTHETIC = [
    "rollout.engine=synthetic",
    "algorithm.reward.verifier=synthetic",
    "algorithm.mismatch.guard=off",  # its log-probs are drawn, not the actor's
    # the mean length grows from 8 to 24 tokens over the 3 steps, under the recipe's 32-token cap
    "rollout.synthetic.mean_len_first=8",
    "rollout.synthetic.mean_len_last=24",
]
SHORT = [
    "trainer.steps=3",
    "rollout.prompts_per_step=4",
    "rollout.gen_prompts_per_round=8",
    "trainer.mini_batch_size=16",
    "trainer.micro_batch_size=16",
    "checkpoint.save_interval=0",
    "logging.wandb.mode=disabled",
    "logging.plot=false",
    "logging.progress=false",
]


def spy_on_the_engine_knobs(monkeypatch) -> list[SyntheticSettings]:
    """The knobs build.start_engine passes to each engine it starts (rollout.synthetic and trainer.steps)."""
    told, create = [], build.create_engine

    def create_engine(name, settings, synthetic=None):
        told.append(synthetic)
        return create(name, settings, synthetic)

    monkeypatch.setattr(build, "create_engine", create_engine)
    return told


def test_the_demo_recipe_trains_three_steps_on_the_synthetic_engine(tmp_path, monkeypatch, capsys):
    overrides = [*SYNTHETIC, *SHORT, f"logging.run_dir={tmp_path / 'run'}"]
    told = spy_on_the_engine_knobs(monkeypatch)
    assert main(["train", RECIPE, *overrides]) == 0, capsys.readouterr().err[-3000:]
    assert [(knobs.steps, knobs.mean_len_first, knobs.mean_len_last) for knobs in told] == [(3, 8, 24)]
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["dynamic_sampling/kept_groups"] > 0 and "loss/policy" in row  # every step made an update
        assert 0 < row["rollout/accuracy"] < 1 and row["rollout/response_len_max"] <= 32
        answers = row["rollout/generated_samples"] / row["dynamic_sampling/generated_groups"]
        trained_answers = row["dynamic_sampling/kept_groups"] * answers
        assert trained_answers <= row["rollout/trained_answer_tokens"] <= 32 * trained_answers
    lengths = [r["rollout/response_len_mean"] for r in rows]
    assert lengths[0] < 12 and lengths[2] > 14  # means 8 and 24 before the cap (24's answers cut at 32)
    assert rows[2]["rollout/truncated_frac"] > 0.05
    assert "run finished" in capsys.readouterr().out


@pytest.mark.parametrize("extra, listed", [([], None), (["algorithm.reward.verifier=dapo"], "verifier=synthetic")])
def test_check_accepts_the_synthetic_engine_and_names_a_missing_rule(tmp_path, capsys, extra, listed):
    code = main(["check", RECIPE, *SYNTHETIC, *extra, f"logging.run_dir={tmp_path / 'run'}"])
    out = capsys.readouterr()
    if listed is None:
        assert code == 0, out.out + out.err
    else:
        assert code == 2 and listed in out.out + out.err

"""Rewards as users write them (rewards/contract.py, rewards/by_source.py): the three signatures, graded scores and
dicts with named parts, verl's compute_score file as docs/data.md shows it, rows routed to the verifier of their
data_source, and graded rewards through scoring, advantages and the dynamic-sampling filter."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from dapo_mcore.algo.advantages import group_advantages
from dapo_mcore.data.datasets import load_jsonl_prompts
from dapo_mcore.data.types import Group, Prompt, Sample, group_from_dict, group_to_dict
from dapo_mcore.rewards.by_source import VerifierChoice
from dapo_mcore.rewards.contract import VERDICTS, ScoreRule, call, call_style, read_value
from dapo_mcore.rewards.pool import Verdict, VerifierPool
from dapo_mcore.rollout.sampler import _source_metrics, reward_spread
from dapo_mcore.rollout.scoring import GroupScoring
from dapo_mcore.rollout.settings import SamplerSettings
from dapo_mcore.rollout.validation import by_source
from dapo_mcore.utils.errors import DataError
from tests.conftest import REPO

GRADED = ScoreRule(graded=True)
VERL_FILE = "examples/rewards/graded_arith.py:compute_score"


def pair(response, reference):
    return response == reference


def with_row(response, reference, row):
    return {"score": float(response == reference) + row["bonus"], "bonus": row["bonus"]}


def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.25, "acc": solution_str == ground_truth, "source_len": len(data_source), "pred": "x"}


def verl_kwargs(solution_str, ground_truth, **kwargs):
    return float(kwargs["extra_info"]["index"])


def test_the_signature_decides_the_call():
    assert [call_style(f) for f in (pair, with_row, verl_style, verl_kwargs)] == ["pair", "row", "verl", "verl"]
    row = {"data_source": "math", "bonus": 0.5, "extra_info": {"index": 7}}
    assert call(pair, "pair", "3", "3", row) is True
    assert call(with_row, "row", "3", "3", row) == {"score": 1.5, "bonus": 0.5}
    assert call(verl_style, "verl", "3", "4", row)["source_len"] == 4
    # verl's extra_info is the row's own `extra_info` object when it has one, else the row's other fields
    assert call(verl_kwargs, "verl", "", "", row) == 7.0
    seen = {}
    call(lambda solution_str, extra_info: seen.update(extra_info), "verl", "", "", {"data_source": "s", "k": 1})
    assert seen == {"k": 1}


def strict_flag(response, reference, strict=False):
    return strict


def test_an_optional_third_parameter_is_not_the_row_and_numpy_bools_are_bools():
    import numpy as np

    assert call_style(strict_flag) == "pair"  # the row would have gone into `strict`, truthy, without a word
    for value in (np.True_, np.bool_(False)):
        assert read_value(value, VERDICTS).correct is bool(value)
    value = read_value({"score": -1.0, "acc": np.True_, "ok": np.False_}, VERDICTS)
    assert value.correct and value.parts == {"acc": 1.0, "ok": 0.0}


def test_a_verdict_number_is_thresholded_and_must_lie_in_0_1_unless_graded():
    assert read_value(True, VERDICTS).correct and read_value(True, VERDICTS).score is None
    assert read_value(0.5, VERDICTS).correct and not read_value(0.49, VERDICTS).correct
    assert read_value(0.7, VERDICTS).score is None  # a verdict: the reward is reward.correct
    assert read_value(0.7, ScoreRule(correct_threshold=0.8)).correct is False
    with pytest.raises(ValueError, match="graded=true"):
        read_value(-0.5, VERDICTS)
    graded = read_value(-0.5, GRADED)
    assert (graded.correct, graded.score) == (False, -0.5)
    for bad in (float("nan"), "True", None, [1.0], math.inf):
        with pytest.raises(ValueError):
            read_value(bad, GRADED)


def test_a_dict_gives_its_score_its_parts_and_verls_acc_as_the_verdict():
    value = read_value({"score": 0.25, "acc": True, "format": 1, "pred": "17"}, GRADED)
    assert (value.correct, value.score, value.parts) == (True, 0.25, {"acc": 1.0, "format": 1.0})
    # without graded the reward is the verdict's: verl's -1 / +1 scores with "acc" need no range
    assert read_value({"score": -1.0, "acc": False}, VERDICTS).score is None
    assert read_value({"score": 0.9, "length": 3.0}, VERDICTS).correct  # no acc: the score's threshold
    with pytest.raises(ValueError, match="without a 'score'"):
        read_value({"reward": 1.0}, GRADED)
    with pytest.raises(ValueError, match="finite"):
        read_value({"score": 1.0, "bonus": float("nan")}, GRADED)


def docs_compute_score() -> str:
    """The verl-style reward file as docs/data.md shows it (its python block that defines compute_score)."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "data.md").read_text(), flags=re.S)
    (block,) = [b for b in blocks if "def compute_score(" in b]
    return block


def test_the_docs_verl_file_is_the_example_and_runs_unchanged_in_a_verifier_worker():
    code = (REPO / "examples" / "rewards" / "graded_arith.py").read_text()
    assert docs_compute_score().strip() in code  # the docs show the file's code as it is
    pool = VerifierPool(VERL_FILE, workers=1, rule=GRADED)
    try:
        row = {"data_source": "differences", "extra_info": {"split": "train", "index": 3}}
        exact, near, none = pool.verify([("so 12-5 = 7", "7", row), ("it is 8", "7", row), ("no idea", "7", row)])
    finally:
        pool.close()
    assert (exact.correct, exact.score, exact.parts["closeness"]) == (True, 1.0, 1.0)
    assert not near.correct and near.score == pytest.approx(-1 + 6 / 7) and near.parts["has_number"] == 1.0
    assert (none.score, none.parts["has_number"]) == (-1.0, 0.0)


def test_rows_go_to_the_verifier_of_their_data_source_in_order():
    choice = VerifierChoice("dapo", {"differences": VERL_FILE}, GRADED)
    verifiers = choice.start(workers=0)
    checks = [
        ("Answer: 7", "7", {"data_source": "sums"}),
        ("7", "7", {"data_source": "differences"}),
        ("7", "7", {"data_source": "sums"}),  # no "Answer:": wrong under dapo
        ("Answer: 3", "7", {"data_source": "differences"}),
        ("Answer: 7", "7"),  # no row: the default verifier
    ]
    verdicts = verifiers.verify(checks)
    assert [v.correct for v in verdicts] == [True, True, False, False, True]
    assert [v.score for v in verdicts] == [None, 1.0, None, pytest.approx(-1 + 3 / 7), None]
    assert set(verdicts[1].parts) == {"acc", "closeness", "has_number"} and verdicts[0].parts == {}
    assert verifiers.spec == f"dapo (differences: {VERL_FILE})"
    verifiers.close()


def scoring(**settings) -> GroupScoring:
    base = dict(n_samples_per_prompt=4, prompts_per_step=1, gen_prompts_per_round=1, temperature=1.0, top_p=1.0,
                max_response_len=100, seed=0, overlong_enabled=False)  # fmt: skip
    return GroupScoring(SamplerSettings(**(base | settings)), lambda checks: VERDICTS_OF[checks[0][2]["data_source"]],
                        reward_spread)  # fmt: skip


VERDICTS_OF = {
    # every answer right, graded scores that differ: a group with signal
    "graded": [Verdict(True, score=s, parts={"format": f}) for s, f in ((1.0, 1), (0.6, 1), (0.6, 0), (0.2, 1))],
    "flat": [Verdict(True, score=0.5)] * 4,  # graded, all equal: no signal
    "verdicts": [Verdict(c) for c in (True, False, False, False)],
    "all_right": [Verdict(True)] * 4,
}


def group_of(source: str) -> Group:
    samples = [Sample([1], [2] * 10, [0.0] * 10, "stop", response_text="x") for _ in range(4)]
    return Group(Prompt("q", "a", data_source=source), samples)


@pytest.mark.parametrize("source, kept", [("graded", True), ("flat", False), ("verdicts", True), ("all_right", False)])
def test_graded_rewards_are_the_rewards_and_a_group_is_kept_when_they_differ(source, kept):
    scorer = scoring()
    group = group_of(source)
    assert scorer.judge(group) is kept
    want = {"graded": [1.0, 0.6, 0.6, 0.2], "flat": [0.5] * 4, "verdicts": [1.0, -1.0, -1.0, -1.0],
            "all_right": [1.0] * 4}[source]  # fmt: skip
    assert [s.reward for s in group.samples] == want
    scorer.assign_advantages([group])
    rewards = torch.tensor(want, dtype=torch.float64)
    cfg = scorer.settings
    expected = group_advantages(rewards, torch.zeros(4, dtype=torch.long), cfg.adv_eps, cfg.adv_estimator, False)
    assert torch.allclose(torch.tensor([s.advantage for s in group.samples], dtype=torch.float64), expected)
    if source == "graded":
        assert [s.reward_parts["format"] for s in group.samples] == [1, 1, 0, 1]


def test_the_length_shaping_adds_to_a_graded_reward():
    scorer = scoring(overlong_enabled=True, max_response_len=12, overlong_buffer_len=4, overlong_penalty_factor=1.0)
    group = group_of("graded")
    scorer.judge(group)
    # 10 tokens of a 12-token limit with a 4-token buffer: 2 tokens into it, -0.5
    assert [s.reward for s in group.samples] == pytest.approx([0.5, 0.1, 0.1, -0.3])
    assert [s.verifier_reward for s in group.samples] == [1.0, 0.6, 0.6, 0.2]


def test_per_source_accuracy_and_reward_parts_in_the_metrics_and_eval():
    groups = [group_of("graded"), group_of("verdicts")]
    scorer = scoring()
    for g in groups:
        scorer.judge(g)
    metrics = _source_metrics(groups)  # summaries carry the same fields (rollout/exchange.py)
    assert metrics["rollout/accuracy/graded"] == 1.0 and metrics["rollout/accuracy/verdicts"] == 0.25
    assert metrics["reward_part/format"] == 0.75
    assert _source_metrics([group_of("")]) == {}  # one unnamed source: nothing beside rollout/accuracy
    assert "rollout/accuracy/openai_gsm8k" in _source_metrics([group_of("openai/gsm8k")])  # one name segment
    prompts = [Prompt("q", "a", data_source=s) for s in ("x", "y", "x")]
    checked = ([[True], [False], [False]], [["1"], ["2"], ["3"]])
    assert by_source("file", prompts, checked) == {
        "file": checked,
        "file[x]": ([[True], [False]], [["1"], ["3"]]),
        "file[y]": ([[False]], [["2"]]),
    }


def test_a_data_row_keeps_its_source_and_every_other_field_through_a_save(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [{"prompt": "p", "answer": 3, "data_source": "gsm8k", "extra_info": {"index": 0}, "level": 2},
            {"prompt": "q", "answer": "x"}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second = load_jsonl_prompts(path)
    assert first.row() == {"data_source": "gsm8k", "extra_info": {"index": 0}, "level": 2}
    assert second.row() == {"data_source": ""}
    group = Group(first, [Sample([1], [2], [0.0], "stop", verifier_reward=0.5, reward_parts={"format": 1.0})])
    torch.save(group_to_dict(group), tmp_path / "g.pt")
    loaded = group_from_dict(torch.load(tmp_path / "g.pt", weights_only=True))
    assert loaded.prompt == first and loaded.samples[0].reward_parts == {"format": 1.0}
    path.write_text(json.dumps({"prompt": "p", "answer": 1, "data_source": 3}) + "\n")
    with pytest.raises(DataError, match="mixed.jsonl:1: 'data_source' must be a string"):
        load_jsonl_prompts(path)

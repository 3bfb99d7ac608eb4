"""logging.samples_per_step: which answers of a step are written, what a row holds, a resumed run's files, the
wandb table; and `eval --save-answers`' rows."""

import json
from pathlib import Path

import pytest

from dapo_mcore.config import load_config
from dapo_mcore.config.validate import validate
from dapo_mcore.data.types import Group, NotHere, Prompt, Sample
from dapo_mcore.evaluate import AnswerFile
from dapo_mcore.rewards.answers import answer_extractor
from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.rollout.samples_log import choose_samples, log_step_samples, read_step_samples, step_file
from dapo_mcore.rollout.validation import EvalSettings, answer_and_check
from dapo_mcore.utils.errors import ConfigError
from dapo_mcore.utils.metrics_log import MetricsWriter
from tests.unit.test_evaluate import Encoded, Scripted


class CharTokenizer:
    """Token id = character code; id 2 is the end-of-sequence token (special: skipped when asked)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("</s>" if i == 2 else chr(i) for i in ids if not (skip_special_tokens and i == 2))


def encoded(text: str) -> list[int]:
    return [ord(c) for c in text]


def answer(text: str, correct: bool, finish_reason: str = "stop", **fields) -> Sample:
    ids = encoded(text) + [2]
    return Sample(encoded("1+1?"), ids, [-0.5] * len(ids), finish_reason, correct=correct, **fields)


def group(verdicts: str, uid: str = "p") -> Group:
    """A group whose answers are right (R) or wrong (W) in this order."""
    return Group(Prompt("1+1?", "2", uid), [answer(f"{v}{i}", v == "R") for i, v in enumerate(verdicts)])


def test_whole_groups_with_right_and_wrong_answers_come_first_their_answers_in_turn():
    groups = [group("RRRR"), group("RRWW"), group("WRWW")]
    assert choose_samples(groups, 4) == [(1, 0), (1, 1), (1, 2), (1, 3)]  # the all-right group is not informative
    assert choose_samples(groups, 3) == [(1, 0), (1, 1), (1, 2)]  # right, wrong, right
    assert choose_samples(groups, 2) == [(1, 0), (1, 2)]  # one right, one wrong rather than two right
    assert choose_samples(groups, 6) == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]
    assert choose_samples(groups, 20) == [(g, i) for g in range(3) for i in range(4)]  # then the others
    assert choose_samples([], 4) == []


def test_only_the_answers_this_rank_holds_are_chosen():
    mixed = group("RWRW")
    for i in (0, 1):  # another data-parallel rank trains these: only their counts are here
        mixed.samples[i].response_ids = NotHere(3)
    assert choose_samples([mixed, group("RWWR")], 3) == [(0, 2), (0, 3), (1, 0)]


def test_a_step_file_holds_each_answer_as_text_with_its_verdict_reward_advantage_and_weights(tmp_path):
    continued = answer("R0", True, reward=1.0, advantage=0.75, policy_step=3, version_runs=[[3, 2], [4, 1]])
    wrong = answer("W1", False, reward=-1.0, advantage=-0.75, policy_step=4, finish_reason="length")
    groups = [Group(Prompt("1+1?", "2", "arith-7"), [continued, wrong])]
    path = log_step_samples(groups, 5, 4, CharTokenizer(), tmp_path / "samples")
    assert path == step_file(tmp_path / "samples", 5) and path.name == "step_000005.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0] == {
        "step": 5, "group": 0, "sample": 0, "prompt_uid": "arith-7", "prompt": "1+1?", "answer": "R0",
        "ground_truth": "2", "data_source": "", "correct": True, "timed_out": False, "verifier_reward": 0.0,
        "reward_parts": {}, "reward": 1.0, "length_penalty": 0.0,
        "advantage": 0.75, "trainable": True, "finish_reason": "stop", "response_len": 3, "prompt_len": 4,
        "weight_versions": [[3, 2], [4, 1]],
    }  # fmt: skip
    assert rows[1]["finish_reason"] == "length" and rows[1]["weight_versions"] == [[4, 3]]


def test_no_samples_are_written_when_samples_per_step_is_zero(tmp_path):
    assert log_step_samples([group("RW")], 1, 0, CharTokenizer(), tmp_path / "samples") is None
    assert not (tmp_path / "samples").exists()


def test_a_resumed_run_rewrites_the_steps_it_runs_again_and_keeps_the_left_ones_aside(tmp_path):
    samples, tokenizer = tmp_path / "samples", CharTokenizer()
    for step in (1, 2, 3):  # the first run: three steps, its newest save after step 1
        log_step_samples([group("RW", uid="first")], step, 2, tokenizer, samples)
    log_step_samples([group("RW", uid="resumed")], 2, 2, tokenizer, samples)  # resumed from the save at step 1
    assert {r["prompt_uid"] for r in read_step_samples(samples, 1)} == {"first"}  # left alone
    assert {r["prompt_uid"] for r in read_step_samples(samples, 2)} == {"resumed"}
    assert not step_file(samples, 3).exists()  # the left trajectory's step 3 is not this run's
    (attempt,) = (samples / "rolled_back").iterdir()  # one folder a roll-back: a later one overwrites nothing
    assert sorted(p.name for p in attempt.iterdir()) == ["step_000002.jsonl", "step_000003.jsonl"]


def test_negative_samples_per_step_is_a_config_error():
    cfg = load_config("examples/smoke_cpu.yaml", ["logging.samples_per_step=-1"])
    with pytest.raises(ConfigError, match="logging.samples_per_step must be >= 0"):
        validate(cfg)


class FakeWandbRun:
    def __init__(self):
        self.logged = []

    def log(self, data, step=None):
        self.logged.append((step, data))


def test_the_wandb_table_goes_with_the_steps_metrics_row(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer._wandb_run = run = FakeWandbRun()
    log_step_samples([group("RW")], 1, 2, CharTokenizer(), tmp_path / "samples", writer.log_table)
    assert run.logged == []  # wandb drops a step's data logged after a later step's: it waits for the row
    writer.write(1, {"rollout/accuracy": 0.5})
    ((step, data),) = run.logged
    table = data["samples"]
    assert step == 1 and data["rollout/accuracy"] == 0.5 and len(table.data) == 2
    assert table.columns[:3] == ["step", "group", "sample"]
    assert table.data[0][table.columns.index("weight_versions")] == "[[0, 3]]"  # lists shown as JSON
    writer.write(2, {"rollout/accuracy": 0.5})
    assert "samples" not in run.logged[-1][1]


def test_saved_answers_are_one_row_per_answer_with_the_problems_file_and_row(tmp_path):
    prompts = [Prompt("p1", "5", "held.jsonl:1"), Prompt("p2", "1", "held.jsonl:2")]
    out = tmp_path / "answers.jsonl"
    with AnswerFile(str(out)) as answers:
        answer_and_check(Scripted(), Encoded, prompts, VerifierPool("dapo", workers=0).verify, answer_extractor("dapo"),
                         EvalSettings(k=4, prompts_per_call=1),
                         on_answered=answers.writer_for("held.jsonl", lambda problem: f"Q: {problem}"))  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(i, j) for i in range(2) for j in range(4)]
    assert rows[2] == {
        "file": "held.jsonl", "index": 0, "prompt_uid": "held.jsonl:1", "sample": 2, "prompt": "Q: p1",
        "answer": "Answer: 6", "ground_truth": "5", "data_source": "", "extracted": "6", "correct": False,
        "timed_out": False, "response_len": 1, "finish_reason": "stop",
    }  # fmt: skip
    assert [r["correct"] for r in rows[:4]] == [True, True, False, False] and rows[7]["extracted"] == "2"


def test_saving_answers_where_no_file_can_be_written_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"--save-answers .*: cannot write there"):
        AnswerFile(str(Path(tmp_path) / "no-such-dir" / "answers.jsonl"))

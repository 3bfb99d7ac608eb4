"""`dapo-mcore eval`: metrics from a fixed set of answers computed by hand, and the command on the demo model."""

import json

import pytest

from dapo_mcore.algo.eval_metrics import eval_metrics
from dapo_mcore.cli import main
from dapo_mcore.data.types import Prompt
from dapo_mcore.rewards.answers import answer_extractor
from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.rollout.base import Completion
from dapo_mcore.rollout.validation import EvalSettings, Validator, answer_and_check
from tests.conftest import REPO

# two problems, 4 answers each: what a scripted engine says
SCRIPT = {
    "p1": ["Answer: 5", "Answer: 5", "Answer: 6", "no idea"],  # 2 right; majority 5 (right)
    "p2": ["Answer: 1", "Answer: 3", "Answer: 3", "Answer: 2"],  # 1 right; majority 3 (wrong)
    "p3": ["the sum is 7", "7", "Answer: 7", "8"],  # the DAPO rule: 1 right; the last number (gsm8k): 3
}


class Scripted:
    def generate(self, prompt_ids, params):
        texts = ["".join(chr(i) for i in ids) for ids in prompt_ids]
        return [[Completion([1], [-1.0], "stop", t) for t in SCRIPT[text][: params.n]] for text in texts]


class Encoded:
    def __init__(self, text):
        self.input_ids = [ord(c) for c in text]


def test_metrics_of_a_fixed_set_of_answers_equal_the_hand_computation():
    prompts = [Prompt("p1", "5", "a:1"), Prompt("p2", "1", "a:2")]
    pool = VerifierPool("dapo", workers=0)
    checked = answer_and_check(Scripted(), Encoded, prompts, pool.verify, answer_extractor("dapo"), EvalSettings(k=4))
    got = eval_metrics(*checked, k=4)
    assert got["problems"] == 2
    assert got["avg@4"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert got["pass@1"] == pytest.approx(got["avg@4"])
    # pass@2: 1 - C(2,2)/C(4,2) = 5/6 and 1 - C(3,2)/C(4,2) = 1/2
    assert got["pass@2"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    assert got["pass@4"] == pytest.approx(1.0)
    assert got["maj@4"] == pytest.approx(0.5)


def test_eval_command_on_the_demo_model_writes_json_and_a_table(tmp_path, capsys):
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a}+{a + 1}?\n", "answer": 2 * a + 1}) + "\n"
                            for a in range(6)))  # fmt: skip
    out = tmp_path / "eval.json"
    model = str(REPO / "examples/models/tiny-arith")
    argv = ["eval", model, "--data", str(data), "--k", "4", "--max-new-tokens", "32", "--out", str(out)]
    assert main([*argv, "--also-verifier", "gsm8k"]) == 0
    files = json.loads(out.read_text())["files"]
    metrics, lenient = files[str(data)], files[f"{data}:gsm8k"]  # the same answers, by the last number too
    assert lenient["problems"] == 6 and lenient["avg@4"] >= metrics["avg@4"]
    assert metrics["problems"] == 6 and set(metrics) >= {"avg@4", "pass@1", "pass@2", "pass@4", "maj@4"}
    assert metrics["pass@1"] == pytest.approx(metrics["avg@4"]) and metrics["pass@4"] >= metrics["pass@2"]
    assert "avg@4" in capsys.readouterr().out


def test_eval_of_something_that_is_not_a_model_directory_is_one_line(tmp_path, capsys):
    assert main(["eval", str(tmp_path), "--data", "x.jsonl"]) == 2
    assert "is neither an HF model directory" in capsys.readouterr().err


class _Captured(Exception):
    pass


def test_validation_split_over_two_engine_replicas_equals_one_replica():
    prompts = [Prompt("p1", "5", "a:1"), Prompt("p2", "1", "a:2"), Prompt("p1", "6", "a:3")]
    pool = VerifierPool("dapo", workers=0)
    pieces = (Scripted(), Encoded, pool.verify, answer_extractor("dapo"), EvalSettings(k=4))
    alone = Validator({"dir/held.jsonl": prompts}, *pieces).run()
    shares = {}

    def capture(obj):  # replica 1's share, as an all-gather would deliver it to replica 0
        shares[1] = obj
        raise _Captured

    with pytest.raises(_Captured):
        Validator({"dir/held.jsonl": prompts}, *pieces, replica=1, n_replicas=2, all_gather=capture).run()
    gather = lambda obj: [obj, shares[1]]
    split = Validator({"dir/held.jsonl": prompts}, *pieces, replica=0, n_replicas=2, all_gather=gather).run()
    assert split == alone
    assert alone["eval/held/problems"] == 3
    # p1 says "5" twice and "6" once in four (a:1 wants 5, a:3 wants 6); p2 is right once in four
    assert alone["eval/held/avg@4"] == pytest.approx((2 / 4 + 1 / 4 + 1 / 4) / 3)


def test_the_also_rules_are_the_ones_the_config_accepts():
    from dapo_mcore.config.validate import EVAL_ALSO_RULES
    from dapo_mcore.rewards.answers import ALSO_RULES

    assert EVAL_ALSO_RULES == ALSO_RULES


def test_held_out_answers_checked_by_another_rule_too_give_its_figures_beside_split_over_replicas():
    """trainer.eval_also_verifiers: the same answers under the lenient rule (the last number) beside the strict
    one (after "Answer:"), in the file's order when the replicas' shares come back."""
    from dapo_mcore.rewards.answers import also_rule

    prompts = [Prompt("p3", "7", "a:1"), Prompt("p2", "1", "a:2"), Prompt("p3", "8", "a:3")]
    pool = VerifierPool("dapo", workers=0)
    pieces = (Scripted(), Encoded, pool.verify, answer_extractor("dapo"), EvalSettings(k=4))
    also = {"gsm8k": also_rule("gsm8k")}
    alone = Validator({"held.jsonl": prompts}, *pieces, also=also).run()
    assert alone["eval/held/avg@4"] == pytest.approx((1 / 4 + 1 / 4 + 0) / 3)
    assert alone["eval/held:gsm8k/avg@4"] == pytest.approx((3 / 4 + 1 / 4 + 1 / 4) / 3)
    assert alone["eval/held:gsm8k/maj@4"] == pytest.approx(1 / 3)  # p3's majority is 7: right for a:1 only
    shares = {}

    def capture(obj):
        shares[1] = obj
        raise _Captured

    with pytest.raises(_Captured):
        Validator({"held.jsonl": prompts}, *pieces, replica=1, n_replicas=2, all_gather=capture, also=also).run()
    gather = lambda obj: [obj, shares[1]]
    assert (
        Validator({"held.jsonl": prompts}, *pieces, replica=0, n_replicas=2, all_gather=gather, also=also).run()
        == alone
    )

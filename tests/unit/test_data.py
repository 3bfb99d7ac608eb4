import json

import pytest
import torch

from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.batching import build_micro_batch, padded_length, split_for_data_parallel
from dapo_mcore.data.datasets import FeistelPermutation, PromptStream, load_jsonl_prompts
from dapo_mcore.data.types import Sample
from dapo_mcore.utils.errors import DataError


def test_arithmetic_answers_are_exact_and_cover_the_grid():
    task = ArithmeticTask(0, 9, "+-*")
    assert len(task) == 300
    for i in range(len(task)):
        a, op, b = task.operands(i)
        assert task[i].answer == str(eval(f"{a}{op}{b}"))  # noqa: S307 (our own literal ints)
        assert task[i].text == f"What is {a}{op}{b}?\n"


def test_prompt_stream_is_deterministic_and_resumes_from_its_state():
    task = ArithmeticTask(0, 4, "+")
    first = PromptStream(task, seed=3)
    head = first.take(40)  # crosses an epoch (25 prompts)
    state = first.state_dict()
    tail = first.take(10)
    again = PromptStream(task, seed=3)
    assert [p.uid for p in again.take(40)] == [p.uid for p in head]
    resumed = PromptStream(task, seed=3)
    resumed.load_state_dict(state)
    assert [p.uid for p in resumed.take(10)] == [p.uid for p in tail]
    assert sorted(p.uid for p in head[:25]) == sorted(p.uid for p in task)  # each epoch: every prompt once


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 100, 1000, 4097])
def test_the_feistel_permutation_is_a_seeded_bijection(n):
    order = [FeistelPermutation(n, "7/0")[i] for i in range(n)]
    assert sorted(order) == list(range(n))
    assert order == [FeistelPermutation(n, "7/0")[i] for i in range(n)]
    if n >= 100:  # another epoch's seed gives another order, and neither is the identity
        assert order != [FeistelPermutation(n, "7/1")[i] for i in range(n)] and order != list(range(n))


def test_a_grid_too_large_to_shuffle_as_a_list_streams_distinct_prompts_and_resumes():
    task = ArithmeticTask(10_000, 99_999)  # 8.1e9 problems: a shuffled list of them cannot be built
    stream = PromptStream(task, seed=1)
    head = [p.uid for p in stream.take(200)]
    assert len(set(head)) == 200
    resumed = PromptStream(task, seed=1)
    resumed.load_state_dict({"epoch": 0, "offset": 100})
    assert [p.uid for p in resumed.take(100)] == head[100:]


def test_jsonl_prompts_load_and_bad_rows_name_the_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "2+2?", "answer": 4}) + "\n\n" + json.dumps({"prompt": "x", "answer": "y"}))
    assert [(p.text, p.answer) for p in load_jsonl_prompts(good)] == [("2+2?", "4"), ("x", "y")]
    cases = {
        '{"prompt": "a"}': r"bad.jsonl:1: missing key 'answer'",
        '{"prompt": "a", "answer": 1': r"bad.jsonl:1: not valid JSON",
        '["a", 1]': r"bad.jsonl:1: expected a JSON object",
        '{"prompt": "", "answer": 1}': "must be a non-empty string",
        # every check against it timed out, and the warning named the model's answer
        json.dumps({"prompt": "a", "answer": "7" * 2_000_000}): r"bad.jsonl:1: the reference 'answer' is 2,000,000 "
        "characters, over 10,000",
    }
    for row, message in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(row + "\n")
        with pytest.raises(DataError, match=message):
            load_jsonl_prompts(bad)
    with pytest.raises(DataError, match="data file not found"):
        load_jsonl_prompts(tmp_path / "absent.jsonl")


def _sample(prompt, response, adv=1.0, old=None, trainable=True):
    return Sample(
        prompt_ids=prompt,
        response_ids=response,
        rollout_logprobs=[-1.0] * len(response),
        finish_reason="stop",
        advantage=adv,
        old_logprobs=old,
        trainable=trainable,
    )


def test_micro_batch_aligns_per_token_arrays_with_the_predicting_position():
    s = _sample([5, 6, 7], [8, 9], adv=0.5, old=[-0.1, -0.2])
    mb = build_micro_batch([s, None], [0, -1], seq_len=8, pad_id=0)
    assert mb.tokens[0].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert mb.labels[0, 2:4].tolist() == [8, 9]  # position 2 predicts response token 0
    assert mb.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert mb.old_logprobs[0, 2:4].tolist() == pytest.approx([-0.1, -0.2])
    assert mb.advantages[0].tolist() == [0, 0, 0.5, 0.5, 0, 0, 0, 0]
    assert mb.loss_mask[1].sum() == 0 and mb.sample_index == [0, -1]  # padding row: no loss
    assert mb.real_tokens == 5 and mb.tokens.numel() == 16  # padding efficiency 5 / 16


def test_untrainable_sample_keeps_its_response_mask_but_not_its_loss_mask():
    mb = build_micro_batch([_sample([5], [8, 9], trainable=False)], [0], seq_len=4, pad_id=0)
    assert mb.loss_mask.sum() == 0 and mb.response_mask.sum() == 2


def test_padded_length_rounds_the_longest_sample_up():
    assert padded_length([_sample([1] * 5, [2] * 4), _sample([1], [2])], multiple=8) == 16


def test_data_parallel_split_gives_every_rank_the_same_micro_batch_count():
    indices = list(range(7))
    splits = [split_for_data_parallel(indices, 2, r, micro_batch_size=2) for r in range(2)]
    assert splits[0] == [[0, 2], [4, 6]] and splits[1] == [[1, 3], [5, -1]]
    covered = sorted(i for s in splits for mb in s for i in mb if i >= 0)
    assert covered == indices
    assert torch.tensor([len(s) for s in splits]).unique().numel() == 1


def test_a_byte_identical_data_file_under_another_name_is_the_same_data(tmp_path):
    """The rows' hash included the file's name (through the prompt ids): a renamed copy was refused at resume as
    'the rows' content or order differs'. A save made before keeps being compared as it was."""
    from dapo_mcore.data.datasets import fingerprint_changes, load_jsonl_prompts, source_fingerprint

    first, copy = tmp_path / "train.jsonl", tmp_path / "train-copy.jsonl"
    first.write_text('{"prompt": "What is 1+1?", "answer": "2"}\n{"prompt": "What is 2+2?", "answer": "4"}\n')
    copy.write_bytes(first.read_bytes())
    saved, now = (source_fingerprint(p, load_jsonl_prompts(str(p))) for p in (first, copy))
    assert fingerprint_changes(saved, now) == []
    older_save = {k: v for k, v in saved.items() if k != "sha256_rows"}  # its hash includes the file's name
    assert fingerprint_changes(older_save, now) == ["the rows' content or order differs (sha256)"]
    copy.write_text('{"prompt": "What is 2+2?", "answer": "4"}\n{"prompt": "What is 1+1?", "answer": "2"}\n')
    reordered = source_fingerprint(copy, load_jsonl_prompts(str(copy)))
    assert fingerprint_changes(saved, reordered) == ["the rows' content or order differs (sha256)"]

"""The sampler's saved buffer (carried groups and partial rollout's unfinished answers, data/types.py
group_to_dict): per-token fields as compact tensors, not Python lists, each holding only its own tokens;
saves written before, with lists, still load and continue as the uninterrupted run."""

import io

import pytest
import torch

from dapo_mcore.data.types import ROUTING_DTYPE, Group, NotHere, Prompt, Sample, group_from_dict, group_to_dict
from tests.unit.test_partial_rollout import make, steps

TENSOR_DTYPES = {"prompt_ids": torch.int32, "response_ids": torch.int32, "rollout_logprobs": torch.float32}


def number_lists(value):
    """Every list or tuple of numbers anywhere in a nested state."""
    if isinstance(value, dict):
        yield from (found for item in value.values() for found in number_lists(item))
    elif isinstance(value, (list, tuple)):
        if any(isinstance(item, (int, float)) for item in value):
            yield value
        yield from (found for item in value for found in number_lists(item))


def saved_through_torch(state):
    """As a checkpoint's common state goes: torch.save, then torch.load without unpickling classes."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def as_old_format(state):
    """A sampler state as saves before tensors held it: the 1-D per-token fields as lists."""
    return {**state, "carry": _old_groups(state["carry"]), "unfinished": _old_groups(state["unfinished"])}


def _old_groups(groups):
    return [{**g, "samples": [{k: _list_if_1d(v) for k, v in s.items()} for s in g["samples"]]} for g in groups]


def _list_if_1d(value):
    return value.tolist() if isinstance(value, torch.Tensor) and value.dim() == 1 else value


def response_tokens(batch):
    return [[s.response_ids.tolist() for s in g.samples] for g in batch.groups]


def sampler_with_unfinished_answers():
    sampler, _ = make(dynamic_sampling=False)
    steps(sampler, 2)
    longest = max(len(s.response_ids) for g in sampler.unfinished for s in g.samples)
    assert longest >= 20, "the test needs long unfinished answers"
    return sampler


def test_a_saved_sampler_with_unfinished_answers_holds_no_per_token_lists():
    state = saved_through_torch(sampler_with_unfinished_answers().state_dict())
    assert max(len(found) for found in number_lists(state)) <= 2  # version runs: [version, n_tokens]
    saved = [s for g in state["unfinished"] + state["carry"] for s in g["samples"]]
    for field, dtype in TENSOR_DTYPES.items():
        assert all(isinstance(s[field], torch.Tensor) and s[field].dtype == dtype for s in saved), field


@pytest.mark.parametrize("old_format", [False, True])
def test_a_resumed_sampler_continues_its_unfinished_answers_as_the_uninterrupted_one(old_format):
    sampler = sampler_with_unfinished_answers()
    state = saved_through_torch(sampler.state_dict())
    resumed, _ = make(dynamic_sampling=False)
    resumed.load_state_dict(as_old_format(state) if old_format else state)
    for group in resumed.unfinished:  # one representation of tokens, whichever format the save had
        assert all(isinstance(s.response_ids, torch.Tensor) for s in group.samples)
    for a, b in zip(steps(sampler, 3, first=2), steps(resumed, 3, first=2)):
        assert a.metrics == b.metrics
        assert response_tokens(a) == response_tokens(b)


def test_a_saved_sample_that_views_a_larger_buffer_holds_only_its_own_tokens():
    flat = torch.arange(10_000, dtype=torch.int32)  # as the step's exchange delivers samples: views of one buffer
    routing = torch.zeros(10, 2, 1, dtype=ROUTING_DTYPE)
    sample = Sample(flat[:3], flat[3:8], torch.zeros(5), "abort", routed_experts=routing)
    saved = group_to_dict(Group(Prompt("p", "1"), [sample]))["samples"][0]
    assert saved["response_ids"].tolist() == [3, 4, 5, 6, 7]
    assert saved["response_ids"].untyped_storage().nbytes() == 5 * 4
    assert saved["routed_experts"] is routing  # owns its storage: saved as it is, not copied
    loaded = group_from_dict(saved_through_torch(group_to_dict(Group(Prompt("p", "1"), [sample]))))
    assert loaded.samples[0].response_ids.tolist() == [3, 4, 5, 6, 7]


def test_saving_a_sample_whose_tokens_another_rank_holds_is_refused():
    sample = Sample(NotHere(3), NotHere(5), NotHere(5), "stop")
    with pytest.raises(LookupError, match="another data-parallel rank holds them"):
        group_to_dict(Group(Prompt("p", "1"), [sample]))

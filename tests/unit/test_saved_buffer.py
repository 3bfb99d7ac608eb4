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


def as_old_format(state, files):
    """A sampler state as saves before tensors held it and before its pending groups had owners: the 1-D
    per-token fields as lists, every unfinished group in the common state."""
    unfinished = [g for name in sorted(files) for g in files[name]]
    common = {k: v for k, v in state.items() if k != "pending"}
    return {**common, "carry": _old_groups(state["carry"]), "unfinished": _old_groups(unfinished)}


def _old_groups(groups):
    return [{**g, "samples": [{k: _list_if_1d(v) for k, v in s.items()} for s in g["samples"]]} for g in groups]


def _list_if_1d(value):
    return value.tolist() if isinstance(value, torch.Tensor) and value.dim() == 1 else value


def response_tokens(batch):
    return [[s.response_ids.tolist() for s in g.samples] for g in batch.groups]


def sampler_with_unfinished_answers():
    sampler, _ = make(dynamic_sampling=False)
    steps(sampler, 2)
    longest = max(len(s.response_ids) for g in sampler.pending.own for s in g.samples)
    assert longest >= 20, "the test needs long unfinished answers"
    return sampler


def test_a_saved_sampler_with_unfinished_answers_holds_no_per_token_lists():
    sampler = sampler_with_unfinished_answers()
    state, files = saved_through_torch(sampler.state_dict()), saved_through_torch(sampler.own_files())
    assert max(len(found) for found in number_lists(state)) <= 3  # records: [version, answers begun, tokens]
    assert max(len(found) for found in number_lists(files)) <= 2  # version runs: [version, n_tokens]
    unfinished = [g for groups in files.values() for g in groups]
    saved = [s for g in unfinished + state["carry"] for s in g["samples"]]
    for field, dtype in TENSOR_DTYPES.items():
        assert all(isinstance(s[field], torch.Tensor) and s[field].dtype == dtype for s in saved), field


@pytest.mark.parametrize("old_format", [False, True])
def test_a_resumed_sampler_continues_its_unfinished_answers_as_the_uninterrupted_one(old_format):
    sampler = sampler_with_unfinished_answers()
    state, files = saved_through_torch(sampler.state_dict()), saved_through_torch(sampler.own_files())
    resumed, _ = make(dynamic_sampling=False)
    resumed.load_state_dict(as_old_format(state, files) if old_format else state, read=files.__getitem__)
    for group in resumed.pending.own:  # one representation of tokens, whichever format the save had
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

"""The packer: every sample exactly once, rows within the budget and balanced over DP ranks, and each packed
sample's tokens, positions, labels and per-token values where the unpacked layout puts them."""

import random

import pytest
import torch

from dapo_mcore.data.batching import (
    block_causal_mask,
    build_micro_batch,
    build_packed_micro_batch,
    plan_packed,
    sample_tokens,
    to_sequences,
)
from tests.helpers import random_samples


def _lengths(n, seed=0):
    rng = random.Random(seed)
    return [min(256, max(3, int(rng.lognormvariate(3.5, 0.9)))) for _ in range(n)]


@pytest.mark.parametrize("dp, rows_per_micro, budget", [(1, 1, 256), (2, 1, 256), (4, 2, 300), (2, 4, 0)])
def test_every_sample_is_packed_once_within_the_budget_and_ranks_get_equal_micro_batches(dp, rows_per_micro, budget):
    lengths = _lengths(97)
    indices = list(range(5, 97))  # a mini-batch that is not the whole list
    plans = [plan_packed(indices, lengths, dp, r, rows_per_micro, budget, 8) for r in range(dp)]
    packed = [i for p in plans for micro in p.micro_batches for row in micro for i in row]
    assert sorted(packed) == indices
    row_len = plans[0].row_len
    assert all(p.row_len == row_len for p in plans) and row_len % 8 == 0
    assert row_len <= max(budget, 256)
    assert len({len(p.micro_batches) for p in plans}) == 1  # same count on every rank
    for p in plans:
        for micro in p.micro_batches:
            assert len(micro) == rows_per_micro
            assert all(sum(lengths[i] for i in row) <= row_len for row in micro)
    per_rank = [sum(lengths[i] for micro in p.micro_batches for row in micro for i in row) for p in plans]
    assert max(per_rank) - min(per_rank) <= max(lengths)  # nearly equal real tokens per rank


def test_packing_wastes_little_on_long_tailed_lengths():
    lengths = _lengths(256, seed=1)
    plan = plan_packed(list(range(256)), lengths, 1, 0, 1, 256, 8)
    computed = plan.row_len * sum(len(m) for m in plan.micro_batches)
    assert sum(lengths) / computed > 0.9  # padded to the longest sample it would be ~0.2


def test_a_sample_longer_than_the_budget_widens_the_rows():
    plan = plan_packed([0, 1, 2], [40, 10, 10], 1, 0, 1, 16, 8)
    assert plan.row_len == 40 and sorted(i for m in plan.micro_batches for r in m for i in r) == [0, 1, 2]


def test_packed_rows_put_each_sample_where_the_padded_layout_does():
    samples = random_samples(6, seed=3)
    samples[2].response_ids, samples[2].rollout_logprobs, samples[2].old_logprobs = [7], [-1.0], [-2.0]
    rows = [[0, 1, 2], [3, 4], [], [5]]
    mb = build_packed_micro_batch(samples, rows, row_len=48, pad_id=0)
    assert mb.tokens.shape == (4, 48) and mb.sample_index == [0, 1, 2, 3, 4, 5]
    assert mb.real_tokens == sum(sample_tokens(s) for s in samples)
    for i, row, offset in mb.segments:
        n = sample_tokens(samples[i])
        single = build_micro_batch([samples[i]], [i], n, pad_id=0)
        cols = slice(offset, offset + n)
        assert torch.equal(mb.tokens[row, cols], single.tokens[0])
        assert torch.equal(mb.position_ids[row, cols], torch.arange(n))  # positions restart per sample
        # the last position is never a label of the next sample's first token
        assert torch.equal(mb.labels[row, cols], single.labels[0]) and mb.labels[row, offset + n - 1] == 0
        for key in ("loss_mask", "response_mask", "advantages", "old_logprobs", "rollout_logprobs"):
            assert torch.equal(getattr(mb, key)[row, cols], getattr(single, key)[0]), key
    assert mb.loss_mask[2].sum() == 0 and mb.response_mask.sum() == sum(len(s.response_ids) for s in samples)
    # the loss's one-row-per-sample view holds each sample's response values, zero mask past its end
    old_BL = to_sequences(mb.old_logprobs, mb.sequence_index)
    mask_BL = to_sequences(mb.response_mask, mb.sequence_index)
    for k, (i, _, _) in enumerate(mb.segments):
        n = len(samples[i].response_ids)
        assert old_BL[k, :n].tolist() == pytest.approx(samples[i].old_logprobs)
        assert mask_BL[k, :n].all() and not mask_BL[k, n:].any()


def test_mask_is_block_diagonal_causal():
    segment_ids = torch.tensor([[0, 0, 0, 1, 1, 2]])
    allowed = ~block_causal_mask(segment_ids)[0, 0]
    want = torch.zeros(6, 6, dtype=torch.bool)
    want[:3, :3] = torch.ones(3, 3).tril().bool()
    want[3:5, 3:5] = torch.ones(2, 2).tril().bool()
    want[5, 5] = True
    assert torch.equal(allowed, want)
    assert block_causal_mask(torch.zeros(2, 4, dtype=torch.long)).shape == (2, 1, 4, 4)


def test_packing_is_on_with_the_local_spec_and_off_with_te_unless_asked():
    from dapo_mcore.mcore.actor import packing_mode

    assert packing_mode("auto", use_te=False) == "mask" and packing_mode("auto", use_te=True) == "off"
    assert packing_mode("on", use_te=True) == "thd" and packing_mode("off", use_te=False) == "off"


@pytest.mark.parametrize(
    ("ep", "pp", "vpp", "mine", "most", "runs", "pad_len"),
    [
        (1, 1, 1, 3, 4, 3, 8),  # dense: its own count (DP reduces once, after the schedule)
        (1, 1, 1, 0, 4, 1, 8),  # an empty share still joins the schedule
        (2, 1, 1, 3, 4, 4, 8),  # expert parallelism: an all-to-all a micro-batch across DP ranks
        (2, 2, 1, 3, 4, 4, 640),  # pipeline stages send one shape: padding as long as the rest
        (1, 2, 2, 3, 4, 4, 640),  # the interleaved schedule: whole groups of pp
    ],
)
def test_the_one_rule_for_micro_batch_counts_and_padding(ep, pp, vpp, mine, most, runs, pad_len):
    """How many micro-batches a DP rank runs and how long a padding one is, for padded and packed rows alike
    (mcore/actor.py): the padding micro-batch was as long as the rank's longest row (up to 22.5k tokens at the
    recipes' shape) and dense ranks ran one too."""
    from types import SimpleNamespace

    from dapo_mcore.mcore.actor import PolicyRunner

    runner = SimpleNamespace(ctx=SimpleNamespace(ep_size=ep, pp_size=pp, vpp_size=vpp), _multiple=8)
    assert PolicyRunner._micro_batch_count(runner, mine, most) == runs
    assert PolicyRunner._padding_length(runner, 640) == pad_len

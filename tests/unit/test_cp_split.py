"""The context-parallel split (docs/design/context_parallel.md section 4): each CP rank's columns of a whole-built
micro-batch, Megatron's load-balanced row layout (bshd) and TE's per-sequence partition (THD), and the slot
padding that makes packed sequences divisible by 2 x CP."""

import itertools
import math
import random

import pytest
import torch

from dapo_mcore.data.batching import (
    block_causal_mask,
    build_micro_batch,
    build_packed_micro_batch,
    padded_length,
    padding_multiple,
    round_up,
    row_cp_columns,
    sample_tokens,
    slot_multiple,
    split_for_context_parallel,
    thd_cp_columns,
    to_sequences,
)
from dapo_mcore.data.types import ROUTING_DTYPE
from dapo_mcore.mcore.actor import _one_row
from tests.helpers import VOCAB, random_samples

PAD = 0
PER_TOKEN = ("loss_mask", "response_mask", "advantages", "old_logprobs", "rollout_logprobs", "ref_logprobs")


def _samples(n, seed, routing=True):
    samples = random_samples(n, seed=seed, max_prompt=13, max_response=17)
    rng = torch.Generator().manual_seed(seed)
    for s in samples:
        s.ref_logprobs = [-4.0 - k / 100 for k in range(len(s.response_ids))]
        if routing:  # [tokens - 1, layers, k]
            s.routed_experts = torch.randint(0, 8, (sample_tokens(s) - 1, 2, 2), generator=rng).to(ROUTING_DTYPE)
    return samples


def _bshd(cp, seed=0):
    samples = _samples(5, seed)
    batch = [samples[0], None, *samples[1:]]  # a padding row too
    seq_len = padded_length(samples, padding_multiple(1, cp))
    return build_micro_batch(batch, [0, -1, 1, 2, 3, 4], seq_len, PAD)


def _thd(cp, seed=0, tp_sp=1):
    """The actor's THD layout: packed rows (one empty) laid end to end as one row, slots padded for `cp`."""
    samples = _samples(7, seed)
    slot = slot_multiple(tp_sp, cp)
    rows = [[0, 1, 2], [3], [], [4, 5, 6]]
    row_len = round_up(
        max(sum(round_up(sample_tokens(samples[i]), slot) for i in r) for r in rows), padding_multiple(tp_sp, cp)
    )
    return samples, _one_row(build_packed_micro_batch(samples, rows, row_len, PAD, slot_multiple=slot))


def _random_cu_seqlens(cp, n, rng):
    lengths = [2 * cp * rng.randint(1, 9) for _ in range(n)]
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def test_the_padding_granules():
    assert [padding_multiple(t) for t in (1, 2, 4, 8)] == [8, 8, 8, 8]  # C = 1 unchanged: lcm(8, tp_sp)
    assert padding_multiple(3) == 24
    assert padding_multiple(1, 2) == 8 and padding_multiple(1, 8) == 16 and padding_multiple(8, 2) == 32
    assert padding_multiple(8, 4) == 64 and 22_528 % padding_multiple(8, 4) == 0  # the 32B recipe's capped answer
    assert slot_multiple(8) == 1 and slot_multiple(1, 2) == 4 and slot_multiple(8, 4) == 64
    for tp_sp in (1, 2, 3, 8):
        for cp in (1, 2, 3, 4):
            m = padding_multiple(tp_sp, cp)
            assert m % padding_multiple(tp_sp) == 0 and m % slot_multiple(tp_sp, cp) == 0
            assert (m // cp) % tp_sp == 0  # each rank's share splits over the SP ranks


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_the_columns_of_all_ranks_partition_the_row(cp):
    length = 2 * cp * 5
    cols = [row_cp_columns(length, cp, r) for r in range(cp)]
    assert all(len(c) == length // cp for c in cols)
    assert torch.equal(torch.cat(cols).sort().values, torch.arange(length))
    cu = _random_cu_seqlens(cp, 6, random.Random(cp))
    cols = [thd_cp_columns(cu, cp, r) for r in range(cp)]
    assert all(len(c) == int(cu[-1]) // cp for c in cols)
    assert torch.equal(torch.cat(cols).sort().values, torch.arange(int(cu[-1])))


@pytest.mark.parametrize("cp", [2, 4])
def test_bshd_columns_select_what_megatron_selects(cp, monkeypatch):
    # Megatron's own function, its CP size and rank from parallel_state (cp_group=None) patched: no process group
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    mb = _bshd(cp)
    mb.routing_compared = mb.response_mask > 0
    keys = ("tokens", "labels", "position_ids", "padding", "routing", "routing_compared", *PER_TOKEN)
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
    for r in range(cp):
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda r=r: r)
        theirs = get_batch_on_this_cp_rank({k: getattr(mb, k).clone() for k in keys})
        ours = split_for_context_parallel(mb, cp, r)
        for k in keys:
            assert torch.equal(getattr(ours, k), theirs[k]), k
        assert torch.equal(ours.tokens, mb.tokens[:, ours.cp_columns]) and ours.full_length == mb.tokens.shape[1]
        assert ours.sample_index == mb.sample_index and ours.segments == mb.segments


def _formula_columns(cu, cp, r):
    """Section 4's formula, one local token at a time: local token u of sequence i (padded length L_i = 2C c_i,
    global start o_i, local start o_i / C) is at o_i + u + c_i r if u < c_i, else o_i + (u - c_i) + c_i (2C-1-r)."""
    cu = cu.tolist()
    out = [0] * (cu[-1] // cp)
    for o, end in zip(cu, cu[1:]):
        c = (end - o) // (2 * cp)
        for u in range(2 * c):
            out[o // cp + u] = o + u + c * r if u < c else o + (u - c) + c * (2 * cp - 1 - r)
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_thd_columns_equal_the_partition_formula(cp):
    rng = random.Random(cp)
    for _ in range(20):
        cu = _random_cu_seqlens(cp, rng.randint(1, 8), rng)
        for r in range(cp):
            assert thd_cp_columns(cu, cp, r).tolist() == _formula_columns(cu, cp, r)
    one = torch.tensor([0, 2 * cp * 7], dtype=torch.int32)  # one sequence: the row split
    assert all(torch.equal(thd_cp_columns(one, cp, r), row_cp_columns(2 * cp * 7, cp, r)) for r in range(cp))


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_causal_work_is_equal_on_every_rank(cp):
    c = 6
    work = [int((row_cp_columns(2 * cp * c, cp, r) + 1).sum()) for r in range(cp)]
    assert work == [c * ((2 * cp - 1) * c + c + 1)] * cp
    # THD: per sequence, the same with positions inside the sequence
    cu = _random_cu_seqlens(cp, 5, random.Random(7))
    starts = torch.repeat_interleave(cu[:-1].long(), cu.diff().long())
    work = [int((thd_cp_columns(cu, cp, r) - starts[thd_cp_columns(cu, cp, r)] + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1


@pytest.mark.parametrize("cp", [2, 4])
def test_labels_of_each_chunk_end_are_the_next_global_token(cp):
    mb = _bshd(cp)
    s = mb.tokens.shape[1]
    c = s // (2 * cp)
    for r in range(cp):
        part = split_for_context_parallel(mb, cp, r)
        for local, global_ in ((c - 1, (r + 1) * c - 1), (2 * c - 1, (2 * cp - r) * c - 1)):
            assert int(part.cp_columns[local]) == global_
            expected = mb.tokens[:, global_ + 1] if global_ + 1 < s else torch.full_like(mb.tokens[:, 0], PAD)
            assert torch.equal(part.labels[:, local], expected)
        inside = part.cp_columns < s - 1  # every label is the next global token, not a local neighbour
        assert torch.equal(part.labels[:, inside], mb.tokens[:, part.cp_columns[inside] + 1])
    # THD: the same inside each sequence; a sample's last position and its slot's pads keep the pad label
    samples, mb = _thd(cp)
    for r in range(cp):
        part = split_for_context_parallel(mb, cp, r)
        assert torch.equal(part.labels, mb.labels[:, part.cp_columns])
        seq_ends, cols = set(part.cu_seqlens[1:].tolist()), part.cp_columns.tolist()
        checked = 0
        for local, col in enumerate(cols):
            if cols[local + 1 : local + 2] == [col + 1] or part.padding[0, local]:
                continue  # not a chunk's last column (the next one is local), or a pad
            if col + 1 in seq_ends or mb.padding[0, col + 1]:
                assert part.labels[0, local] == PAD  # a sample's last token predicts nothing
            else:  # inside a sample: the next token, which another rank holds
                assert part.labels[0, local] == mb.tokens[0, col + 1]
                checked += 1
        assert checked > 0


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_response_positions_over_all_ranks_are_the_samples(cp):
    mb = _bshd(cp)
    parts = [split_for_context_parallel(mb, cp, r) for r in range(cp)]
    for row, i in enumerate(mb.sample_index):
        held = sorted(int(c) for p in parts for c in p.cp_columns[p.response_mask[row] > 0])
        if i < 0:
            assert held == []
            continue
        prompt, n = len(_samples(5, 0)[i].prompt_ids), len(_samples(5, 0)[i].response_ids)
        assert held == list(range(prompt - 1, prompt - 1 + n))
    assert sum(p.real_tokens for p in parts) == mb.real_tokens
    # THD: each rank's one-row-per-sample view holds the sample's response token j at [k, j] or 0; they add up
    samples, mb = _thd(cp)
    parts = [split_for_context_parallel(mb, cp, r) for r in range(cp)]
    assert sum(p.real_tokens for p in parts) == mb.real_tokens == sum(sample_tokens(s) for s in samples)
    for key in PER_TOKEN:
        whole = to_sequences(getattr(mb, key), mb.sequence_index)
        assert torch.equal(sum(to_sequences(getattr(p, key), p.sequence_index) for p in parts), whole), key
    held = torch.stack([to_sequences(p.response_mask, p.sequence_index) for p in parts])
    assert held.sum(0).le(1).all()  # no response position on two ranks
    for p in parts:  # the rank's index points at its own column of the same global position
        valid = to_sequences(p.response_mask, p.sequence_index) > 0
        assert torch.equal(p.cp_columns[p.sequence_index[1][valid]], mb.sequence_index[1][valid])
    assert torch.equal(torch.cat([p.cp_columns for p in parts]).sort().values, torch.arange(mb.tokens.shape[1]))


@pytest.mark.parametrize("cp", [2, 4])
def test_thd_split_keeps_routing_positions_and_global_cu_seqlens(cp):
    samples, mb = _thd(cp, seed=1, tp_sp=2)
    for r in range(cp):
        part = split_for_context_parallel(mb, cp, r)
        cols = part.cp_columns
        for key in ("tokens", "position_ids", "segment_ids", "padding"):
            assert torch.equal(getattr(part, key), getattr(mb, key)[:, cols]), key
        assert torch.equal(part.routing, mb.routing[:, cols]) and part.routing.shape[2:] == (2, 2)
        assert part.cu_seqlens.dtype == torch.int32 and int(part.cu_seqlens[-1]) == mb.tokens.shape[1]
        assert (part.cu_seqlens.diff() % (2 * cp * 2) == 0).all()  # slots of 2 C tp_sp
        assert part.max_seqlen == int(part.cu_seqlens.diff().max())
        assert part.tokens.shape[1] % 2 == 0  # the rank's share splits over the SP ranks


def test_refusals_name_the_granule():
    with pytest.raises(ValueError, match="padding_multiple"):
        row_cp_columns(12, 4, 0)
    with pytest.raises(ValueError, match="slot_multiple"):
        thd_cp_columns(torch.tensor([0, 8, 14], dtype=torch.int32), 2, 1)
    with pytest.raises(ValueError, match="CP rank"):
        row_cp_columns(16, 2, 2)
    samples = _samples(3, 0, routing=False)
    unslotted = build_packed_micro_batch(samples, [[0, 1, 2]], 64, PAD)
    assert any(sample_tokens(s) % 4 for s in samples)
    with pytest.raises(ValueError, match="slot_multiple"):
        split_for_context_parallel(unslotted, 2, 0)
    with pytest.raises(ValueError, match="one row"):
        split_for_context_parallel(build_packed_micro_batch(samples, [[0], [1, 2]], 64, PAD, 4), 2, 0)
    part = split_for_context_parallel(_bshd(2), 2, 0)
    with pytest.raises(ValueError, match="already"):
        split_for_context_parallel(part, 2, 0)


def _toy_logprobs(mb, seed=0):
    """Log-probs of the labels under a one-layer causal attention model over the block mask (float64)."""
    g = torch.Generator().manual_seed(seed)
    h = 16
    emb, pos = torch.randn(VOCAB, h, generator=g), torch.randn(512, h, generator=g)
    wq, wk, wv, head = (torch.randn(h, n, generator=g) / math.sqrt(h) for n in (h, h, h, VOCAB))
    x = (emb[mb.tokens] + pos[mb.position_ids]).double()
    q, k, v = x @ wq.double(), x @ wk.double(), x @ wv.double()
    scores = (q @ k.transpose(1, 2) / math.sqrt(h)).masked_fill(block_causal_mask(mb.segment_ids)[:, 0], -math.inf)
    logits = (x + scores.softmax(-1) @ v) @ head.double()
    return logits.log_softmax(-1).gather(-1, mb.labels[..., None]).squeeze(-1)


@pytest.mark.parametrize("slot", [4, 8, 16])
def test_slot_padding_leaves_the_packed_log_prob_positions_unchanged_at_cp1(slot):
    samples = _samples(7, seed=2, routing=False)
    rows = [[0, 1, 2], [3, 4], [], [5, 6]]
    row_len = round_up(max(sum(round_up(sample_tokens(samples[i]), slot) for i in r) for r in rows), 16)
    plain = build_packed_micro_batch(samples, rows, row_len, PAD)
    slotted = build_packed_micro_batch(samples, rows, row_len, PAD, slot_multiple=slot)
    assert slotted.real_tokens == plain.real_tokens and slotted.padding.logical_not().sum() == plain.real_tokens
    for key in ("labels", *PER_TOKEN):
        whole = to_sequences(getattr(plain, key), plain.sequence_index)
        assert torch.equal(to_sequences(getattr(slotted, key), slotted.sequence_index), whole), key
    for i, row, offset in slotted.segments:  # the slot's pads: the sample's segment, positions going on, unscored
        n = sample_tokens(samples[i])
        end = offset + round_up(n, slot)
        assert (slotted.segment_ids[row, offset:end] == slotted.segment_ids[row, offset]).all()
        assert torch.equal(slotted.position_ids[row, offset:end], torch.arange(end - offset))
        assert (slotted.labels[row, offset + n - 1 : end] == PAD).all() and slotted.padding[row, offset + n : end].all()
        assert slotted.loss_mask[row, offset + n - 1 : end].sum() == 0
    mask = to_sequences(plain.response_mask, plain.sequence_index) > 0
    ours = to_sequences(_toy_logprobs(slotted), slotted.sequence_index)[mask]
    torch.testing.assert_close(ours, to_sequences(_toy_logprobs(plain), plain.sequence_index)[mask], rtol=0, atol=1e-12)
    # and split at C = 1 it is the same micro-batch
    part = split_for_context_parallel(_one_row(slotted), 1, 0)
    assert torch.equal(part.tokens, _one_row(slotted).tokens) and part.full_length == 4 * row_len

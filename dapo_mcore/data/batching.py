"""Samples -> padded micro-batch tensors for the actor, and the split of a mini-batch over DP ranks.

Token layout of one row: prompt tokens, then response tokens, then padding. Position t predicts token
t + 1, so the response token j (0-based) is scored at position len(prompt) - 1 + j; every per-token array
below ([b, s], "label-aligned") uses that position. Legend: b rows, s sequence positions.

Packed rows (build_packed_micro_batch) hold several samples back to back, each laid out as above from its
offset in the row, with positions restarting at 0 and a segment id per token: attention stays inside a
segment (block_causal_mask) and a sample's last position is never scored (it would predict the next
sample's first token). Legend there: B samples of the micro-batch, L their longest response.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from dapo_mcore.data.types import Sample


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s] long
    position_ids: torch.Tensor  # [b, s] long
    labels: torch.Tensor  # [b, s] long, tokens shifted left by one
    loss_mask: torch.Tensor  # [b, s] float, 1 where a trainable response token is predicted
    response_mask: torch.Tensor  # [b, s] float, 1 at every response position (trainable or not)
    advantages: torch.Tensor  # [b, s] float, A_i broadcast over the response
    old_logprobs: torch.Tensor  # [b, s] float, 0 where unknown
    rollout_logprobs: torch.Tensor  # [b, s] float
    ref_logprobs: torch.Tensor  # [b, s] float, 0 where unknown
    # Index of each row in the caller's sample list; -1 for a padding row (no loss).
    sample_index: list[int]
    # Prompt + response tokens of the real samples; tokens.numel() is what the model computes.
    real_tokens: int = 0
    # (sample index, row, offset in the row) of every sample: where its tokens start.
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    # Packed rows only: [b, s] long, one id per sample (and one for a row's padding tail), and [2, B, L]
    # (row, column) of each sample's response positions, pointing at a never-scored position past its end.
    segment_ids: torch.Tensor | None = None
    sequence_index: torch.Tensor | None = None
    # [b, s] bool, True at padding positions (no sample's token): mixture-of-experts routers leave them out
    # of their load-balancing loss (Megatron's padding_mask).
    padding: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return MicroBatch(**moved)


def sample_tokens(sample: Sample) -> int:
    return len(sample.prompt_ids) + len(sample.response_ids)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_length(samples: list[Sample], multiple: int = 8) -> int:
    """One sequence length for a whole mini-batch, so pipeline stages exchange same-shape tensors."""
    return round_up(max(sample_tokens(s) for s in samples), multiple)


_PER_TOKEN = ("loss_mask", "response_mask", "advantages", "old_logprobs", "rollout_logprobs", "ref_logprobs")


def build_micro_batch(samples: list[Sample | None], indices: list[int], seq_len: int, pad_id: int) -> MicroBatch:
    """Rows for the given samples; a None sample is a padding row that contributes no loss."""
    b = len(samples)
    tokens = torch.full((b, seq_len), pad_id, dtype=torch.long)
    per_token = {k: torch.zeros(b, seq_len) for k in _PER_TOKEN}
    for row, sample in enumerate(samples):
        if sample is not None:
            _lay_out(sample, row, 0, tokens, per_token)
    labels = torch.roll(tokens, shifts=-1, dims=1)
    labels[:, -1] = pad_id
    position_ids = torch.arange(seq_len).expand(b, seq_len).clone()
    real = sum(sample_tokens(s) for s in samples if s is not None)
    segments = [(i, row, 0) for row, i in enumerate(indices) if i >= 0]
    padding = torch.ones(b, seq_len, dtype=torch.bool)
    for row, sample in enumerate(samples):
        if sample is not None:
            padding[row, : sample_tokens(sample)] = False
    return MicroBatch(
        tokens=tokens,
        position_ids=position_ids,
        labels=labels,
        sample_index=indices,
        real_tokens=real,
        segments=segments,
        padding=padding,
        **per_token,
    )


def _lay_out(sample: Sample, row: int, offset: int, tokens: torch.Tensor, per_token: dict[str, torch.Tensor]) -> None:
    """Write one sample's tokens and label-aligned values into `row` from column `offset`."""
    ids = torch.cat(
        [torch.as_tensor(sample.prompt_ids, dtype=torch.long), torch.as_tensor(sample.response_ids, dtype=torch.long)]
    )
    if offset + len(ids) > tokens.shape[1]:
        raise ValueError(f"sample of {len(ids)} tokens does not fit seq_len={tokens.shape[1]} at offset {offset}")
    tokens[row, offset : offset + len(ids)] = ids
    span = slice(offset + len(sample.prompt_ids) - 1, offset + len(ids) - 1)
    n_resp = len(sample.response_ids)
    per_token["response_mask"][row, span] = 1.0
    per_token["loss_mask"][row, span] = float(sample.trainable)
    per_token["advantages"][row, span] = sample.advantage
    per_token["rollout_logprobs"][row, span] = torch.as_tensor(sample.rollout_logprobs[:n_resp], dtype=torch.float32)
    for key in ("old_logprobs", "ref_logprobs"):
        if getattr(sample, key) is not None:
            per_token[key][row, span] = torch.as_tensor(getattr(sample, key), dtype=torch.float32)


def split_for_data_parallel(indices: list[int], dp_size: int, dp_rank: int, micro_batch_size: int) -> list[list[int]]:
    """This DP rank's micro-batches of sample indices (-1 pads).

    Every DP rank gets the same number of micro-batches of the same size (pipeline schedules and gradient
    reduction need that); padding rows carry no tokens into the loss, so the per-token normalisation is
    unchanged. Samples are dealt to ranks round-robin in the order given.
    """
    local = indices[dp_rank::dp_size]
    per_rank = -(-len(indices) // dp_size)
    n_micro = max(1, -(-per_rank // micro_batch_size))
    padded = local + [-1] * (n_micro * micro_batch_size - len(local))
    return [padded[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(n_micro)]


def balance_by_tokens(indices: list[int], lengths: Sequence[int] | Mapping[int, int], dp_size: int) -> list[list[int]]:
    """Deal samples to DP ranks so their token counts are as equal as greedy can make them (longest first,
    each to the least-loaded rank). Deterministic: ties go to the lower rank and the earlier sample."""
    loads, parts = [0] * dp_size, [[] for _ in range(dp_size)]
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        parts[rank].append(i)
        loads[rank] += lengths[i]
    return parts


def token_budget_micro_batches(
    indices: list[int], lengths: list[int], max_tokens: int, multiple: int = 8
) -> list[list[int]]:
    """Micro-batches whose padded size (rows x longest row, rounded up to `multiple`) stays within
    max_tokens. Samples go longest first, so each micro-batch pads little; a sample longer than the budget
    gets a micro-batch of its own."""
    batches: list[list[int]] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        if batches:
            longest = round_up(lengths[batches[-1][0]], multiple)  # the first row is the longest
            if longest * (len(batches[-1]) + 1) <= max_tokens:
                batches[-1].append(i)
                continue
        batches.append([i])
    return batches


# ---- packing: several samples per row -----------------------------------------------------------------------
@dataclass(frozen=True)
class PackedPlan:
    """One mini-batch packed for one DP rank: micro-batches of rows of sample indices, one row length."""

    micro_batches: list[list[list[int]]]  # [micro-batch][row] -> sample indices in row order
    row_len: int


def balanced_rows(lengths: dict[int, int], row_len: int, group: int) -> list[list[int]]:
    """Samples into a multiple of `group` rows of at most row_len tokens each, loads as equal as possible.

    Longest first, each sample to the least-loaded row (LPT); the row count starts at the lower bound
    (total tokens / row_len) and grows by `group` while a sample does not fit. Balanced rows let the row
    length shrink to the fullest row, and balanced rows balance DP ranks. Deterministic (ties: lower row,
    earlier sample), so every rank computes the same rows.
    """
    n_rows = max(1, round_up(-(-sum(lengths.values()) // row_len), group))
    while True:
        rows = balance_by_tokens(list(lengths), lengths, n_rows)  # the same greedy as DP balancing
        if all(sum(lengths[i] for i in row) <= row_len for row in rows):
            return rows
        n_rows += group


def deal_rows(rows: list[list[int]], loads: list[int], dp_size: int) -> list[list[list[int]]]:
    """Rows (a multiple of dp_size) to DP ranks, each the same number: heaviest first in snake order
    (0..dp-1, dp-1..0, ...), so real-token counts per rank differ by at most about one row's imbalance."""
    order = sorted(range(len(rows)), key=lambda r: (-loads[r], r))
    parts: list[list[list[int]]] = [[] for _ in range(dp_size)]
    for k, r in enumerate(order):
        lap, pos = divmod(k, dp_size)
        parts[pos if lap % 2 == 0 else dp_size - 1 - pos].append(rows[r])
    return parts


def plan_packed(
    indices: list[int], lengths: list[int], dp_size: int, dp_rank: int, rows_per_micro: int, budget: int, multiple: int
) -> PackedPlan:
    """This DP rank's packed micro-batches of the mini-batch `indices`.

    Rows hold at most `budget` tokens (a sample longer than that widens every row to its length); every
    rank gets the same number of micro-batches of `rows_per_micro` rows (empty rows are padding), and all
    rows share one length, the fullest row's rounded up to `multiple`: pipeline stages send one shape.
    """
    mine = {i: lengths[i] for i in indices}
    row_budget = max(budget // multiple * multiple, round_up(max(mine.values()), multiple))
    rows = balanced_rows(mine, row_budget, dp_size * rows_per_micro)
    loads = [sum(mine[i] for i in row) for row in rows]
    local = deal_rows(rows, loads, dp_size)[dp_rank]
    micro = [local[k : k + rows_per_micro] for k in range(0, len(local), rows_per_micro)]
    return PackedPlan(micro_batches=micro, row_len=round_up(max(loads), multiple))


def build_packed_micro_batch(samples: list[Sample], rows: list[list[int]], row_len: int, pad_id: int) -> MicroBatch:
    """Rows of samples packed back to back (`rows` holds indices into `samples`; an empty row is padding)."""
    b = len(rows)
    tokens = torch.full((b, row_len), pad_id, dtype=torch.long)
    position_ids = torch.zeros(b, row_len, dtype=torch.long)
    segment_ids = torch.zeros(b, row_len, dtype=torch.long)
    padding = torch.ones(b, row_len, dtype=torch.bool)
    per_token = {k: torch.zeros(b, row_len) for k in _PER_TOKEN}
    segments, last_positions, segment = [], [], 0
    for row, indices in enumerate(rows):
        offset = 0
        for i in indices:
            n = sample_tokens(samples[i])
            _lay_out(samples[i], row, offset, tokens, per_token)
            position_ids[row, offset : offset + n] = torch.arange(n)
            segment_ids[row, offset : offset + n] = segment
            padding[row, offset : offset + n] = False
            segments.append((i, row, offset))
            last_positions.append((row, offset + n - 1))
            offset, segment = offset + n, segment + 1
        # the padding tail is a segment of its own: it attends only to itself and is never scored
        position_ids[row, offset:] = torch.arange(row_len - offset)
        segment_ids[row, offset:] = segment
        segment += 1
    labels = torch.roll(tokens, shifts=-1, dims=1)
    for row, col in last_positions + [(row, row_len - 1) for row in range(b)]:
        labels[row, col] = pad_id  # a sample's last position would predict the next sample's first token
    return MicroBatch(
        tokens=tokens,
        position_ids=position_ids,
        labels=labels,
        sample_index=[i for row in rows for i in row],
        real_tokens=sum(sample_tokens(samples[i]) for row in rows for i in row),
        segments=segments,
        segment_ids=segment_ids,
        sequence_index=_sequence_index(samples, segments, row_len),
        padding=padding,
        **per_token,
    )


def _sequence_index(samples: list[Sample], segments: list[tuple[int, int, int]], row_len: int) -> torch.Tensor:
    """[2, B, L] (row, column) of each sample's response positions; the rest point at row 0's last column,
    which no sample ever scores (a sample's last token predicts nothing), so every mask there is 0."""
    n_resp = [len(samples[i].response_ids) for i, _, _ in segments]
    index = torch.zeros(2, max(len(segments), 1), max(n_resp, default=1), dtype=torch.long)
    index[1] = row_len - 1
    for k, ((i, row, offset), n) in enumerate(zip(segments, n_resp)):
        start = offset + len(samples[i].prompt_ids) - 1
        index[0, k, :n] = row
        index[1, k, :n] = torch.arange(start, start + n)
    return index


def block_causal_mask(segment_ids_bs: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool, True where attention is masked (Megatron's convention): a position sees only
    earlier positions of its own segment."""
    s = segment_ids_bs.shape[1]
    causal_ss = torch.ones(s, s, dtype=torch.bool, device=segment_ids_bs.device).tril()
    same_bss = segment_ids_bs[:, :, None] == segment_ids_bs[:, None, :]
    return ~(same_bss & causal_ss).unsqueeze(1)


def to_sequences(values_bs: torch.Tensor, sequence_index: torch.Tensor | None) -> torch.Tensor:
    """[b, s] label-aligned values of packed rows -> [B, L], one row per sample (what the loss expects);
    unpacked rows (no index) already are one sample each."""
    return values_bs if sequence_index is None else values_bs[sequence_index[0], sequence_index[1]]

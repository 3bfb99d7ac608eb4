"""Samples -> padded micro-batch tensors for the actor, and the split of a mini-batch over DP ranks.

Token layout of one row: prompt tokens, then response tokens, then padding. Position t predicts token
t + 1, so the response token j (0-based) is scored at position len(prompt) - 1 + j; every per-token array
below ([b, s], "label-aligned") uses that position. Legend: b rows, s sequence positions.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def build_micro_batch(samples: list[Sample | None], indices: list[int], seq_len: int, pad_id: int) -> MicroBatch:
    """Rows for the given samples; a None sample is a padding row that contributes no loss."""
    b = len(samples)
    tokens = torch.full((b, seq_len), pad_id, dtype=torch.long)
    per_token = {
        k: torch.zeros(b, seq_len)
        for k in ("loss_mask", "response_mask", "advantages", "old_logprobs", "rollout_logprobs", "ref_logprobs")
    }
    for row, sample in enumerate(samples):
        if sample is None:
            continue
        ids = sample.prompt_ids + sample.response_ids
        if len(ids) > seq_len:
            raise ValueError(f"sample of {len(ids)} tokens does not fit seq_len={seq_len}")
        tokens[row, : len(ids)] = torch.tensor(ids)
        span = slice(len(sample.prompt_ids) - 1, len(ids) - 1)
        n_resp = len(sample.response_ids)
        per_token["response_mask"][row, span] = 1.0
        per_token["loss_mask"][row, span] = float(sample.trainable)
        per_token["advantages"][row, span] = sample.advantage
        per_token["rollout_logprobs"][row, span] = torch.tensor(sample.rollout_logprobs[:n_resp])
        for key in ("old_logprobs", "ref_logprobs"):
            if getattr(sample, key) is not None:
                per_token[key][row, span] = torch.tensor(getattr(sample, key))
    labels = torch.roll(tokens, shifts=-1, dims=1)
    labels[:, -1] = pad_id
    position_ids = torch.arange(seq_len).expand(b, seq_len).clone()
    real = sum(sample_tokens(s) for s in samples if s is not None)
    return MicroBatch(
        tokens=tokens, position_ids=position_ids, labels=labels, sample_index=indices, real_tokens=real, **per_token
    )


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


def balance_by_tokens(indices: list[int], lengths: list[int], dp_size: int) -> list[list[int]]:
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

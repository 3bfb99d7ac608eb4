"""Which of a step's micro-batches the actor computes, and how much of each.

Training computes every micro-batch whole (`EveryMicroBatch`). A scale rehearsal (`trainer.rehearsal_micro_batches
= k`, docs/rehearsal.md) builds and holds every micro-batch exactly as training does, but computes only k of them,
cut short (`RehearsalCompute`): at the recipes' counts the full compute would take core-days on a CPU. The actor
asks its selection and knows nothing of rehearsals; their rules live here.
"""

from __future__ import annotations

import torch

from dapo_mcore.data.batching import MicroBatch, round_up

# A rehearsal computes a micro-batch's first rows, each cut to its first REHEARSAL_LENGTH positions, within
# REHEARSAL_TOKENS tokens: the same compute and workspace at every world size (4 rows x 4 heads x 1024^2 fp32
# scores = 64 MB with the rehearsal's model), whatever lengths were drawn.
REHEARSAL_TOKENS, REHEARSAL_LENGTH = 4096, 1024


class EveryMicroBatch:
    """Training: every micro-batch of every mini-batch, whole."""

    def computed(self, mini_batch: int, micro: list[MicroBatch]) -> list[int]:
        """The positions in `micro` (mini-batch `mini_batch`'s micro-batches) to compute."""
        return list(range(len(micro)))

    def cut(self, mb: MicroBatch) -> MicroBatch:
        """What of a computed micro-batch goes through the model."""
        return mb

    def logprobs(self, computed_bs: torch.Tensor | None, mb: MicroBatch) -> torch.Tensor:
        """A micro-batch's log-probs [b, s] from what was computed of it."""
        assert computed_bs is not None, "every micro-batch is computed in training"
        return computed_bs


class RehearsalCompute(EveryMicroBatch):
    """A rehearsal's k micro-batches: those with the shortest rows of the first mini-batch (each cut to its first
    rows within REHEARSAL_TOKENS) and none of the others. The shortest rows: the local layers' attention scores
    grow with rows x length^2 (one 16k-token row took 4.4 GB), and the head with the tokens (3 ms each on a CPU
    core at a 152k vocabulary). Every rank takes the same number from the same mini-batches, so the collectives
    match. Positions left uncomputed take the engine's log-probs."""

    def __init__(self, micro_batches: int, multiple: int):
        self.micro_batches, self.multiple = micro_batches, multiple

    def computed(self, mini_batch: int, micro: list[MicroBatch]) -> list[int]:
        if mini_batch > 0:
            return []
        # real ones first: a padding micro-batch (expert parallelism) is the shortest, and computes nothing real
        shortest = sorted(
            range(len(micro)),
            key=lambda i: (not micro[i].real_tokens, micro[i].tokens.shape[1], micro[i].tokens.numel(), i),
        )
        return sorted(shortest[: self.micro_batches])

    def cut(self, mb: MicroBatch) -> MicroBatch:
        """The first rows and positions (views) within REHEARSAL_LENGTH a row and REHEARSAL_TOKENS in all; packed
        rows are kept whole. The whole micro-batch is still built and held; only the compute is cut. A CP rank's
        share (cp_columns) is not cut again: under context parallelism the actor cuts the whole micro-batch
        before the split (mcore/actor.py prepare)."""
        if mb.segment_ids is not None or mb.cp_columns is not None:
            return mb
        length = min(mb.tokens.shape[1], round_up(REHEARSAL_LENGTH, self.multiple))
        return first_rows(mb, max(1, REHEARSAL_TOKENS // length), length)

    def logprobs(self, computed_bs: torch.Tensor | None, mb: MicroBatch) -> torch.Tensor:
        if computed_bs is not None and computed_bs.shape == mb.rollout_logprobs.shape:
            return computed_bs
        logprobs_bs = mb.rollout_logprobs.clone()
        if computed_bs is not None:
            logprobs_bs[: computed_bs.shape[0], : computed_bs.shape[1]] = computed_bs
        return logprobs_bs


def compute_selection(rehearsal_micro_batches: int, multiple: int) -> EveryMicroBatch:
    """The selection of trainer.rehearsal_micro_batches (0: training's); `multiple`: the lengths' granularity."""
    if rehearsal_micro_batches > 0:
        return RehearsalCompute(rehearsal_micro_batches, multiple)
    return EveryMicroBatch()


def first_rows(mb: MicroBatch, rows: int, length: int) -> MicroBatch:
    """The micro-batch's first `rows` rows and first `length` positions of each (views of its tensors, [b, s,
    ...]); a sample cut short loses the loss of its later tokens."""
    rows = min(rows, mb.tokens.shape[0])
    cut = {k: (v[:rows, :length] if isinstance(v, torch.Tensor) else v) for k, v in vars(mb).items()}
    cut["sample_index"] = mb.sample_index[:rows]
    cut["segments"] = [segment for segment in mb.segments if segment[1] < rows]
    cut["real_tokens"] = mb.real_tokens * rows * length // mb.tokens.numel()  # (a statistic only)
    return MicroBatch(**cut)

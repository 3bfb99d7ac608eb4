"""Dynamic sampling (paper eq. 11): train only on groups whose accuracy is strictly between 0 and 1 (with graded
rewards, whose rewards are not all equal).

A group where every response is right (or every one wrong) has zero advantage everywhere and only shrinks
the effective batch; such groups are dropped and generation continues until the batch is full. Instead of a
fixed over-sampling multiplier, the next round's size can follow a running estimate of the keep rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def keep_group_mask(rewards_GN: torch.Tensor) -> torch.Tensor:
    """[G] bool: True where the N verifier rewards of the group are not all equal (reward std > 0). For verdicts
    (bool, or reward.correct / reward.wrong) that is 0 < accuracy < 1, eq. 11; for graded rewards, any spread."""
    values_GN = rewards_GN.to(torch.float64)
    return values_GN.amax(dim=1) > values_GN.amin(dim=1)


@dataclass
class KeepRateEstimator:
    """Running estimate of the groups dynamic sampling keeps per prompt taken from the data; round_size(needed)
    asks for enough prompts to fill `needed` groups at that rate (with a safety margin), within [min_prompts,
    max_prompts]; before any observation the rate is `initial`.

    Each round reports the prompts it took and the groups it kept, and the rate is the ratio of the two counts'
    moving averages. Why prompts taken, not groups returned: under partial rollout a round returns only the
    groups whose answers all ended before its stop, which are mostly the short ones (a long answer is the one
    left unfinished), so the kept fraction of those is the keep rate of short answers, off whenever length and
    informativeness go together (hard prompts: long answers and mixed verdicts). Counting every prompt once, in
    the round that takes it, and every kept group once, in the round that judges it (begun in any round), no
    group is selected by its length: over a window longer than an answer's wait the ratio is the kept groups a
    prompt yields, with the groups dropped as stale counted as taken and never kept, which is what sizing a
    round needs. While the buffer first fills the kept count lags (rounds come out larger, and partial rollout
    continues their extra groups later). A ratio of averages, not an average of ratios: a round may take no new
    prompt (all its inputs continued) and still keep groups, and each group weighs the same whatever its
    round's size. A synchronous round returns every group it took, so there both counts agree with the old."""

    initial: float = 1.0
    smoothing: float = 0.3
    margin: float = 1.1
    min_rate: float = 0.05
    rate: float | None = None
    # the moving average of prompts taken per round: how much `rate` weighs against the next round's counts
    weight: float | None = None

    def observe(self, taken: int, kept: int) -> None:
        """One round: the prompts it took from the data, the groups it kept (judged in it, begun in any round)."""
        if self.rate is None:
            if taken > 0:
                self.rate, self.weight = kept / taken, float(taken)
            return
        weight = float(taken) if self.weight is None else self.weight  # a save from before weights: as this round
        mean_taken = (1 - self.smoothing) * weight + self.smoothing * taken
        mean_kept = (1 - self.smoothing) * self.rate * weight + self.smoothing * kept
        if mean_taken > 0:
            self.rate, self.weight = mean_kept / mean_taken, mean_taken

    def round_size(self, needed: int, min_prompts: int, max_prompts: int) -> int:
        # above 1 only while a partial-rollout buffer drains: never ask for fewer prompts than groups needed
        rate = min(max(self.rate if self.rate is not None else self.initial, self.min_rate), 1.0)
        return int(min(max(math.ceil(needed * self.margin / rate), min_prompts), max_prompts))

    def state_dict(self) -> dict[str, float | None]:
        return {"rate": self.rate, "weight": self.weight}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.rate, self.weight = state["rate"], state.get("weight")  # saves before the weight have none

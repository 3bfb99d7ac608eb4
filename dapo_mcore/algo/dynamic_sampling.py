"""Dynamic sampling (paper eq. 11): train only on groups whose accuracy is strictly between 0 and 1.

A group where every response is right (or every one wrong) has zero advantage everywhere and only shrinks
the effective batch; such groups are dropped and generation continues until the batch is full. Instead of a
fixed over-sampling multiplier, the next round's size can follow a running estimate of the keep rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def keep_group_mask(correct_GN: torch.Tensor) -> torch.Tensor:
    """[G] bool: True where 0 < accuracy < 1 over the N responses of the group (reward std > 0)."""
    n_correct_G = correct_GN.to(torch.int64).sum(dim=1)
    return (n_correct_G > 0) & (n_correct_G < correct_GN.shape[1])


@dataclass
class KeepRateEstimator:
    """Exponential moving average of the fraction of generated groups that dynamic sampling keeps.

    round_size(needed) asks for enough prompts to fill `needed` groups at the estimated rate (with a safety
    margin), within [min_prompts, max_prompts]; before any observation the rate is `initial`.
    """

    initial: float = 1.0
    smoothing: float = 0.3
    margin: float = 1.1
    min_rate: float = 0.05
    rate: float | None = None

    def observe(self, generated: int, kept: int) -> None:
        if generated <= 0:
            return
        seen = kept / generated
        self.rate = seen if self.rate is None else (1 - self.smoothing) * self.rate + self.smoothing * seen

    def round_size(self, needed: int, min_prompts: int, max_prompts: int) -> int:
        rate = max(self.rate if self.rate is not None else self.initial, self.min_rate)
        return int(min(max(math.ceil(needed * self.margin / rate), min_prompts), max_prompts))

    def state_dict(self) -> dict[str, float | None]:
        return {"rate": self.rate}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.rate = state["rate"]

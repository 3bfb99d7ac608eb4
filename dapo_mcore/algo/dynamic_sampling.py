"""Dynamic sampling (paper eq. 11): train only on groups whose accuracy is strictly between 0 and 1.

A group where every response is right (or every one wrong) has zero advantage everywhere and only shrinks
the effective batch; such groups are dropped and generation continues until the batch is full.
"""

from __future__ import annotations

import torch


def keep_group_mask(correct_GN: torch.Tensor) -> torch.Tensor:
    """[G] bool: True where 0 < accuracy < 1 over the N responses of the group."""
    n_correct_G = correct_GN.to(torch.int64).sum(dim=1)
    return (n_correct_G > 0) & (n_correct_G < correct_GN.shape[1])

"""Length shaping of rewards: DAPO's soft overlong punishment (paper eq. 13) and overlong filtering."""

from __future__ import annotations

import torch


def soft_overlong_penalty(lengths_B: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """R_length added to the reward of each response, with L_max = max_len and L_cache = buffer_len:

        0                                       if |o| <= L_max - L_cache
        ((L_max - L_cache) - |o|) / L_cache     if L_max - L_cache < |o| <= L_max
        -1                                      if |o| > L_max
    all scaled by `factor`. Linear on (L_max - L_cache, L_max], reaching -factor at L_max.
    """
    safe_len = max_len - buffer_len
    excess = (lengths_B.to(torch.float32) - safe_len).clamp(min=0.0)
    penalty = -(excess / buffer_len).clamp(max=1.0)
    return penalty * factor


def overlong_filter_mask(truncated_B: torch.Tensor) -> torch.Tensor:
    """1.0 for responses that enter the loss, 0.0 for truncated ones (the paper's overlong filtering)."""
    return (~truncated_B.bool()).to(torch.float32)

"""Length shaping of rewards: DAPO's soft overlong punishment (paper eq. 13), a linear length penalty
(RLinf's documented variant) and overlong filtering. Each returns a value added to (or masking) R_i."""

from __future__ import annotations

import torch


def soft_overlong_penalty(lengths_B: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """R_length with L_max = max_len and L_cache = buffer_len:

        0                                       if |o| <= L_max - L_cache
        ((L_max - L_cache) - |o|) / L_cache     if L_max - L_cache < |o| <= L_max
        -1                                      if |o| > L_max
    all scaled by `factor`. Linear on (L_max - L_cache, L_max], reaching -factor at L_max.
    (AReaL's overlong_tokens / overlong_penalty_factor and SkyRL's overlong_buffer are the same formula.)
    """
    safe_len = max_len - buffer_len
    excess = (lengths_B.to(torch.float32) - safe_len).clamp(min=0.0)
    return -(excess / buffer_len).clamp(max=1.0) * factor


def linear_length_penalty(lengths_B: torch.Tensor, safe_len: int, max_len: int, coef: float = 1.0) -> torch.Tensor:
    """0 up to safe_len, then -coef * (|o| - safe_len) / (max_len - safe_len), kept within [-1, 0].

    RLinf documents this shape (len_reward_penalty, safe_length, max_length) without an implementation in
    its code; the clamp to [-1, 0] follows its documentation.
    """
    excess = (lengths_B.to(torch.float32) - safe_len).clamp(min=0.0)
    return (-coef * excess / (max_len - safe_len)).clamp(min=-1.0, max=0.0)


def overlong_filter_mask(truncated_B: torch.Tensor) -> torch.Tensor:
    """1.0 for responses that enter the loss, 0.0 for truncated ones (the paper's overlong filtering)."""
    return (~truncated_B.bool()).to(torch.float32)

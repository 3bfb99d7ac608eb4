"""Group-relative advantages (DAPO paper eq. 9, shared with GRPO).

A_i = (R_i - mean(R_group)) / (std(R_group) + eps), the same value for every token of response i.
std is Bessel-corrected (torch.std), as in the authors' verl implementation; a group of one, or of equal
rewards, gets A = 0.
"""

from __future__ import annotations

import torch


def group_advantages(rewards_B: torch.Tensor, group_index_B: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Advantages for samples of any number of groups of any sizes (group_index_B: 0..G-1)."""
    n_groups = int(group_index_B.max()) + 1 if group_index_B.numel() else 0
    rewards = rewards_B.to(torch.float64)
    count_G = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index_B, torch.ones_like(rewards))
    mean_G = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index_B, rewards) / count_G.clamp(min=1)
    centred_B = rewards - mean_G[group_index_B]
    sq_G = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index_B, centred_B**2)
    std_G = (sq_G / (count_G - 1).clamp(min=1)).sqrt()
    # Groups of one and groups of equal rewards (std 0) get A = 0 whatever eps is.
    informative_B = (count_G[group_index_B] > 1) & (std_G[group_index_B] > 0)
    adv_B = torch.where(informative_B, centred_B / (std_G[group_index_B] + eps), torch.zeros_like(centred_B))
    return adv_B.to(rewards_B.dtype)

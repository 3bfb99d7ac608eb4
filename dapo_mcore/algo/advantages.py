"""Group-relative advantages (DAPO paper eq. 9, shared with GRPO), and the Dr.GRPO variant.

    grpo:      A_i = (R_i - mean(R_group)) / (std(R_group) + eps)
    mean_only: A_i =  R_i - mean(R_group)                     (Dr.GRPO: no std division)
Every token of response i gets A_i. std is Bessel-corrected (torch.std), as in the authors' verl code.
A group of one, or of equal rewards, gets A = 0 whatever eps is. With batch_normalize, the advantages are
then shifted and scaled to mean 0 and std 1 over the whole batch.
"""

from __future__ import annotations

import torch

ADVANTAGE_ESTIMATORS = ("grpo", "mean_only")


def group_advantages(
    rewards_B: torch.Tensor,
    group_index_B: torch.Tensor,
    eps: float = 1e-6,
    estimator: str = "grpo",
    batch_normalize: bool = False,
) -> torch.Tensor:
    """Advantages for samples of any number of groups of any sizes (group_index_B: 0..G-1)."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ADVANTAGE_ESTIMATORS}")
    if rewards_B.numel() == 0:
        return rewards_B.clone()
    rewards = rewards_B.to(torch.float64)
    n_groups = int(group_index_B.max()) + 1
    count_G = _group_sum(torch.ones_like(rewards), group_index_B, n_groups)
    centred_B = rewards - (_group_sum(rewards, group_index_B, n_groups) / count_G.clamp(min=1))[group_index_B]
    std_G = (_group_sum(centred_B**2, group_index_B, n_groups) / (count_G - 1).clamp(min=1)).sqrt()
    informative_B = (count_G[group_index_B] > 1) & (std_G[group_index_B] > 0)
    scale_B = std_G[group_index_B] + eps if estimator == "grpo" else torch.ones_like(centred_B)
    adv_B = torch.where(informative_B, centred_B / scale_B, torch.zeros_like(centred_B))
    if batch_normalize and adv_B.numel() > 1:
        adv_B = (adv_B - adv_B.mean()) / (adv_B.std() + eps)
    return adv_B.to(rewards_B.dtype)


def _group_sum(values_B: torch.Tensor, group_index_B: torch.Tensor, n_groups: int) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=values_B.dtype).index_add_(0, group_index_B, values_B)

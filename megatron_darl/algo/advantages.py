"""Group-relative advantages: GRPO, Dr.GRPO and RLOO.

What it is: per-response scalar advantages `[B]` from rewards `[B]` and a group index `[B]`
(the G responses of one prompt share an index; a group is never split).
What it is not: token-level credit assignment or value-function (GAE) advantages.
"""

from __future__ import annotations

import torch

from .reductions import check_sequence_tensor


def _group_stats(rewards: torch.Tensor, group_index: torch.Tensor):
    """Per-response group count, mean and population (unbiased=False) std."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    check_sequence_tensor("group_index", group_index, rewards.shape[0])
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros_like(count).index_add_(0, inverse, r)
    mean = (total / count)[inverse]
    sq = torch.zeros_like(count).index_add_(0, inverse, (r - mean) ** 2)
    std = (sq / count).sqrt()[inverse]
    return r, count[inverse], mean, std


def grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantage `A_i = (R_i - mean_g) / (std_g + eps)`, std with unbiased=False.

    `norm_by_std=False` gives Dr.GRPO, `A_i = R_i - mean_g`. A group whose rewards are all
    equal (or a group of one) gets advantage 0.
    """
    r, _, mean, std = _group_stats(rewards, group_index)
    centred = r - mean
    return centred / (std + eps) if norm_by_std else centred


def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """RLOO: `A_i = R_i - mean_{j in g, j != i} R_j = n/(n-1) (R_i - mean_g)`; 0 for a group of one."""
    r, count, mean, _ = _group_stats(rewards, group_index)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return scale * (r - mean)

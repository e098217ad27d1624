"""Masked reductions and input checks shared by the algo functions.

What it is: the few tensor helpers every loss needs (shape checks, masked sums, the loss
denominator, per-row token counts, the exponent bound that keeps ratios finite).
What it is not: a place for maths with a formula of its own; those live in their modules.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

# Every log-ratio is clamped to +-LOG_RATIO_BOUND before exp: exp(20) ~ 4.9e8 is far past
# any useful weight and far below float32 max, so ratios never overflow to inf.
LOG_RATIO_BOUND = 20.0

Denominator = float | int | torch.Tensor | None


def check_token_tensors(mask: torch.Tensor, **tensors: torch.Tensor | None) -> torch.Tensor:
    """Check that every given tensor is `[B, T]` like `mask`; return `mask` as bool."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t is None:
            continue
        if tuple(t.shape) != tuple(mask.shape):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but mask has {tuple(mask.shape)}; "
                "per-token tensors must be [B, T]"
            )
    return mask.bool()


def check_sequence_tensor(name: str, t: torch.Tensor, batch: int) -> None:
    """Check that a per-sequence tensor is `[B]`."""
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must be [B] = [{batch}], got shape {tuple(t.shape)}")


def broadcast_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B]` advantages become `[B, T]` (one value per response); `[B, T]` pass through."""
    if advantages.dim() == 1 and advantages.shape[0] == mask.shape[0]:
        return advantages.unsqueeze(-1).expand(mask.shape)
    if tuple(advantages.shape) == tuple(mask.shape):
        return advantages
    raise ValueError(
        f"advantages must be [B] or [B, T] = {tuple(mask.shape)}, got {tuple(advantages.shape)}"
    )


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `x` where `mask`; `where` (not a product) so padding garbage (inf, NaN) is ignored."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


def masked_row_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row sum `[B]` of `x` where `mask`."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of `x` over the mask; 0 when the mask is empty (a metric, never a NaN).

    Written with `where` rather than `x[mask]` so that it needs no host sync on a GPU.
    """
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return zero
    low = torch.full((), float("-inf"), dtype=x.dtype, device=x.device)
    return torch.where(mask.any(), torch.where(mask, x, low).max(), zero)


def resolve_denominator(mask: torch.Tensor, loss_denominator: Denominator, dtype) -> torch.Tensor:
    """The token count a loss divides by.

    Without `loss_denominator`, the number of masked tokens of this call (at least 1, so an
    all-masked batch gives a loss of 0, not NaN). With it (the masked-token count of the whole
    batch), losses of micro-batches add up to the loss of the whole batch.
    """
    if loss_denominator is None:
        return mask.sum().to(dtype).clamp(min=1.0)
    if isinstance(loss_denominator, torch.Tensor):
        if loss_denominator.numel() != 1:
            raise ValueError(f"loss_denominator must be one number, got shape {tuple(loss_denominator.shape)}")
        # a device tensor's value is not read: that would wait on the device
        if loss_denominator.device.type == "cpu" and not float(loss_denominator) > 0:
            raise ValueError(f"loss_denominator must be positive, got {float(loss_denominator)!r}")
        return loss_denominator.to(dtype=dtype, device=mask.device).reshape(())
    if not float(loss_denominator) > 0:
        raise ValueError(f"loss_denominator must be one positive number, got {loss_denominator!r}")
    return torch.tensor(float(loss_denominator), dtype=dtype, device=mask.device)


def version_token_counts(versions: torch.Tensor, mask: torch.Tensor) -> dict[int, float]:
    """Masked-token count `N_k` per behavior version `k`.

    `versions` `[B]` (each sequence's version: every token of row i counts for `versions[i]`)
    or `[B, T]` (each token's own version, e.g. `TrainBatch.token_versions`: an interrupted
    rollout counts its later tokens for the version that generated them). Compute it once on
    the full batch and pass it to `darl_policy_loss` for micro-batches.
    """
    m = check_token_tensors(mask)
    if versions.dim() == 2:
        check_token_tensors(mask, versions=versions)
        kept = versions[m]
        return {int(k): float((kept == k).sum()) for k in torch.unique(kept).tolist()}
    check_sequence_tensor("versions", versions, m.shape[0])
    per_row = m.sum(-1)
    return {
        int(k): float(per_row[versions == k].sum())
        for k in torch.unique(versions).tolist()
    }


def lookup_version(table: Mapping[int, float | torch.Tensor], k: int, name: str):
    """`table[k]`, with an error naming the table and the missing version."""
    if k not in table:
        raise ValueError(
            f"{name} has no entry for behavior version {k} (has {sorted(table)}); compute it "
            "on the full batch, which contains every version of its micro-batches"
        )
    return table[k]

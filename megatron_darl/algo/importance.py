"""Rollout importance-sampling weights `rho = pi_prox / mu` (verl's `algorithm.rollout_is`).

What it is: the behavior-correction weight of each token, at token, sequence or geometric
level, truncated or masked, with the catastrophic-token veto; computed in log space so it
never overflows, and detached (weights carry no gradient).
What it is not: the PPO ratio against the proximal policy (see `losses.py`) or the P-MIS
per-version combination (see `pmis.py`).
"""

from __future__ import annotations

import math

import torch

from .reductions import LOG_RATIO_BOUND, check_token_tensors, masked_max, masked_row_sum, masked_sum

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask", "clip")  # "clip" is verl's name for "mask"


def level_log_weights(token_log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Log weight of each token at the given level, `[B, T]`.

    token: `l_ij`; sequence: `sum_j l_ij` broadcast over the row; geometric: `mean_j l_ij`
    broadcast (0 for a row without masked tokens). `token_log_ratio` must be 0 off the mask.
    """
    if level == "token":
        return token_log_ratio
    row = masked_row_sum(token_log_ratio, mask)
    if level == "sequence":
        return row.unsqueeze(-1).expand_as(token_log_ratio)
    if level == "geometric":
        n = mask.sum(-1).to(row.dtype).clamp(min=1.0)
        return (row / n).unsqueeze(-1).expand_as(token_log_ratio)
    raise ValueError(f"level must be one of {LEVELS}, got {level!r}")


def _check_options(mode: str, threshold: float, threshold_lower: float | None, veto: float | None):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    if threshold_lower is not None and not 0 <= threshold_lower <= threshold:
        raise ValueError(f"threshold_lower must be in [0, threshold={threshold}], got {threshold_lower}")
    if veto is not None and not veto > 0:
        raise ValueError(f"veto_threshold must be > 0 or None, got {veto}")


def weights_from_log(
    log_w: torch.Tensor,
    token_log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "truncate",
    threshold: float = 2.0,
    threshold_lower: float | None = None,
    veto_threshold: float | None = 1e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Turn log weights into truncated/masked, vetoed weights (the second half of
    `rollout_is_weights`, shared with the balance-heuristic weights of `balance.py`).

    Decisions use the unclamped log weight; only the exp is clamped. Returns the detached
    weights, 0 off the mask, and the `algo/is/...` metrics.

    Args:
        log_w: log weight of each token `[B, T]` (from `level_log_weights` or the balance heuristic).
        token_log_ratio: per-token `l_ij` `[B, T]`, 0 off the mask; read only by the veto.
        mask: bool `[B, T]`, True on the tokens that count.
        mode: `truncate` (`min(w, threshold)`) or `mask`, alias `clip` (`w * 1[lower <= w <= threshold]`).
        threshold: the upper bound on a weight, > 0.
        threshold_lower: `lower` of `mask` mode, in `[0, threshold]`; None means `1/threshold`.
        veto_threshold: a row with any masked `exp(l_ij) < veto_threshold` gets weight 0 everywhere;
            None disables the veto.
    """
    _check_options(mode, threshold, threshold_lower, veto_threshold)
    zero = torch.zeros((), dtype=log_w.dtype, device=log_w.device)
    upper = math.log(threshold)
    n_tok = mask.sum().to(log_w.dtype).clamp(min=1.0)
    metrics: dict[str, torch.Tensor] = {}
    if mode == "truncate":
        w = torch.exp(log_w.clamp(-LOG_RATIO_BOUND, min(upper, LOG_RATIO_BOUND)))
        metrics["algo/is/frac_truncated"] = masked_sum((log_w > upper).to(log_w.dtype), mask) / n_tok
    else:
        lower_w = 1.0 / threshold if threshold_lower is None else threshold_lower
        lower = math.log(lower_w) if lower_w > 0 else -math.inf
        keep = (log_w >= lower) & (log_w <= upper)
        w = torch.where(keep, torch.exp(log_w.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), zero)
        metrics["algo/is/frac_masked"] = masked_sum((~keep).to(log_w.dtype), mask) / n_tok
    rows_with_tokens = mask.any(-1)
    if veto_threshold is not None:
        bad = mask & (token_log_ratio < math.log(veto_threshold))
        vetoed = bad.any(-1)
        w = torch.where(vetoed.unsqueeze(-1), zero, w)
        metrics["algo/is/frac_vetoed"] = (
            vetoed.sum().to(log_w.dtype) / rows_with_tokens.sum().to(log_w.dtype).clamp(min=1.0)
        )
    w = torch.where(mask, w, zero).detach()
    metrics["algo/is/mean"] = masked_sum(w, mask) / n_tok
    metrics["algo/is/max"] = masked_max(w, mask)
    return w, {k: v.detach() for k, v in metrics.items()}


def rollout_is_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = 2.0,
    threshold_lower: float | None = None,
    veto_threshold: float | None = 1e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rollout importance weights `[B, T]` and metrics (`algo/is/...`).

    With `l_ij = p_ij - b_ij` (proximal minus behavior log-prob), the raw weight is set by
    `level`, then truncated or masked by `mode`, then vetoed. Weights are detached and 0 off
    the mask. AReaL's one-sided cap `w > 5 -> 0` is `mode="mask", threshold=5, threshold_lower=0`.

    Args:
        prox_logp: proximal-policy log-probs of the sampled tokens, `[B, T]`.
        behav_logp: behavior-policy (the engine's) log-probs of the same tokens, `[B, T]`.
        mask: `[B, T]`, true on the tokens that count.
        level: `token` (`exp(l_ij)`), `sequence` (`exp(sum_j l_ij)`) or `geometric`
            (`exp(mean_j l_ij)`); the last two broadcast over the row.
        mode: `truncate` (`min(w, threshold)`) or `mask`, alias `clip` (`w` if
            `threshold_lower <= w <= threshold`, else 0).
        threshold: the upper bound on a weight, > 0.
        threshold_lower: the lower bound of `mask` mode, in `[0, threshold]`; None means `1/threshold`.
        veto_threshold: a row with any masked token ratio `exp(l_ij)` below this is zeroed;
            None disables the veto.
    """
    m = check_token_tensors(mask, prox_logp=prox_logp, behav_logp=behav_logp)
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    zero = torch.zeros((), dtype=prox_logp.dtype, device=prox_logp.device)
    l_tok = torch.where(m, prox_logp.detach() - behav_logp.detach(), zero)
    log_w = level_log_weights(l_tok, m, level)
    return weights_from_log(
        log_w, l_tok, m, mode=mode, threshold=threshold,
        threshold_lower=threshold_lower, veto_threshold=veto_threshold,
    )

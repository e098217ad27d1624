"""Policy-gradient surrogates: PPO, AReaL decoupled PPO, stop-gradient REINFORCE.

What it is: per-token clipped surrogates with optional per-token weights, the behavior-side
trust region switch (`behav_clip`), GSPO-style sequence ratios (`ratio_level="sequence"`),
and the token-mean losses built on them. Every loss returns `(loss, metrics)`, metrics
namespaced `algo/...` as detached 0-dim tensors (no host sync inside a loss).
What it is not: the per-version P-MIS combination (`pmis.py`) or rollout weights
(`importance.py`).

Micro-batches: every loss takes `loss_denominator`, the masked-token count of the whole
batch; with it, losses (and token-mean metrics) of micro-batches add up to those of the batch.
"""

from __future__ import annotations

import math

import torch

from .reductions import (
    LOG_RATIO_BOUND,
    Denominator,
    broadcast_advantages,
    check_token_tensors,
    masked_row_sum,
    masked_sum,
    resolve_denominator,
)

RATIO_LEVELS = ("token", "sequence")
BEHAV_CLIPS = (None, "ratio", "mask")


def policy_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str):
    """Log of the ratio `pi_theta / pi_old` per token, 0 off the mask.

    token: `q_ij - o_ij`. sequence (GSPO): `(1/T_i) sum_j (q_ij - o_ij)` broadcast over the
    row, with gradient through every token of the row. The aggregation stays the token mean,
    so each sequence weighs by its length (GSPO proper averages sequences); this keeps the
    per-version normalisation and micro-batch sums identical across levels.
    """
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    diff = torch.where(mask, logp - old_logp, zero)
    if level == "token":
        return diff
    if level == "sequence":
        n = mask.sum(-1).to(diff.dtype).clamp(min=1.0)
        seq = masked_row_sum(diff, mask) / n
        return torch.where(mask, seq.unsqueeze(-1).expand_as(diff), zero)
    raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {level!r}")


def clipped_objective(log_ratio, adv, clip_low: float, clip_high: float):
    """`min(r A, clip(r, 1-clip_low, 1+clip_high) A)` per token and where the clip acts.

    The exponent is clamped to +-LOG_RATIO_BOUND, so a ratio never overflows (and beyond the
    bound the gradient stops, which only matters for ratios above 4.8e8).
    """
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    r = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    unclipped = r * adv
    clipped = r.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    return torch.minimum(unclipped, clipped), clipped < unclipped


def weighted_surrogate(
    logp, prox_logp, behav_logp, advantages, mask, weights, *,
    clip_low: float = 0.2, clip_high: float = 0.2, ratio_level: str = "token",
    behav_clip: str | None = None, behav_mask_threshold: float = 5.0,
):
    """Per-token objective `rho_ij * min(r_ij A_i, clip(r_ij) A_i)`, 0 off the mask.

    `r = exp(q - p)` (`logp` minus detached `prox_logp`), `rho` = `weights` (detached).
    With `behav_clip="ratio"` the objective becomes `min(rho min(rA, clip(r)A), clip(R,
    1-clip_low, 1+clip_high) A)`, `R = exp(q - b)`, on tokens with `rho > 0` (what naive async
    does implicitly; tokens already dropped stay dropped).
    Returns `(objective [B,T], flags)`, flags the bool masks `clipped` and `behav_clipped`.

    Args:
        logp: current-policy log-probs `q` of the sampled tokens, `[B, T]`, with gradient.
        prox_logp: proximal-policy log-probs `p`, `[B, T]` (detached here).
        behav_logp: behavior-policy log-probs `b`, `[B, T]`; read only by `behav_clip`.
        advantages: `[B]` (one per response) or `[B, T]`.
        mask: bool `[B, T]`, true on the tokens that count.
        weights: per-token `rho`, `[B, T]` (detached here).
        clip_low: `r` is clipped below at `1 - clip_low`, in `[0, 1)`.
        clip_high: `r` is clipped above at `1 + clip_high`, >= 0.
        ratio_level: `token` (per-token `r`) or `sequence` (GSPO: the row's mean log-ratio; see
            `policy_log_ratio`).
        behav_clip: behavior-side trust region: None (off), `ratio` (also clip the total ratio `R`, above)
            or `mask` (tokens whose `exp(p - b)` leaves `[1/C, C]` contribute 0; the denominator is unchanged).
        behav_mask_threshold: `C` of `behav_clip="mask"`, > 1; unused otherwise.
    """
    if behav_clip not in BEHAV_CLIPS:
        raise ValueError(f"behav_clip must be one of {BEHAV_CLIPS}, got {behav_clip!r}")
    adv = broadcast_advantages(advantages, mask).to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    rho = weights.detach()
    obj, clipped = clipped_objective(
        policy_log_ratio(logp, prox_logp.detach(), mask, ratio_level), adv, clip_low, clip_high
    )
    obj = rho * obj
    behav_clipped = torch.zeros_like(mask)
    if behav_clip == "ratio":
        log_total = policy_log_ratio(logp, behav_logp.detach(), mask, ratio_level)
        total = torch.exp(log_total.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        bound = total.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
        behav_clipped = (bound < obj) & (rho > 0)
        obj = torch.where(behav_clipped, bound, obj)
    elif behav_clip == "mask":
        if not behav_mask_threshold > 1:
            raise ValueError(f"behav_mask_threshold must be > 1, got {behav_mask_threshold}")
        c = math.log(behav_mask_threshold)
        l_tok = (prox_logp - behav_logp).detach()
        behav_clipped = mask & ((l_tok < -c) | (l_tok > c))
        obj = torch.where(behav_clipped, zero, obj)
    obj = torch.where(mask, obj, zero)
    return obj, {"clipped": clipped & mask & (rho > 0), "behav_clipped": behav_clipped & mask}


def surrogate_metrics(flags, logp, old_logp, mask, den) -> dict[str, torch.Tensor]:
    frac = lambda b: masked_sum(b.to(den.dtype), mask) / den  # noqa: E731
    return {
        "algo/clip_frac": frac(flags["clipped"]).detach(),
        "algo/behav_clip_frac": frac(flags["behav_clipped"]).detach(),
        # k1 estimate of KL(pi_old || pi_theta) on the tokens: how far this update moved
        "algo/ppo_kl": (masked_sum((old_logp - logp).detach(), mask) / den).detach(),
    }


def ppo_loss(
    logp, old_logp, advantages, mask, *, clip_low: float = 0.2, clip_high: float = 0.2,
    token_weights: torch.Tensor | None = None, ratio_level: str = "token",
    loss_denominator: Denominator = None,
):
    """Clipped PPO: `-(1/N) sum_ij m_ij w_ij min(r_ij A_i, clip(r_ij) A_i)`, `r = exp(q - o)`.

    Naive async: `old_logp` = behavior. verl-style decoupled: `old_logp` = proximal,
    `token_weights` = `rollout_is_weights(...)`.

    Args:
        logp: current-policy log-probs `q` of the sampled tokens, `[B, T]`, with gradient.
        old_logp: the log-probs `o` the ratio is taken against, `[B, T]`.
        advantages: `[B]` (one per response) or `[B, T]`.
        mask: `[B, T]`, true on the tokens that count.
        clip_low: `r` is clipped below at `1 - clip_low`, in `[0, 1)`.
        clip_high: `r` is clipped above at `1 + clip_high`, >= 0.
        token_weights: per-token `w`, `[B, T]` (detached); None means 1 everywhere.
        ratio_level: `token` or `sequence` (GSPO; see `policy_log_ratio`).
        loss_denominator: `N`, the whole batch's masked-token count, so micro-batch losses add up;
            None uses this call's masked-token count.
    """
    m = check_token_tensors(mask, logp=logp, old_logp=old_logp, token_weights=token_weights)
    w = torch.ones_like(logp) if token_weights is None else token_weights.to(logp.dtype)
    obj, flags = weighted_surrogate(
        logp, old_logp, old_logp, advantages, m, w,
        clip_low=clip_low, clip_high=clip_high, ratio_level=ratio_level,
    )
    den = resolve_denominator(m, loss_denominator, logp.dtype)
    metrics = surrogate_metrics(flags, logp, old_logp, m, den)
    del metrics["algo/behav_clip_frac"]
    return -obj.sum() / den, metrics


def decoupled_weights(prox_logp, behav_logp, mask, *, behav_weight_cap: float | None = None):
    """AReaL's behavior weights `w = exp(p - b)` (detached, 0 off the mask) and metrics.

    With `behav_weight_cap`, tokens with `w > cap` get weight 0 (`algo/is/frac_capped`: their
    share of the masked tokens). The weights `decoupled_ppo_loss` multiplies its surrogate by.
    """
    m = check_token_tensors(mask, prox_logp=prox_logp, behav_logp=behav_logp)
    zero = torch.zeros((), dtype=prox_logp.dtype, device=prox_logp.device)
    l_tok = torch.where(m, (prox_logp - behav_logp).detach(), zero)
    w = torch.where(m, torch.exp(l_tok.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), zero)
    metrics: dict[str, torch.Tensor] = {}
    if behav_weight_cap is not None:
        if not behav_weight_cap > 0:
            raise ValueError(f"behav_weight_cap must be > 0, got {behav_weight_cap}")
        capped = m & (l_tok > math.log(behav_weight_cap))
        w = torch.where(capped, zero, w)
        metrics["algo/is/frac_capped"] = masked_sum(capped.to(w.dtype), m) / m.sum().to(w.dtype).clamp(min=1.0)
    return w, metrics


def decoupled_ppo_loss(
    logp, prox_logp, behav_logp, advantages, mask, *, clip_low: float = 0.2,
    clip_high: float = 0.2, behav_weight_cap: float | None = None, ratio_level: str = "token",
    behav_clip: str | None = None, behav_mask_threshold: float = 5.0,
    loss_denominator: Denominator = None,
):
    """AReaL decoupled PPO: `(1/N) sum_ij m_ij max(-A r, -A clip(r)) * w`.

    `r = exp(q - p)`, `w = exp(p - b)` (detached, `decoupled_weights`). With
    `prox_logp == behav_logp` this is plain PPO.

    Args:
        logp: current-policy log-probs `q` of the sampled tokens, `[B, T]`, with gradient.
        prox_logp: proximal-policy log-probs `p`, `[B, T]`.
        behav_logp: behavior-policy log-probs `b`, `[B, T]`.
        advantages: `[B]` (one per response) or `[B, T]`.
        mask: `[B, T]`, true on the tokens that count.
        clip_low: `r` is clipped below at `1 - clip_low`, in `[0, 1)`.
        clip_high: `r` is clipped above at `1 + clip_high`, >= 0.
        behav_weight_cap: tokens with `w > cap` contribute 0 to the numerator while `N` keeps counting
            them (rejecting tokens does not up-weight the kept ones); None: no cap.
        ratio_level: `token` or `sequence` (GSPO; see `policy_log_ratio`).
        behav_clip: None, `ratio` or `mask`, as in `weighted_surrogate`.
        behav_mask_threshold: `C` of `behav_clip="mask"` (`w` outside `[1/C, C]` is dropped), > 1.
        loss_denominator: `N`, the whole batch's masked-token count, so micro-batch losses add up;
            None uses this call's masked-token count.
    """
    m = check_token_tensors(mask, logp=logp, prox_logp=prox_logp, behav_logp=behav_logp)
    den = resolve_denominator(m, loss_denominator, logp.dtype)
    w, metrics = decoupled_weights(prox_logp, behav_logp, m, behav_weight_cap=behav_weight_cap)
    if "algo/is/frac_capped" in metrics:  # over the whole batch when `loss_denominator` is its count
        metrics["algo/is/frac_capped"] = (metrics["algo/is/frac_capped"] * m.sum() / den).detach()
    obj, flags = weighted_surrogate(
        logp, prox_logp, behav_logp, advantages, m, w, clip_low=clip_low, clip_high=clip_high,
        ratio_level=ratio_level, behav_clip=behav_clip, behav_mask_threshold=behav_mask_threshold,
    )
    metrics.update(surrogate_metrics(flags, logp, prox_logp, m, den))
    return -obj.sum() / den, metrics


def sg_objective(logp, behav_logp, advantages, mask, *, threshold: float = 2.0):
    """Stop-gradient REINFORCE per token: `sg(min(exp(q - b), C)) * q * A`, 0 off the mask.

    No proximal policy; the gradient is `min(exp(q-b), C) A grad q`. Returns
    `(objective [B,T], weights [B,T] detached, truncated [B,T] bool)`.
    """
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    adv = broadcast_advantages(advantages, mask).to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_w = torch.where(mask, (logp - behav_logp).detach(), zero)
    upper = math.log(threshold)
    w = torch.where(mask, torch.exp(log_w.clamp(-LOG_RATIO_BOUND, min(upper, LOG_RATIO_BOUND))), zero)
    obj = torch.where(mask, w * logp * adv, zero)
    return obj, w, mask & (log_w > upper)


def sg_policy_loss(
    logp, behav_logp, advantages, mask, *, threshold: float = 2.0,
    loss_denominator: Denominator = None,
):
    """Token-mean stop-gradient REINFORCE loss `-(1/N) sum_ij m_ij sg(min(exp(q-b), C)) q_ij A_i`.

    The loss value is not an objective estimate (it contains `q`); only its gradient is
    meaningful. Per-version (P-MIS) form: `darl_policy_loss(..., surrogate="sg")`.
    """
    m = check_token_tensors(mask, logp=logp, behav_logp=behav_logp)
    obj, w, truncated = sg_objective(logp, behav_logp, advantages, m, threshold=threshold)
    den = resolve_denominator(m, loss_denominator, logp.dtype)
    metrics = {
        "algo/sg/weight_mean": (w.sum() / den).detach(),
        "algo/sg/frac_truncated": (masked_sum(truncated.to(den.dtype), m) / den).detach(),
    }
    return -obj.sum() / den, metrics

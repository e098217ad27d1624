"""Per-step diagnostics of behavior drift: ESS, weight statistics, KL estimates, staleness.

What it is: read-only statistics of a batch (or a replay pool's versions), returned as a
dict of `algo/...` metrics (detached tensors or floats), computed once per step.
What it is not: anything that feeds the loss; these never carry gradient.

KL(mu || pi_prox) per token with `l = p - b`, `r = exp(l)` (Schulman's estimators, samples
from mu): k1 = mean(-l), k2 = mean(l^2 / 2), k3 = mean(r - 1 - l).
"""

from __future__ import annotations

import math

import torch

from .importance import rollout_is_weights
from .pmis import effective_sample_size
from .reductions import LOG_RATIO_BOUND, check_sequence_tensor, check_token_tensors, masked_max, masked_sum


def masked_quantile(x: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """Nearest-rank quantile of `x` over the mask (kthvalue: no size limit); 0 if empty."""
    vals = x[mask]
    if vals.numel() == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    # round first: 0.99 * 100 is 99.00000000000001 in floating point, and the rank is 99
    k = min(max(math.ceil(round(q * vals.numel(), 9)), 1), vals.numel())
    return vals.kthvalue(k).values


def kl_estimates(prox_logp, behav_logp, mask, prefix: str = "algo") -> dict[str, torch.Tensor]:
    """`{prefix}/kl_k1`, `/kl_k2`, `/kl_k3`: token means of -l, l^2/2 and r - 1 - l."""
    zero = torch.zeros((), dtype=prox_logp.dtype, device=prox_logp.device)
    l_tok = torch.where(mask, (prox_logp - behav_logp).detach(), zero)
    l_tok = l_tok.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    n = mask.sum().to(l_tok.dtype).clamp(min=1.0)
    r = torch.exp(l_tok)
    return {
        f"{prefix}/kl_k1": masked_sum(-l_tok, mask) / n,
        f"{prefix}/kl_k2": masked_sum(0.5 * l_tok * l_tok, mask) / n,
        f"{prefix}/kl_k3": masked_sum(r - 1.0 - l_tok, mask) / n,
    }


def drift_diagnostics(prox_logp, behav_logp, mask, versions) -> dict[str, torch.Tensor | float]:
    """Drift of a batch whose loss applies no behavior weight (naive async, synchronous PPO), on the
    scale of the weighted cells' figures: KL k1/k2/k3 and the ESS fraction of the uncorrected
    weights `exp(p - b)` (what a correction would have to apply), global and per version
    (`algo/kl_k3/v{k}`, `algo/ess_frac/v{k}`), and the token share per version. No `algo/is/*`:
    the loss uses no weight to describe."""
    m = check_token_tensors(mask, prox_logp=prox_logp, behav_logp=behav_logp)
    check_sequence_tensor("versions", versions, m.shape[0])
    zero = torch.zeros((), dtype=prox_logp.dtype, device=prox_logp.device)
    l_tok = torch.where(m, (prox_logp - behav_logp).detach(), zero).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    w = torch.where(m, torch.exp(l_tok), zero)
    n_all = float(m.sum())
    out: dict[str, torch.Tensor | float] = dict(kl_estimates(prox_logp, behav_logp, m))
    out["algo/ess_frac"] = effective_sample_size(w, m) / max(n_all, 1.0)
    for k in [int(k) for k in torch.unique(versions).tolist()]:
        mk = m & (versions == k).unsqueeze(-1)
        n_k = float(mk.sum())
        out.update({f"{name}/v{k}": v for name, v in kl_estimates(prox_logp, behav_logp, mk).items()})
        out[f"algo/ess_frac/v{k}"] = effective_sample_size(w, mk) / max(n_k, 1.0)
        out[f"algo/tokens_frac/v{k}"] = n_k / max(n_all, 1.0)
    return {k: (v.detach() if torch.is_tensor(v) else v) for k, v in out.items()}


def staleness_histogram(versions: torch.Tensor, current_version: int,
                        prefix: str = "algo/staleness/batch") -> dict[str, float]:
    """Share of sequences at each staleness `current_version - v` (`{prefix}/{s}`), plus
    `{prefix}/mean` and `{prefix}/max`."""
    stale = (current_version - versions.detach().to(torch.int64)).cpu()
    if stale.numel() == 0:
        return {}
    out = {f"{prefix}/{int(s)}": float((stale == s).sum()) / stale.numel() for s in torch.unique(stale).tolist()}
    out[f"{prefix}/mean"] = float(stale.double().mean())
    out[f"{prefix}/max"] = float(stale.max())
    return out


def diagnostics(
    prox_logp, behav_logp, mask, versions, *, weights: torch.Tensor | None = None,
    level: str = "token", mode: str = "truncate", threshold: float = 2.0,
    threshold_lower: float | None = None, veto_threshold: float | None = 1e-4,
    current_version: int | None = None,
) -> dict[str, torch.Tensor | float]:
    """All drift diagnostics of one batch.

    ESS fraction `(sum rho)^2 / (n sum rho^2)` global and per version (`algo/ess_frac`,
    `algo/ess_frac/v{k}`); rho mean/max/p99 (`algo/is/mean|max|p99`); KL k1/k2/k3 global and
    per version (`algo/kl_k3/v{k}`, ...); token share per version; the batch staleness
    histogram when `current_version` is given (the pool's: call `staleness_histogram` with the
    pool's versions).

    Args:
        prox_logp: proximal-policy log-probs of the sampled tokens, `[B, T]`.
        behav_logp: behavior-policy log-probs of the same tokens, `[B, T]`.
        mask: `[B, T]`, true on the tokens that count.
        versions: `[B]`, the policy version that generated each sequence.
        weights: the `rho` the loss actually used, `[B, T]`, so no statistic describes unused weights (merge
            their maker's `frac_*` metrics in yourself); None: `rollout_is_weights` with the options below.
        level: `rollout_is_weights`'s level (`token`, `sequence`, `geometric`); unused with `weights`.
        mode: `rollout_is_weights`'s mode (`truncate`, `mask`/`clip`); unused with `weights`.
        threshold: `rollout_is_weights`'s upper bound on a weight, > 0; unused with `weights`.
        threshold_lower: `mask` mode's lower bound, None for `1/threshold`; unused with `weights`.
        veto_threshold: `rollout_is_weights`'s veto (None disables it); unused with `weights`.
        current_version: the learner's version, for the staleness histogram `current_version - v`;
            None leaves the histogram out.
    """
    m = check_token_tensors(mask, prox_logp=prox_logp, behav_logp=behav_logp, weights=weights)
    check_sequence_tensor("versions", versions, m.shape[0])
    if weights is None:
        rho, out = rollout_is_weights(
            prox_logp, behav_logp, m, level=level, mode=mode, threshold=threshold,
            threshold_lower=threshold_lower, veto_threshold=veto_threshold,
        )
        out = dict(out)
    else:
        rho = torch.where(m, weights.detach(), torch.zeros((), dtype=weights.dtype, device=weights.device))
        n = m.sum().to(rho.dtype).clamp(min=1.0)
        out = {"algo/is/mean": masked_sum(rho, m) / n, "algo/is/max": masked_max(rho, m)}
    out["algo/is/p99"] = masked_quantile(rho, m, 0.99)
    n_all = float(m.sum())
    out["algo/ess_frac"] = effective_sample_size(rho, m) / max(n_all, 1.0)
    out.update(kl_estimates(prox_logp, behav_logp, m))
    for k in [int(k) for k in torch.unique(versions).tolist()]:
        rows = versions == k
        mk = m & rows.unsqueeze(-1)
        n_k = float(mk.sum())
        out[f"algo/ess_frac/v{k}"] = effective_sample_size(rho, mk) / max(n_k, 1.0)
        out[f"algo/tokens_frac/v{k}"] = n_k / max(n_all, 1.0)
        for name, val in kl_estimates(prox_logp, behav_logp, mk).items():
            out[f"{name}/v{k}"] = val
    if current_version is not None:
        out.update(staleness_histogram(versions, current_version))
    return {k: (v.detach() if torch.is_tensor(v) else v) for k, v in out.items()}

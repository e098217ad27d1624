"""Where D-ARL's PPO clip is anchored: the behavior-anchored and mixture-anchored objectives.

What it is: the per-token clipped objectives of the two behavior-side readings of D-ARL's
per-version objective (docs/ALGORITHM.md, "Trust-region anchor"):
- `behavior`: `min(R A, clip(R, 1-clip_low, 1+clip_high) A)`, `R = exp(q - b)` against each
  token's own behavior log-prob, no behavior weight: the trust region stays where the sample was
  drawn for all of its reuses, as naive async PPO's does;
- `mixture`: the same with `R = pi_theta(y) / sum_k alpha_k mu_k(y)`, the balance mixture of the
  batch's behavior versions (`mixture_log_prob`);
and `behavior_clip_fraction`, the share of tokens where a PPO clip anchored at b acts, a figure
every cell can report whatever its own anchor.
What it is not: the per-version combination `-sum_k beta_k L_k` (`pmis.py`), the proximal-anchored
surrogate (`losses.py`) or any weight (`importance.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .losses import clipped_objective, policy_log_ratio, weighted_surrogate
from .reductions import broadcast_advantages, check_token_tensors, lookup_version, masked_sum

TRUST_ANCHORS = ("proximal", "behavior", "mixture")


def mixture_log_prob(behav_logp_by_version: Mapping[int, torch.Tensor],
                     counts: Mapping[int, float]) -> torch.Tensor:
    """`log sum_k alpha_k mu_k(y)` per token, `alpha_k = N_k / N` over the versions of `counts`
    with `N_k > 0` (detached). `behav_logp_by_version[k]` is `log mu_k` of every token, `[B, T]`."""
    total = sum(float(n) for n in counts.values())
    terms = [math.log(float(n) / total) + lookup_version(behav_logp_by_version, k, "behav_logp_by_version").detach()
             for k, n in sorted(counts.items()) if float(n) > 0]
    if not terms:
        raise ValueError("mixture_log_prob needs at least one version with tokens in counts")
    return torch.logsumexp(torch.stack(terms), 0)


def anchored_objective(logp, anchor_logp, advantages, mask, *, clip_low: float = 0.2, clip_high: float = 0.2,
                       ratio_level: str = "token"):
    """Per-token `min(R A, clip(R, 1-clip_low, 1+clip_high) A)`, `R = exp(q - a)` with the anchor
    `a` (`anchor_logp`, detached: b for `behavior`, `mixture_log_prob` for `mixture`); no weight.
    Returns `(objective [B, T], flags)` as `weighted_surrogate` (`clipped`: where the clip acts).

    Args:
        logp: current-policy log-probs `q` of the sampled tokens, `[B, T]`, with gradient.
        anchor_logp: the log-density the ratio is taken against, `[B, T]`.
        advantages: `[B]` (one per response) or `[B, T]`.
        mask: bool `[B, T]`, true on the tokens that count.
        clip_low: `R` is clipped below at `1 - clip_low`, in `[0, 1)`.
        clip_high: `R` is clipped above at `1 + clip_high`, >= 0.
        ratio_level: `token`, or `sequence` (GSPO: the row's mean log-ratio, `policy_log_ratio`).
    """
    m = check_token_tensors(mask, logp=logp, anchor_logp=anchor_logp)
    ones = torch.where(m, torch.ones_like(logp), torch.zeros_like(logp))
    return weighted_surrogate(logp, anchor_logp, anchor_logp, advantages, m, ones,
                              clip_low=clip_low, clip_high=clip_high, ratio_level=ratio_level)


def anchor_log_prob(anchor: str, behav_logp, mask, *, behav_logp_by_version=None, counts=None) -> torch.Tensor:
    """The log-density D-ARL's ratio is taken against for a behavior-side `anchor`: `b` for
    `behavior`; for `mixture`, `mixture_log_prob` of `behav_logp_by_version` with `alpha_k` from
    `counts`, and `b` off the mask (the ratio is 0 there anyway)."""
    if anchor == "behavior":
        return behav_logp.detach()
    if anchor != "mixture":
        raise ValueError(f"anchor must be 'behavior' or 'mixture' here, got {anchor!r}")
    if behav_logp_by_version is None or counts is None:
        raise ValueError("anchor='mixture' needs behav_logp_by_version (log mu_k of every token for every version "
                         "k) and the counts N_k that set alpha_k")
    return torch.where(mask, mixture_log_prob(behav_logp_by_version, counts), behav_logp.detach())


def behavior_clip_fraction(logp, behav_logp, advantages, mask, *, clip_low: float = 0.2,
                           clip_high: float = 0.2, ratio_level: str = "token", den=None) -> torch.Tensor:
    """Share of the masked tokens where a PPO clip anchored at the behavior log-probs acts:
    `clip(R) A < R A`, `R = exp(q - b)` (the tokens whose gradient that clip zeroes), over `den`
    (the whole minibatch's token count, so micro-batches add up; None: this call's). Detached.

    Args:
        logp: current-policy log-probs `q`, `[B, T]`.
        behav_logp: behavior log-probs `b`, `[B, T]`.
        advantages: `[B]` or `[B, T]`.
        mask: bool `[B, T]`.
        clip_low: the clip's lower bound `1 - clip_low`.
        clip_high: the clip's upper bound `1 + clip_high`.
        ratio_level: `token` or `sequence`, as the loss's.
        den: the token count to divide by; None counts this call's masked tokens.
    """
    m = check_token_tensors(mask, logp=logp, behav_logp=behav_logp)
    adv = broadcast_advantages(advantages, m).to(logp.dtype)
    log_r = policy_log_ratio(logp.detach(), behav_logp.detach(), m, ratio_level)
    _, clipped = clipped_objective(log_r, adv, clip_low, clip_high)
    n = m.sum().to(logp.dtype).clamp(min=1.0) if den is None else \
        torch.as_tensor(den, dtype=logp.dtype, device=logp.device)
    return (masked_sum((clipped & m).to(logp.dtype), m) / n).detach()

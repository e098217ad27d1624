"""Engine-learner mismatch: how far the behavior log-probs the engine returned are from the
learner's own log-probs of the same tokens under the same weights.

What it is: `learner_logp_at_behavior_version` (the learner's log-prob of each token under the
weight version that sampled it, where the learner has that version at hand: the proximal
policy's own version, or a kept snapshot) and `mismatch_metrics` (per-step figures as the
literature reports them: mean and max |b - p|, KL(mu || pi) and the share of tokens whose PPO
ratio `exp(p - b)` would already be clipped at lr = 0). At the same version the only difference
is numerics (engine dtype and kernels) or wrong weights: an fp32 darl-engine agrees with the
learner to ~1e-6, a bf16 engine does not, on purpose.
What it is not: a correction (nothing here feeds the loss) or the drift between versions
(`diagnostics.py`, `exp(p - b)` over every token whatever its version).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .reductions import LOG_RATIO_BOUND, check_token_tensors


def learner_logp_at_behavior_version(prox_logp: torch.Tensor, token_versions: torch.Tensor, prox_version: int | None,
                                     by_version: Mapping[int, torch.Tensor] | None = None,
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logp, at_hand)`, both `[B, T]`: per token of behavior version `v` (`token_versions`,
    `[B, T]`), the learner's log-prob under version `v` where it has one, `prox_logp` for
    `v == prox_version` and `by_version[v]` (kept snapshots) otherwise; `at_hand` is False
    (and `logp` 0) where the learner has no weights of that version."""
    if token_versions.shape != prox_logp.shape:
        raise ValueError(f"token_versions has shape {tuple(token_versions.shape)}, log-probs {tuple(prox_logp.shape)}")
    tables = dict(by_version or {})
    if prox_version is not None:
        tables[int(prox_version)] = prox_logp
    logp = torch.zeros_like(prox_logp)
    at_hand = torch.zeros(prox_logp.shape, dtype=torch.bool, device=prox_logp.device)
    for v, lp in tables.items():
        mine = token_versions == v
        logp = torch.where(mine, lp.to(logp.dtype), logp)
        at_hand |= mine
    return logp, at_hand


def mismatch_metrics(learner_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                     at_hand: torch.Tensor | None = None, *, clip_low: float = 0.2, clip_high: float = 0.2,
                     prefix: str = "algo") -> dict[str, float]:
    """Engine-learner mismatch over the tokens of `mask` (and `at_hand`), with `p` the learner's
    log-prob under the token's own behavior version and `b` the engine's, `r = exp(p - b)`:

    - `{prefix}/mismatch_abs_mean`, `/mismatch_abs_max`: mean and max |b - p|;
    - `{prefix}/mismatch_kl`: KL(mu || pi) by the k3 estimator, mean of r - 1 - log r (>= 0,
      samples from mu);
    - `{prefix}/mismatch_clip_frac`: share of tokens with r outside [1 - clip_low, 1 + clip_high],
      where a PPO ratio anchored at b is clipped before the first update (lr = 0);
    - `{prefix}/mismatch_tokens_frac`: share of `mask`'s tokens whose version is at hand.

    Computed in float64 (the fp32 case is ~1e-6, below float32's resolution of r - 1). With
    no token at hand only `mismatch_tokens_frac` (0) is returned.

    Args:
        learner_logp: `[B, T]`, the learner's log-probs (valid where `at_hand`).
        behav_logp: `[B, T]`, the engine's behavior log-probs.
        mask: `[B, T]`, the tokens that count (loss mask).
        at_hand: `[B, T]` bool, where `learner_logp` is of the token's own version; None: all.
        clip_low: the PPO clip's lower epsilon (`algo.clip_low`).
        clip_high: the PPO clip's upper epsilon (`algo.clip_high`).
        prefix: the metric namespace.
    """
    m = check_token_tensors(mask, learner_logp=learner_logp, behav_logp=behav_logp, at_hand=at_hand)
    n_all = int(m.sum())
    if at_hand is not None:
        m = m & at_hand.bool()
    n = int(m.sum())
    out = {f"{prefix}/mismatch_tokens_frac": n / n_all if n_all else 0.0}
    if n == 0:
        return out
    diff = (learner_logp.detach().double() - behav_logp.detach().double())[m]
    diff = diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    r = torch.exp(diff)
    clipped = (r < 1.0 - clip_low) | (r > 1.0 + clip_high)
    out.update({
        f"{prefix}/mismatch_abs_mean": float(diff.abs().mean()),
        f"{prefix}/mismatch_abs_max": float(diff.abs().max()),
        f"{prefix}/mismatch_kl": float((torch.expm1(diff) - diff).mean()),
        f"{prefix}/mismatch_clip_frac": float(clipped.double().mean()),
    })
    return out

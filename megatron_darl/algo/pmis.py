"""Policy-level multiple importance sampling (P-MIS) and the D-ARL policy loss.

What it is: the per-version split of a batch by behavior version k, the per-version token
mean `L_k`, the weights `beta_k` (`ess`, `tokens`, `balance`) and their combination
`loss = -sum_k beta_k L_k`; the choice of behavior weights (rollout IS, `RolloutISOptions`, or
the balance heuristic); the once-per-batch constants that let micro-batches add up exactly.
What it is not: the surrogates themselves (`losses.py`), rollout weights (`importance.py`) or
the balance-heuristic weights (`balance.py`).

Versions: the objective splits SEQUENCES by version (`versions` `[B]`, each sequence's oldest
token version, as the replay store ages it), one estimator `L_k` per version. Where the maths is
per token -- the balance heuristic's mixture `sum_k alpha_k mu_k(y_ij)` and its interpolated
`log mu_k` -- each token's own version counts (`TrainBatch.token_versions`).

Micro-batches: `L_k` divides by `N_k`, the masked tokens of version k in the whole batch.
Compute `beta, counts, metrics = pmis_batch_constants(...)` once on the batch, then
pass `beta=beta, version_token_counts=counts` to every micro-batch call of
`darl_policy_loss`: the micro-batch losses then sum to the batch loss, gradients included.
Several optimizer updates per batch (minibatches): beta_k still comes from the whole batch;
a minibatch holding a share `N_mb / N` of the batch's tokens passes `N_k * N_mb / N` as its
counts, so its loss estimates the whole-batch objective on its own tokens (and with
`beta = tokens` it is the minibatch's token mean, exactly the collapsed baseline's update).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .anchors import TRUST_ANCHORS, anchor_log_prob, anchored_objective
from .balance import balance_weights
from .importance import LEVELS, rollout_is_weights
from .losses import sg_objective, surrogate_metrics, weighted_surrogate
from .reductions import (
    check_sequence_tensor,
    check_token_tensors,
    lookup_version,
    masked_row_sum,
    masked_sum,
)
from .reductions import (
    version_token_counts as count_version_tokens,
)

PMIS_MODES = ("ess", "tokens", "balance")
SURROGATES = ("clip", "sg")


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`ESS = (sum w)^2 / sum w^2` over the mask; 0 when every weight is 0."""
    s = masked_sum(weights, mask)
    s2 = masked_sum(weights * weights, mask)
    return torch.where(s2 > 0, s * s / s2.clamp(min=torch.finfo(s2.dtype).tiny), torch.zeros_like(s))


def _ess_units(weights, mask, level):
    """What ESS counts: tokens, or sequences (each row's mean weight) for `level="sequence"`."""
    if level == "token":
        return weights, mask
    if level == "sequence":
        n = mask.sum(-1)
        row = masked_row_sum(weights, mask) / n.to(weights.dtype).clamp(min=1.0)
        return row.unsqueeze(-1), (n > 0).unsqueeze(-1)
    raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")


def pmis_statistics(
    versions: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, *,
    level: str = "token", all_versions=None,
) -> tuple[list[int], torch.Tensor]:
    """Sufficient statistics of P-MIS per version: `(ks, stats)`, `stats` float64 `[K, 4]`.

    Columns: `N_k` (masked tokens), `n_k` (ESS units: tokens, or sequences with tokens for
    `level="sequence"`), `sum rho`, `sum rho^2` over version k, for the sorted versions `ks`
    (`all_versions`, e.g. the replay window, when given: then every rank has the same rows).
    They add up across data-parallel ranks (all_reduce SUM) before
    `pmis_beta_from_statistics`, which makes beta and N_k exact for the global batch.
    """
    m = check_token_tensors(mask, weights=weights)
    check_sequence_tensor("versions", versions, m.shape[0])
    present = [int(k) for k in torch.unique(versions).tolist()]
    ks = present if all_versions is None else sorted(int(k) for k in all_versions)
    missing = sorted(set(present) - set(ks))
    if missing:
        raise ValueError(f"all_versions {ks} lacks versions {missing} present in the batch")
    w = weights.detach().to(torch.float64)
    units, unit_mask = _ess_units(w, m, level)
    row_tokens = m.sum(-1).to(torch.float64)
    stats = torch.zeros(len(ks), 4, dtype=torch.float64, device=w.device)
    for i, k in enumerate(ks):
        rows = versions == k
        u, um = units[rows], unit_mask[rows]
        stats[i, 0] = row_tokens[rows].sum()
        stats[i, 1] = um.sum()
        stats[i, 2] = masked_sum(u, um)
        stats[i, 3] = masked_sum(u * u, um)
    return ks, stats


def pmis_beta_from_statistics(
    ks: list[int], stats: torch.Tensor, *, mode: str = "ess",
) -> tuple[dict[int, float], dict[int, float], dict[str, torch.Tensor]]:
    """`(beta, version_token_counts, metrics)` from `pmis_statistics` (possibly all-reduced).

    ess: `beta_k = ESS_k / sum_k' ESS_k'`, `ESS_k = (sum rho)^2 / sum rho^2`; if every ESS is
    0 it falls back to `tokens`. tokens and balance: `beta_k = N_k / N`.
    """
    if mode not in PMIS_MODES:
        raise ValueError(f"pmis mode must be one of {PMIS_MODES}, got {mode!r}")
    rows = stats.detach().cpu().tolist()
    n_tok = {k: r[0] for k, r in zip(ks, rows)}
    ess = {k: (r[2] * r[2] / r[3] if r[3] > 0 else 0.0) for k, r in zip(ks, rows)}
    total_tok, total_ess = sum(n_tok.values()), sum(ess.values())
    if mode == "ess" and total_ess > 0:
        beta = {k: ess[k] / total_ess for k in ks}
    else:
        beta = {k: (n_tok[k] / total_tok if total_tok > 0 else 0.0) for k in ks}
    s, s2, n_all = (sum(r[c] for r in rows) for c in (2, 3, 1))
    metrics = {"algo/ess_frac": torch.tensor(s * s / s2 / n_all if s2 > 0 and n_all > 0 else 0.0)}
    for k, r in zip(ks, rows):
        metrics[f"algo/ess_frac/v{k}"] = torch.tensor(ess[k] / r[1] if r[1] > 0 else 0.0)
        metrics[f"algo/beta/v{k}"] = torch.tensor(beta[k])
        metrics[f"algo/tokens_frac/v{k}"] = torch.tensor(n_tok[k] / total_tok if total_tok > 0 else 0.0)
    return beta, n_tok, metrics


def pmis_coefficients(
    versions: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, *,
    mode: str = "ess", level: str = "token",
) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """Per-version weights `beta_k` (no grad, summing to 1) and metrics.

    ess: `beta_k = ESS_k / sum_k' ESS_k'`, `ESS_k = (sum rho)^2 / sum rho^2` over version k's
    tokens (over its sequences, each with its mean weight, for `level="sequence"`); if every
    ESS is 0 it falls back to `tokens`. tokens: `beta_k = N_k / N`, the collapsed token mean.
    balance: `N_k / N` too, since the balance heuristic puts the mixture in `rho` itself.
    Metrics: `algo/beta/v{k}`, `algo/tokens_frac/v{k}`, `algo/ess_frac/v{k}` (`ESS_k / n_k`,
    `n_k` tokens or sequences) and the global `algo/ess_frac`. Data parallel: sum
    `pmis_statistics` over ranks, then `pmis_beta_from_statistics`.
    """
    ks, stats = pmis_statistics(versions, weights, mask, level=level)
    beta, _, metrics = pmis_beta_from_statistics(ks, stats, mode=mode)
    return beta, metrics


@dataclass(frozen=True)
class RolloutISOptions:
    """The rollout-IS options of D-ARL's behavior weights `rho` (`rollout_is_weights`'s own).

    `darl_policy_loss` and `pmis_batch_constants` take them as the keywords `is_level`, `is_mode`,
    `is_threshold`, `is_threshold_lower` and `is_veto_threshold` (what verl and AReaL callers
    pass), build one of these once and hand it to `pmis_behavior_weights`.

    Attributes:
        level: `token`, `sequence` or `geometric`; ESS counts sequences unless `token`; `balance` and `sg`
            need `token`.
        mode: `truncate` or `mask`/`clip`; `sg` needs `truncate`.
        threshold: the upper bound on a weight, > 0 (`C` of `surrogate="sg"`).
        threshold_lower: `mask` mode's lower bound; None means `1/threshold`.
        veto_threshold: the per-token ratio below which a row is zeroed; None disables the veto.
    """

    level: str = "token"
    mode: str = "truncate"
    threshold: float = 2.0
    threshold_lower: float | None = None
    veto_threshold: float | None = 1e-4

    def weight_kwargs(self) -> dict:
        """The keywords of `rollout_is_weights` and `balance_weights` other than `level`."""
        return dict(mode=self.mode, threshold=self.threshold, threshold_lower=self.threshold_lower,
                    veto_threshold=self.veto_threshold)


DEFAULT_IS_OPTIONS = RolloutISOptions()


def pmis_behavior_weights(prox_logp, behav_logp, mask, versions, *,
                          is_options: RolloutISOptions = DEFAULT_IS_OPTIONS, pmis: str = "ess",
                          behav_logp_by_version=None, version_token_counts=None, mixture_counts=None):
    """`(rho, metrics)`: the behavior weights of D-ARL's clipped surrogate, `[B, T]` detached.

    Rollout IS weights (`rollout_is_weights` with `is_options`), or for `pmis="balance"`
    the balance-heuristic weights (`balance_weights`).

    Args:
        prox_logp: proximal-policy log-probs of the sampled tokens, `[B, T]`.
        behav_logp: behavior-policy log-probs of the same tokens, `[B, T]`.
        mask: `[B, T]`, true on the tokens that count.
        versions: `[B]` behavior version of each sequence; read only by `balance` (`[B, T]` allowed there).
        is_options: the rollout-IS options (`RolloutISOptions`); `balance` needs `level="token"`.
        pmis: the P-MIS mode, `ess`, `tokens` (both: rollout IS weights) or `balance` (balance heuristic).
        behav_logp_by_version: `{k: log mu_k}` `[B, T]`, required by `balance`; unused otherwise.
        version_token_counts: `{k: N_k}` of the whole batch; the mixture's `alpha_k` when `mixture_counts`
            is None (None as well: this call's counts).
        mixture_counts: `{k: N_k}` for `balance`'s `alpha_k` (e.g. by token version); None: `version_token_counts`.
    """
    opts = is_options.weight_kwargs()
    if pmis != "balance":
        return rollout_is_weights(prox_logp, behav_logp, mask, level=is_options.level, **opts)
    if is_options.level != "token":
        raise ValueError(f"pmis='balance' needs is_level='token', got {is_options.level!r}")
    if behav_logp_by_version is None:
        raise ValueError(
            "pmis='balance' needs behav_logp_by_version (log mu_k of every token for every "
            "version k); without kept snapshots use interpolate_version_logp (approximate)"
        )
    counts = mixture_counts if mixture_counts is not None else version_token_counts
    return balance_weights(prox_logp, behav_logp, behav_logp_by_version, versions, mask,
                           version_token_counts=counts, **opts)


def ess_level(is_level: str) -> str:
    """ESS counts sequences when the weights are per sequence (sequence/geometric IS level)."""
    if is_level not in LEVELS:
        raise ValueError(f"is_level must be one of {LEVELS}, got {is_level!r}")
    return "token" if is_level == "token" else "sequence"


def pmis_batch_constants(
    prox_logp, behav_logp, mask, versions, *, is_level: str = "token",
    is_mode: str = "truncate", is_threshold: float = 2.0, is_threshold_lower: float | None = None,
    is_veto_threshold: float | None = 1e-4, pmis: str = "ess",
    behav_logp_by_version: Mapping[int, torch.Tensor] | None = None,
    mixture_counts: Mapping[int, float] | None = None,
):
    """`(beta, version_token_counts, metrics)` of a whole batch, for micro-batch calls.

    Same weights as `darl_policy_loss(surrogate="clip")` with the same options; pass the first
    two (and the same `mixture_counts`) to each micro-batch call. Metrics: `algo/is/*`,
    `algo/beta/v{k}`, `algo/ess_frac*`.

    Args:
        prox_logp: proximal-policy log-probs of the whole batch's sampled tokens, `[B, T]`.
        behav_logp: behavior-policy log-probs of the same tokens, `[B, T]`.
        mask: `[B, T]`, true on the tokens that count.
        versions: `[B]`, the behavior version of each sequence; the returned counts are by it.
        is_level, is_mode, is_threshold, is_threshold_lower, is_veto_threshold: the rollout-IS options,
            `RolloutISOptions`'s `level`, `mode`, `threshold`, `threshold_lower` and `veto_threshold`.
        pmis: how `beta_k` is set: `ess` (by each version's ESS), `tokens` (`N_k / N`) or `balance`
            (`N_k / N`, with balance-heuristic weights).
        behav_logp_by_version: `{k: log mu_k}` `[B, T]`, required by `balance`; unused otherwise.
        mixture_counts: `{k: N_k}` for `balance`'s `alpha_k`; None uses the batch's counts by `versions`.
    """
    opts = RolloutISOptions(is_level, is_mode, is_threshold, is_threshold_lower, is_veto_threshold)
    m = check_token_tensors(mask, prox_logp=prox_logp, behav_logp=behav_logp)
    check_sequence_tensor("versions", versions, m.shape[0])
    counts = count_version_tokens(versions, m)
    rho, metrics = pmis_behavior_weights(prox_logp, behav_logp, m, versions, is_options=opts, pmis=pmis,
                                         behav_logp_by_version=behav_logp_by_version,
                                         version_token_counts=counts, mixture_counts=mixture_counts)
    beta, beta_metrics = pmis_coefficients(versions, rho, m, mode=pmis, level=ess_level(opts.level))
    return beta, counts, {**metrics, **beta_metrics}


def combine_versions(objective, mask, versions, beta: Mapping[int, float],
                     version_token_counts: Mapping[int, float] | None = None):
    """`loss = -sum_k beta_k L_k`, `L_k = (1/N_k) sum_{i in S_k} sum_j objective_ij`.

    `N_k` from `version_token_counts` (whole batch) or this call's masked tokens of version k
    (a version without tokens has `L_k = 0`). Returns `(loss, {"algo/objective/v{k}": L_k})`.
    """
    row_sum = objective.sum(-1)
    row_tokens = mask.sum(-1).to(objective.dtype)
    coef = torch.zeros_like(row_sum)  # beta_k / N_k of each row's version: one rounding, one sum
    metrics = {}
    for k in [int(k) for k in torch.unique(versions).tolist()]:
        rows = versions == k
        if version_token_counts is None:
            n_k = row_tokens[rows].sum().clamp(min=1.0)
        else:
            n_k = max(float(lookup_version(version_token_counts, k, "version_token_counts")), 1.0)
        coef = torch.where(rows, float(lookup_version(beta, k, "beta")) / n_k, coef)
        metrics[f"algo/objective/v{k}"] = (row_sum[rows].sum() / n_k).detach()
    loss = -(coef.detach() * row_sum).sum()  # an empty batch keeps the graph (a zero loss)
    return loss, metrics


def _check_sg_options(opts: RolloutISOptions, pmis, behav_clip):
    if opts.level != "token" or opts.mode != "truncate" or pmis == "balance" or behav_clip is not None:
        raise ValueError(
            "surrogate='sg' uses token-level truncated weights min(exp(q-b), is_threshold): it "
            "needs is_level='token', is_mode='truncate', pmis in ('ess', 'tokens') and behav_clip=None"
        )


def darl_policy_loss(
    logp, prox_logp, behav_logp, advantages, mask, versions, *,
    clip_low: float = 0.2, clip_high: float = 0.2, is_level: str = "token",
    is_mode: str = "truncate", is_threshold: float = 2.0, is_threshold_lower: float | None = None,
    is_veto_threshold: float | None = 1e-4, pmis: str = "ess", ratio_level: str = "token",
    surrogate: str = "clip", behav_clip: str | None = None, behav_mask_threshold: float = 5.0,
    beta: Mapping[int, float] | None = None,
    version_token_counts: Mapping[int, float] | None = None,
    behav_logp_by_version: Mapping[int, torch.Tensor] | None = None,
    mixture_counts: Mapping[int, float] | None = None, anchor: str = "proximal",
):
    """D-ARL loss `-sum_k beta_k L_k`, `L_k = (1/N_k) sum_{i in S_k} sum_j m_ij rho_ij
    min(r_ij A_i, clip(r_ij, 1-clip_low, 1+clip_high) A_i)` (`anchor="proximal"`); with
    `anchor="behavior"` or `"mixture"` the ratio is `R = exp(q - a)` against the sample's own
    behavior log-prob or the balance mixture, and `rho` only sets `beta_k` (`anchors.py`).

    `rho` = `rollout_is_weights` with the `is_*` options (`RolloutISOptions`), or the
    balance-heuristic weights for `pmis="balance"`. Micro-batches: pass `beta` and
    `version_token_counts` from `pmis_batch_constants`; then the weight/beta metrics come from
    that call and are not repeated here, and the token-mean metrics here use `N = sum_k N_k`
    so they add up.

    Args:
        logp: current-policy log-probs `q` of the sampled tokens, `[B, T]`, with gradient.
        prox_logp: proximal-policy log-probs `p`, `[B, T]`; may be None with `surrogate="sg"`.
        behav_logp: behavior-policy log-probs `b`, `[B, T]`.
        advantages: `[B]` (one per response) or `[B, T]`.
        mask: `[B, T]`, true on the tokens that count.
        versions: `[B]`, the behavior version of each sequence (the split into `S_k`).
        clip_low: `r` is clipped below at `1 - clip_low`, in `[0, 1)`.
        clip_high: `r` is clipped above at `1 + clip_high`, >= 0.
        is_level, is_mode, is_threshold, is_threshold_lower, is_veto_threshold: the rollout-IS options,
            `RolloutISOptions`'s `level`, `mode`, `threshold` (`C` of `sg`), `threshold_lower`, `veto_threshold`.
        pmis: how `beta_k` is set: `ess` (by each version's ESS), `tokens` (`N_k / N`) or `balance`
            (`N_k / N`, with balance-heuristic `rho`; not with `sg`).
        ratio_level: `token`, or `sequence` for GSPO-style ratios (`policy_log_ratio`).
        surrogate: `clip` (the clipped surrogate above) or `sg`: `sg(min(exp(q-b), C)) q A`, no proximal policy.
        behav_clip: the behavior-side trust region of `weighted_surrogate`: None, `ratio` or `mask`;
            `sg` needs None.
        behav_mask_threshold: `C` of `behav_clip="mask"` (tokens with `exp(p - b)` outside `[1/C, C]` drop), > 1.
        beta: `{k: beta_k}` of the whole batch from `pmis_batch_constants`; None computes it from this call.
        version_token_counts: `{k: N_k}` of the whole batch, from `pmis_batch_constants`; None counts this
            call's masked tokens per version.
        behav_logp_by_version: `{k: log mu_k}` `[B, T]`, required by `pmis="balance"`; unused otherwise.
        mixture_counts: `{k: N_k}` for `balance`'s `alpha_k`, e.g. `version_token_counts(token_versions,
            mask)` of the whole batch, so each token counts for its own version; None: `version_token_counts`.
        anchor: where the PPO clip is anchored: `proximal` (L_k as AReaL's decoupled objective reads it),
            `behavior` or `mixture` (needs `behav_logp_by_version`, `alpha_k` from `mixture_counts`);
            `surrogate="clip"` only.
    """
    if surrogate not in SURROGATES:
        raise ValueError(f"surrogate must be one of {SURROGATES}, got {surrogate!r}")
    if anchor not in TRUST_ANCHORS or (anchor != "proximal" and (surrogate != "clip" or behav_clip is not None)):
        raise ValueError(f"anchor must be one of {TRUST_ANCHORS} (got {anchor!r}); behavior and mixture need "
                         f"surrogate='clip' and behav_clip=None (got {surrogate!r}, {behav_clip!r})")
    m = check_token_tensors(mask, logp=logp, prox_logp=prox_logp, behav_logp=behav_logp)
    check_sequence_tensor("versions", versions, m.shape[0])
    opts = RolloutISOptions(is_level, is_mode, is_threshold, is_threshold_lower, is_veto_threshold)
    metrics: dict[str, torch.Tensor] = {}
    if surrogate == "sg":
        _check_sg_options(opts, pmis, behav_clip)
        obj, rho, _ = sg_objective(logp, behav_logp, advantages, m, threshold=opts.threshold)
    else:
        if prox_logp is None:
            raise ValueError("surrogate='clip' needs prox_logp")
        rho, is_metrics = pmis_behavior_weights(prox_logp, behav_logp, m, versions, is_options=opts, pmis=pmis,
                                                behav_logp_by_version=behav_logp_by_version,
                                                version_token_counts=version_token_counts,
                                                mixture_counts=mixture_counts)
        clip = dict(clip_low=clip_low, clip_high=clip_high, ratio_level=ratio_level)
        if anchor == "proximal":
            old = prox_logp
            obj, flags = weighted_surrogate(logp, prox_logp, behav_logp, advantages, m, rho, behav_clip=behav_clip,
                                            behav_mask_threshold=behav_mask_threshold, **clip)
        else:  # the clip anchored behind the data: no behavior weight (rho sets only beta_k)
            mix = mixture_counts if mixture_counts is not None else version_token_counts
            old = anchor_log_prob(anchor, behav_logp, m, behav_logp_by_version=behav_logp_by_version,
                                  counts=count_version_tokens(versions, m) if mix is None else mix)
            obj, flags = anchored_objective(logp, old, advantages, m, **clip)
        if beta is None:
            metrics.update(is_metrics)
        total = m.sum() if version_token_counts is None else sum(version_token_counts.values())
        den = torch.as_tensor(total, dtype=logp.dtype, device=logp.device).clamp(min=1.0)
        metrics.update(surrogate_metrics(flags, logp, old, m, den))
    if beta is None:
        beta, beta_metrics = pmis_coefficients(versions, rho, m, mode=pmis, level=ess_level(opts.level))
        metrics.update(beta_metrics)
    loss, loss_metrics = combine_versions(obj, m, versions, beta, version_token_counts)
    metrics.update(loss_metrics)
    return loss, metrics

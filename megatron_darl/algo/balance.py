"""The Veach balance heuristic of P-MIS: its weights and the log-linear approximation of `log mu_k`.

What it is: `rho_ij = pi_prox(y_ij) / sum_k alpha_k mu_k(y_ij)`, each token weighed against the
mixture of every behavior version of the batch, truncated/masked and vetoed as rollout IS
weights are; and, for versions whose snapshots are not kept, `log mu_k` interpolated between
the token's own behavior log-prob and the proximal one.
What it is not: the choice between these and plain rollout IS weights, or `beta_k` and the
loss (`pmis.py`); the mixture as a PPO anchor (`anchors.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .importance import weights_from_log
from .reductions import check_sequence_tensor, check_token_tensors, lookup_version
from .reductions import version_token_counts as count_version_tokens


def interpolate_version_logp(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, versions: torch.Tensor,
    prox_version: int, target_versions,
) -> dict[int, torch.Tensor]:
    """APPROXIMATION of `log mu_k(y_ij)` for versions whose snapshots are not kept.

    Log-linear in the version index between the token's own behavior (`b`, version `v`) and
    the proximal policy (`p`, version `prox_version`):
    `log mu_k ~ b + (k - v) / (prox_version - v) * (p - b)` (extrapolated for k < v; `b` for
    every k when `v == prox_version`). Exact only at `k = v` and `k = prox_version`. `versions`
    is `[B]` (one version per sequence) or `[B, T]` (each token's own version, e.g.
    `TrainBatch.token_versions`: right for the later tokens of an interrupted rollout, whose
    `b` comes from a newer version than the sequence's first token; values off the mask are
    ignored).
    """
    m = check_token_tensors(torch.ones_like(prox_logp, dtype=torch.bool), behav_logp=behav_logp)
    if versions.dim() == 2:
        check_token_tensors(m, versions=versions)
    else:
        check_sequence_tensor("versions", versions, m.shape[0])
    if bool((versions > prox_version).any()):
        raise ValueError(f"versions must be <= prox_version={prox_version}")
    p, b = prox_logp.detach(), behav_logp.detach()
    per_token = versions if versions.dim() == 2 else versions.unsqueeze(-1)
    gap = (prox_version - per_token).to(p.dtype)
    out = {}
    for k in target_versions:
        frac = torch.where(gap > 0, (k - per_token).to(p.dtype) / gap.clamp(min=1.0), torch.zeros_like(gap))
        out[int(k)] = b + frac * (p - b)
    return out


def balance_weights(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor,
    behav_logp_by_version: Mapping[int, torch.Tensor], versions: torch.Tensor, mask: torch.Tensor,
    *, version_token_counts: Mapping[int, float] | None = None, mode: str = "truncate",
    threshold: float = 2.0, threshold_lower: float | None = None,
    veto_threshold: float | None = 1e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Veach balance-heuristic weights `rho_ij = pi_prox(y_ij) / sum_k alpha_k mu_k(y_ij)`.

    `alpha_k = N_k / N` over the versions of `version_token_counts`. Then `mode`/`threshold`/veto
    as in `rollout_is_weights` (the veto looks at each token's own `exp(p - b)`).

    Args:
        prox_logp: proximal-policy log-probs `p` of the sampled tokens, `[B, T]`.
        behav_logp: each token's own behavior log-prob `b`, `[B, T]`; read only by the veto.
        behav_logp_by_version: `{k: log mu_k}` of every token, `[B, T]` each: exact when the K behavior
            snapshots are kept and score the batch, else from `interpolate_version_logp` (an approximation).
        versions: `[B]` (every token of row i counts for `versions[i]`) or `[B, T]` (each token its own).
        mask: `[B, T]`, true on the tokens that count.
        version_token_counts: `{k: N_k}`, the whole batch's masked tokens per version; None counts this
            call's tokens by `versions`.
        mode: `truncate` or `mask`/`clip`, as in `rollout_is_weights`.
        threshold: the upper bound on a weight, > 0.
        threshold_lower: `mask` mode's lower bound, in `[0, threshold]`; None means `1/threshold`.
        veto_threshold: a row with any masked `exp(p - b)` below this is zeroed; None disables the veto.
    """
    m = check_token_tensors(mask, prox_logp=prox_logp, behav_logp=behav_logp)
    if versions.dim() == 2:
        check_token_tensors(mask, versions=versions)
    else:
        check_sequence_tensor("versions", versions, m.shape[0])
    counts = version_token_counts if version_token_counts is not None else count_version_tokens(versions, m)
    total = sum(float(n) for n in counts.values())
    zero = torch.zeros((), dtype=prox_logp.dtype, device=prox_logp.device)
    terms = []
    for k, n_k in sorted(counts.items()):
        if float(n_k) <= 0:
            continue
        lp = lookup_version(behav_logp_by_version, k, "behav_logp_by_version")
        check_token_tensors(mask, **{f"behav_logp_by_version[{k}]": lp})
        terms.append(math.log(float(n_k) / total) + lp.detach())
    for k in torch.unique(versions[m] if versions.dim() == 2 else versions).tolist():
        lookup_version(counts, int(k), "version_token_counts")
    p = prox_logp.detach()
    log_mix = torch.logsumexp(torch.stack(terms), 0) if terms else p
    log_w = torch.where(m, p - log_mix, zero)
    l_tok = torch.where(m, p - behav_logp.detach(), zero)
    return weights_from_log(
        log_w, l_tok, m, mode=mode, threshold=threshold,
        threshold_lower=threshold_lower, veto_threshold=veto_threshold,
    )

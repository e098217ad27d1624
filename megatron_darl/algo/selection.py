"""Variance-guided, distribution-matched selection of groups (D-ARL "sg" gating).

What it is: the response score `s_i = (1/T_i) sum_j l_ij^2`, the group score (mean of its
responses' scores), the threshold `tau` from the freshest version's groups, and the choice
of which groups form the batch. Pure functions over small per-group tensors.
What it is not: the replay pool. Ageing out (`t - v > K`), `max_reuse` and removal of the
chosen groups belong to the replay store, which calls these functions.

Warmup (the first `warmup` steps train never-trained groups only) is the store's rule: it
offers no reused group then; selection has no warmup mode of its own.
"""

from __future__ import annotations

import torch

from .reductions import LOG_RATIO_BOUND, check_sequence_tensor, check_token_tensors, masked_row_sum

FILLS = ("fresh", "none")


def variance_scores(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-response score `s_i = (1/T_i) sum_j m_ij (p_ij - b_ij)^2`, `[B]`.

    The second moment of the log weight (tracks Var[w] for small drift). A row without masked
    tokens scores 0. `l` is clamped to +-LOG_RATIO_BOUND so an extreme token cannot make inf.
    """
    m = check_token_tensors(mask, prox_logp=prox_logp, behav_logp=behav_logp)
    zero = torch.zeros((), dtype=prox_logp.dtype, device=prox_logp.device)
    l_tok = torch.where(m, (prox_logp - behav_logp).detach(), zero)
    l_tok = l_tok.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    n = m.sum(-1).to(l_tok.dtype).clamp(min=1.0)
    return masked_row_sum(l_tok * l_tok, m) / n


def group_scores(
    scores: torch.Tensor, group_index: torch.Tensor, versions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group `(group_ids [G], score [G], version [G])`, groups in ascending id.

    Group score = mean of its responses' scores; group version = the oldest version among its
    responses (staleness counts from the oldest token, as `Trajectory.version` does).
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {tuple(scores.shape)}")
    check_sequence_tensor("group_index", group_index, scores.shape[0])
    check_sequence_tensor("versions", versions, scores.shape[0])
    ids, inverse = torch.unique(group_index, return_inverse=True)
    g = ids.shape[0]
    total = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, scores)
    count = torch.zeros_like(total).index_add_(0, inverse, torch.ones_like(scores))
    big = torch.iinfo(torch.int64).max
    oldest = torch.full((g,), big, dtype=torch.int64, device=versions.device)
    oldest = oldest.scatter_reduce(0, inverse, versions.to(torch.int64), reduce="amin")
    return ids, total / count, oldest


def selection_threshold(group_scores: torch.Tensor, group_versions: torch.Tensor, *, quantile: float = 0.9,
                        tau_floor: float = 0.0) -> float:
    """`tau = max(quantile(scores of the freshest version's groups, q), tau_floor)` (linear
    interpolation).

    The floor keeps the threshold on the scale of "still matches the current policy": where the
    engine and the learner compute the same log-probs (the CPU demo) the freshest groups score
    ~1e-13, and a quantile of those alone would admit no stale group at all.
    """
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {quantile}")
    if tau_floor < 0.0:
        raise ValueError(f"tau_floor must be >= 0, got {tau_floor}")
    if group_scores.numel() == 0:
        raise ValueError("selection_threshold needs at least one group")
    fresh = group_versions == group_versions.max()
    return max(float(torch.quantile(group_scores[fresh].double(), quantile)), float(tau_floor))


def admitted_groups(group_scores: torch.Tensor, group_versions: torch.Tensor, *, quantile: float = 0.9,
                    tau_abs: float | None = None, tau_floor: float = 0.0) -> tuple[float, torch.Tensor]:
    """`(tau, admitted [G] bool)`: the gate of `select_groups`. A group of the freshest version is
    admitted when its score <= tau, a stale one when <= `min(tau, tau_abs)`."""
    tau = selection_threshold(group_scores, group_versions, quantile=quantile, tau_floor=tau_floor)
    stale_tau = tau if tau_abs is None else min(tau, tau_abs)
    fresh = group_versions == group_versions.max()
    limit = torch.full(group_scores.shape, stale_tau, dtype=torch.float64).masked_fill(fresh.cpu(), tau)
    return tau, group_scores.detach().cpu().double() <= limit


def _check_select_inputs(group_scores, group_versions, batch_groups, fill):
    if group_scores.dim() != 1:
        raise ValueError(f"group_scores must be [G], got shape {tuple(group_scores.shape)}")
    check_sequence_tensor("group_versions", group_versions, group_scores.shape[0])
    if batch_groups < 0:
        raise ValueError(f"batch_groups must be >= 0, got {batch_groups}")
    if fill not in FILLS:
        raise ValueError(f"fill must be one of {FILLS}, got {fill!r}")
    if not bool(torch.isfinite(group_scores).all()):
        raise ValueError("group_scores contains NaN or inf")


def select_groups(
    group_scores: torch.Tensor,
    group_versions: torch.Tensor,
    *,
    quantile: float = 0.9,
    tau_abs: float | None = None,
    tau_floor: float = 0.0,
    batch_groups: int,
    fill: str = "fresh",
    never_trained: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indices (into the `G` groups, LongTensor) of the groups that form the batch.

    0. With `never_trained`: those groups first, ungated, in index order (the pool's, oldest
       first), at most `batch_groups`; the steps below fill only the room left, from the others.
       So a reused group never displaces a never-trained one.
    1. `admitted_groups(...)`: `tau = max(quantile, tau_floor)`; a stale group (version below the
       freshest) is admitted when its score <= `min(tau, tau_abs)`, a freshest group when <= `tau`.
    2. Admitted groups in ascending score (ties: newer version first, then lower index),
       at most `batch_groups`.
    3. If short, `fill` decides. Returned in selection order.

    Args:
        group_scores: `[G]` finite scores, each the mean `variance_scores` of a group's responses.
        group_versions: `[G]` version of each group (its oldest response's).
        quantile: `q` in `[0, 1]` of the freshest version's group scores that sets `tau`.
        tau_abs: an absolute cap on the score of a stale group; None: stale groups use `tau` too.
        tau_floor: the lowest `tau` may be, >= 0 (keeps `tau` above round-off where scores are ~0).
        batch_groups: how many groups to choose, >= 0 (required).
        fill: `fresh` tops a short batch up with the freshest remaining groups (newest version first, then
            ascending score, then index); `none` returns fewer.
        never_trained: `[G]` bool, the groups no step has trained yet, taken first (step 0); None: every
            group competes by score (a reused group may then displace a never-trained one).
    """
    _check_select_inputs(group_scores, group_versions, batch_groups, fill)
    g = group_scores.shape[0]
    if g == 0 or batch_groups == 0:
        return torch.zeros(0, dtype=torch.long)
    s, v = group_scores.tolist(), group_versions.tolist()
    _, ok = admitted_groups(group_scores, group_versions, quantile=quantile, tau_abs=tau_abs, tau_floor=tau_floor)
    chosen: list[int] = []
    if never_trained is not None:
        check_sequence_tensor("never_trained", never_trained, g)
        chosen = [i for i in range(g) if bool(never_trained[i])][:batch_groups]
    taken = set(chosen)
    admitted = [i for i in range(g) if ok[i] and i not in taken]
    chosen += sorted(admitted, key=lambda i: (s[i], -v[i], i))[: batch_groups - len(chosen)]
    if len(chosen) < batch_groups and fill == "fresh":
        taken = set(chosen)
        rest = sorted((i for i in range(g) if i not in taken), key=lambda i: (-v[i], s[i], i))
        chosen += rest[: batch_groups - len(chosen)]
    return torch.tensor(chosen, dtype=torch.long)


def selection_metrics(
    group_versions: torch.Tensor, selected: torch.Tensor, tau: float | None = None
) -> dict[str, float]:
    """`algo/select/filtered_frac/v{k}` (share of version k's groups left out), the count chosen
    and `tau`."""
    chosen = torch.zeros(group_versions.shape[0], dtype=torch.bool)
    chosen[selected.cpu()] = True
    v = group_versions.cpu()
    out: dict[str, float] = {"algo/select/n_groups": float(chosen.sum())}
    for k in torch.unique(v).tolist():
        of_k = v == k
        out[f"algo/select/filtered_frac/v{k}"] = float((of_k & ~chosen).sum()) / float(of_k.sum())
    if tau is not None:
        out["algo/select/tau"] = float(tau)
    return out

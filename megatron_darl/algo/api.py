"""Public contract of `megatron_darl.algo`: what another RL pipeline may import and rely on.

What it is: the re-exports and the table below. What it is not: an implementation; the maths
of each function is in its docstring and in docs/ALGORITHM.md.

Conventions. Per-token tensors are `[B, T]` with `mask` (1 = response token that counts);
per-sequence tensors are `[B]`; advantages may be `[B]` or `[B, T]`. Log-probs: `logp` =
current policy q (with grad), `prox_logp` = proximal p (recomputed, no grad), `behav_logp` =
behavior b (from the rollout engine). Losses return `(loss, metrics)`, metrics keyed
`algo/...` with detached 0-dim tensors (no host sync inside a loss). Ratios are formed in log
space with the exponent clamped (`LOG_RATIO_BOUND`), so nothing overflows. Pure torch: no
config objects, no Megatron, no torch.distributed.

Micro-batches (gradient accumulation): token-mean losses take `loss_denominator` (masked
tokens of the whole batch); `darl_policy_loss` takes `beta` and `version_token_counts` from
`pmis_batch_constants`. Then micro-batch losses and gradients sum to the full batch's.

| function | returns | what |
|---|---|---|
| grpo_advantages(rewards, group_index, norm_by_std, eps) | [B] | GRPO / Dr.GRPO |
| rloo_advantages(rewards, group_index) | [B] | leave-one-out baseline |
| rollout_is_weights(prox, behav, mask, level, mode, threshold, ...) | [B,T], metrics | verl rollout IS |
| ppo_loss(logp, old, adv, mask, clip_low, clip_high, token_weights, ...) | loss, metrics | clipped PPO |
| decoupled_ppo_loss(logp, prox, behav, adv, mask, ..., behav_clip) | loss, metrics | AReaL objective |
| decoupled_weights(prox, behav, mask, behav_weight_cap) | [B,T], metrics | AReaL's capped exp(p - b) |
| sg_policy_loss(logp, behav, adv, mask, threshold, loss_denominator) | loss, metrics | stop-grad REINFORCE |
| weighted_surrogate(...), clipped_objective(...), sg_objective(...) | [B,T] | per-token building blocks |
| variance_scores(prox, behav, mask) | [B] | mean_t l^2 |
| group_scores(scores, group_index, versions) | ids, scores, versions [G] | group mean / oldest |
| selection_threshold(group_scores, group_versions, quantile, tau_floor) | float | tau |
| admitted_groups(group_scores, group_versions, quantile, tau_abs, tau_floor) | tau, [G] bool | the gate |
| select_groups(group_scores, group_versions, quantile, tau_abs, tau_floor, ...) | LongTensor | D-ARL gating |
| selection_metrics(group_versions, selected, tau) | dict | filtered share per version |
| pmis_coefficients(versions, weights, mask, mode, level) | beta dict, metrics | ess / tokens / balance |
| pmis_statistics(versions, weights, mask, level, all_versions) | ks, [K,4] | summable across DP ranks |
| pmis_beta_from_statistics(ks, stats, mode) | beta, counts, metrics | beta from (all-reduced) stats |
| balance_weights(prox, behav, behav_by_version, versions, mask, ...) | [B,T], metrics | Veach balance |
| interpolate_version_logp(prox, behav, versions, prox_version, targets) | dict | log-linear approx. |
| pmis_batch_constants(prox, behav, mask, versions, ...) | beta, counts, metrics | once per batch |
| pmis_behavior_weights(prox, behav, mask, versions, is_options, ...) | [B,T], metrics | rho of darl_policy_loss |
| RolloutISOptions(level, mode, threshold, threshold_lower, veto_threshold) | frozen | the is_* keywords |
| combine_versions(objective, mask, versions, beta, counts) | loss, metrics | -sum beta_k L_k |
| darl_policy_loss(logp, prox, behav, adv, mask, versions, ..., anchor) | loss, metrics | D-ARL policy loss |
| anchored_objective(logp, anchor_logp, adv, mask, ...) | [B,T], flags | clip against b or the mixture |
| anchor_log_prob(anchor, behav, mask, ...), mixture_log_prob(by_version, counts) | [B,T] | the anchor's log |
| behavior_clip_fraction(logp, behav, adv, mask, ...) | 0-dim | where a clip at b acts |
| version_token_counts(versions, mask) | dict | N_k (versions [B] per sequence, [B,T] per token) |
| effective_sample_size(weights, mask) | 0-dim | (sum w)^2 / sum w^2 |
| diagnostics(prox, behav, mask, versions, ...) | dict | ESS, rho stats, KL, staleness |
| drift_diagnostics(prox, behav, mask, versions) | dict | KL, ESS of exp(p - b): losses without weights |
| kl_estimates, staleness_histogram, masked_quantile | dict / 0-dim | diagnostics parts |
| learner_logp_at_behavior_version(prox, token_versions, ...) | [B,T], at_hand | p at the token's version |
| mismatch_metrics(learner_logp, behav, mask, at_hand, ...) | dict | engine-learner mismatch |
"""

import sys

from .advantages import grpo_advantages, rloo_advantages
from .anchors import TRUST_ANCHORS, anchor_log_prob, anchored_objective, behavior_clip_fraction, mixture_log_prob
from .balance import balance_weights, interpolate_version_logp
from .diagnostics import diagnostics, drift_diagnostics, kl_estimates, masked_quantile, staleness_histogram
from .importance import rollout_is_weights
from .losses import (
    clipped_objective,
    decoupled_ppo_loss,
    decoupled_weights,
    ppo_loss,
    sg_objective,
    sg_policy_loss,
    weighted_surrogate,
)
from .mismatch import learner_logp_at_behavior_version, mismatch_metrics
from .pmis import (
    RolloutISOptions,
    combine_versions,
    darl_policy_loss,
    effective_sample_size,
    ess_level,
    pmis_batch_constants,
    pmis_behavior_weights,
    pmis_beta_from_statistics,
    pmis_coefficients,
    pmis_statistics,
)
from .reductions import LOG_RATIO_BOUND, version_token_counts
from .selection import (
    admitted_groups,
    group_scores,
    select_groups,
    selection_metrics,
    selection_threshold,
    variance_scores,
)

__all__ = [
    "LOG_RATIO_BOUND",
    "TRUST_ANCHORS",
    "RolloutISOptions",
    "admitted_groups",
    "anchor_log_prob",
    "anchored_objective",
    "balance_weights",
    "behavior_clip_fraction",
    "clipped_objective",
    "combine_versions",
    "darl_policy_loss",
    "decoupled_ppo_loss",
    "decoupled_weights",
    "diagnostics",
    "drift_diagnostics",
    "effective_sample_size",
    "ess_level",
    "grpo_advantages",
    "group_scores",
    "interpolate_version_logp",
    "kl_estimates",
    "learner_logp_at_behavior_version",
    "masked_quantile",
    "mismatch_metrics",
    "mixture_log_prob",
    "pmis_batch_constants",
    "pmis_behavior_weights",
    "pmis_beta_from_statistics",
    "pmis_coefficients",
    "pmis_statistics",
    "ppo_loss",
    "rloo_advantages",
    "rollout_is_weights",
    "select_groups",
    "selection_metrics",
    "selection_threshold",
    "sg_objective",
    "sg_policy_loss",
    "staleness_histogram",
    "variance_scores",
    "version_token_counts",
    "weighted_surrogate",
]

# `megatron_darl.algo` re-exports this contract and loads it on first use (its __init__). Whoever
# imports this module first, the package then holds these functions, and a function wins over
# the submodule of the same name (`algo.diagnostics` is the function), as a star import did.
_package = sys.modules[__name__.rpartition(".")[0]]
for _name in __all__:
    setattr(_package, _name, globals()[_name])

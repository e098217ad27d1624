"""The `algo` config section: every knob of D-ARL and of the baselines it is compared with.

What it is: `AlgoConfig`, one documented field per knob, in four groups: the staleness bound
(how far generation may run ahead), the policy loss, the replay window over the K newest
behavior versions, variance-guided selection ("sg") and the per-version objective ("pmis");
with the checks of their combinations, and the derived values as properties. The maths is in
this folder's functions and in docs/ALGORITHM.md, which names the knob of every choice.
What it is not: an argument of the maths. The functions of `algo/` take tensors and plain numbers,
never this object: the trainer reads it and passes them. It imports nothing of the package, so
another pipeline may lift it with the functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

POLICY_LOSSES = ("ppo", "decoupled", "darl", "sg_weight")
PMIS_BETAS = ("ess", "tokens", "balance")
SG_FILLS = ("fresh", "none")
REUSE_ORDERS = ("oldest", "freshest")
TRUST_ANCHORS = ("proximal", "behavior", "mixture")
BALANCE_SNAPSHOTS = ("exact", "interpolate", "auto")


@dataclass
class AlgoConfig:
    """D-ARL and its baselines. Field comments are the documentation; docs/ALGORITHM.md the maths."""

    # ---- staleness (AReaL's admission bound, enforced by the rollout manager's gate)
    # eta: batches generation may run ahead of training; a token may come from a version at most
    # eta behind the one trained. 0 = synchronous
    max_head_offpolicyness: int = 4

    # ---- the policy loss
    policy_loss: str = "darl"  # ppo | decoupled (AReaL) | darl (per-version P-MIS) | sg_weight
    old_logprob: str = "proximal"  # ratio denominator: behavior | proximal (ppo+behavior = naive async)
    # recompute pi_prox log-probs at step start; losses that do not read them (naive async) then
    # recompute only for the drift diagnostics (ESS, KL), false skips that forward pass
    recompute_proximal: bool = True
    rollout_is: str | None = None  # verl-style IS weights on ppo: token | sequence | geometric
    rollout_is_mode: str = "truncate"  # truncate | mask | clip
    rollout_is_threshold: float = 2.0  # upper cap C of the IS weight (also sg_weight's cap on exp(q - b))
    rollout_is_threshold_lower: float | None = None  # mask mode lower bound; None: 1/threshold
    rollout_is_veto_threshold: float = 1e-4  # drop a sequence with any token ratio below this
    behav_weight_cap: float | None = 5.0  # decoupled (AReaL): tokens with w above it are dropped
    # decoupled/darl behavior-side trust region: tokens with exp(p - b) outside [1/C, C] are dropped
    behav_clip: float | None = None
    clip_low: float = 0.2  # PPO clip 1 - clip_low
    clip_high: float = 0.2  # PPO clip 1 + clip_high
    ratio_level: str = "token"  # token | sequence (GSPO-style)
    advantage: str = "grpo"  # grpo | drgrpo | rloo
    adv_eps: float = 1e-6  # std floor of GRPO normalisation
    ppo_n_minibatches: int = 4  # optimizer steps per train step (a seeded random partition of the batch)
    entropy_coef: float = 0.0  # entropy bonus (subtracted from the loss)
    # darl only: where the PPO clip of the per-version objective is anchored. null (the default) means
    # "behavior" under policy_loss=darl (see `anchor`). "behavior": R = exp(q - b) against each sample's own
    # behavior policy, clipped, no rho: a trust region that holds across a sample's reuses. "proximal": the
    # form read from AReaL's decoupled objective, r = exp(q - p) clipped, times rho = min(exp(p - b), C),
    # re-anchored every step (budget2 refutes it under reuse, docs/results/README.md). "mixture":
    # R = pi_theta / sum_k alpha_k mu_k, clipped (needs pmis_beta=balance)
    trust_anchor: str | None = None

    # ---- the replay window
    replay: bool = True  # false: every group is trained once then dropped (the baselines); no age eviction
    # K: window of behavior versions kept; a group of version v leaves when t - v > K. New data is at
    # most eta (max_head_offpolicyness) old, so a group is replayed from K - eta versions: K <= eta
    # never replays
    k: int = 4
    max_reuse: int | None = None  # times a group may be trained; None: K (see effective_max_reuse)
    warmup: int = 5  # with `sg`: the first `warmup` steps train full batches of never-trained groups (no replay)
    # FIFO (no `sg`: the replay baselines, D-ARL without selection): which of the reused groups
    # offered fill the batch's room first: "oldest" version (the order they entered the pool) or
    # "freshest" (the order the feed offers them, as D-ARL's candidates are capped)
    reuse_order: str = "oldest"

    # ---- variance-guided selection ("sg")
    sg: bool = True  # score = mean of l^2 per group, threshold from the freshest version's groups
    sg_quantile: float = 0.9  # q: tau = quantile of the freshest version's group scores
    sg_tau_abs: float | None = None  # absolute score cap for stale groups only (0.04 is a good try)
    # floor of tau: a group whose score (mean squared log weight, ~ Var of its weights) is within
    # it still matches the current policy, however small the freshest groups' scores (~1e-13 where
    # engine and learner compute the same log-probs, which would admit no stale group)
    sg_tau_floor: float = 0.01
    sg_fill: str = "fresh"  # batch short after gating: "fresh" fills with the freshest rest, "none" leaves it short
    # true: the never-trained candidates fill the batch first and reused groups only the room left, so
    # a reused group never displaces never-trained data; false (the published runs): ranked together by score
    sg_new_first: bool = True

    # ---- the per-version objective (policy-level multiple importance sampling, "pmis")
    pmis: bool = True  # per-version objective with weights beta_k (false: one collapsed token mean)
    pmis_beta: str = "ess"  # beta_k: "ess" (inverse variance) | "tokens" (N_k/N) | "balance" (Veach)
    # balance's log mu_k: "exact" keeps a CPU copy of the weights of the K previous versions and
    # rescores the batch with each; "interpolate" approximates log-linearly between b and p (no
    # copies); "auto": exact when K copies of the parameters fit in 2 GiB, else interpolate
    balance_snapshots: str = "auto"

    _choices: ClassVar[dict[str, tuple[str, ...]]] = {
        "policy_loss": POLICY_LOSSES,
        "old_logprob": ("behavior", "proximal"),
        "rollout_is": ("token", "sequence", "geometric"),
        "rollout_is_mode": ("truncate", "mask", "clip"),
        "ratio_level": ("token", "sequence"),
        "advantage": ("grpo", "drgrpo", "rloo"),
        "sg_fill": SG_FILLS,
        "reuse_order": REUSE_ORDERS,
        "pmis_beta": PMIS_BETAS,
        "balance_snapshots": BALANCE_SNAPSHOTS,
        "trust_anchor": TRUST_ANCHORS,
    }

    @property
    def uses_proximal(self) -> bool:
        """Whether the loss reads pi_prox log-probs (sg_weight never does)."""
        if self.policy_loss in ("decoupled", "darl"):
            return True
        return self.policy_loss == "ppo" and (self.old_logprob == "proximal" or self.rollout_is is not None)

    @property
    def computes_proximal(self) -> bool:
        """Whether the learner recomputes pi_prox log-probs: when the loss or selection reads them,
        and for the losses that do not (naive async, synchronous PPO) when `recompute_proximal` asks,
        for the drift diagnostics alone (ESS, KL): the same figures in every cell."""
        return self.uses_proximal or (self.recompute_proximal and self.policy_loss == "ppo")

    @property
    def anchor(self) -> str:
        """D-ARL's clip anchor: `trust_anchor`, or when it is null "behavior" for policy_loss=darl
        and "proximal" for the other losses, the one value they accept (they do not read it: their
        ratio's denominator is `old_logprob`)."""
        if self.trust_anchor is not None:
            return self.trust_anchor
        return "behavior" if self.policy_loss == "darl" else "proximal"

    @property
    def effective_max_reuse(self) -> int:
        """How many times a group may be trained: 1 with replay off, else `max_reuse` or K."""
        if not self.replay:
            return 1
        return self.k if self.max_reuse is None else self.max_reuse

    @property
    def effective_warmup(self) -> int:
        """Steps of selection warmup: `warmup` with variance-guided selection, else 0. Warmup is
        part of selection; without it (baselines, the no-selection ablation) every step takes
        the oldest groups, or the skipped ones would be trained late, staler than eta allows."""
        return self.warmup if self.replay and self.sg else 0

    @property
    def effective_pmis_beta(self) -> str:
        """D-ARL's beta_k as the learner applies it: `pmis_beta`, or "tokens" (beta_k = N_k / N,
        one collapsed token mean) when `pmis` is false."""
        return self.pmis_beta if self.pmis else "tokens"

    def check(self) -> list[tuple[str, str]]:
        return self._loss_errors() + self._window_errors() + self._combination_errors()

    def _loss_errors(self) -> list[tuple[str, str]]:
        errors = []
        if self.policy_loss in ("decoupled", "darl") and self.old_logprob != "proximal":
            errors.append(("old_logprob", f"policy_loss={self.policy_loss} needs old_logprob=proximal"))
        if self.uses_proximal and not self.recompute_proximal:
            errors.append((
                "recompute_proximal",
                f"policy_loss={self.policy_loss} with old_logprob={self.old_logprob} reads proximal "
                "log-probs, so recompute_proximal must be true",
            ))
        if self.ppo_n_minibatches < 1:
            errors.append(("ppo_n_minibatches", "must be >= 1"))
        if self.rollout_is_threshold <= 0:
            errors.append(("rollout_is_threshold", "must be > 0"))
        if self.behav_clip is not None and self.behav_clip <= 1:
            errors.append(("behav_clip", f"must be > 1 (a ratio bound), got {self.behav_clip}"))
        if self.clip_low < 0 or self.clip_high < 0:
            errors.append(("clip_low", "clip_low and clip_high must be >= 0"))
        if self.policy_loss == "ppo" and self.old_logprob == "behavior" and self.rollout_is is not None:
            errors.append(("rollout_is", f"policy_loss=ppo with old_logprob=behavior already corrects for the "
                           f"behavior policy in its ratio exp(q - b); rollout_is={self.rollout_is} would apply the "
                           "importance weight twice: set rollout_is=null or old_logprob=proximal"))
        return errors + self._anchor_errors()

    def _anchor_errors(self) -> list[tuple[str, str]]:
        if self.anchor == "proximal":
            return []
        errors = []
        if self.policy_loss != "darl":
            errors.append(("trust_anchor", f"trust_anchor={self.trust_anchor} anchors D-ARL's per-version "
                           f"objective: it needs policy_loss=darl (got {self.policy_loss!r}); baselines keep "
                           "trust_anchor=proximal (naive async is policy_loss=ppo with old_logprob=behavior)"))
        if self.behav_clip is not None:
            dflt = " (policy_loss=darl's default)" if self.trust_anchor is None else ""
            which = f"trust_anchor={self.anchor}{dflt}"
            errors.append(("behav_clip", f"{which} clips the ratio against the behavior side already; behav_clip "
                           "(a mask on exp(p - b)) belongs to trust_anchor=proximal"))
        if self.anchor == "mixture" and (self.pmis_beta != "balance" or not self.pmis):
            errors.append(("trust_anchor", "trust_anchor=mixture clips against the balance mixture "
                           "sum_k alpha_k mu_k: it needs pmis=true and pmis_beta=balance"))
        return errors

    def _window_errors(self) -> list[tuple[str, str]]:
        errors = []
        if self.max_head_offpolicyness < 0:
            errors.append(("max_head_offpolicyness", "must be >= 0 (0 means synchronous)"))
        if self.k < 1:
            errors.append(("k", "must be >= 1"))
        if self.max_reuse is not None and self.max_reuse < 1:
            errors.append(("max_reuse", "must be >= 1 or null (null means k)"))
        if self.warmup < 0:
            errors.append(("warmup", "must be >= 0"))
        if not 0.0 < self.sg_quantile <= 1.0:
            errors.append(("sg_quantile", "must be in (0, 1]"))
        if self.sg_tau_abs is not None and self.sg_tau_abs <= 0:
            errors.append(("sg_tau_abs", "must be > 0 or null"))
        if self.sg_tau_floor < 0:
            errors.append(("sg_tau_floor", "must be >= 0 (0: tau is the quantile alone)"))
        return errors

    def _combination_errors(self) -> list[tuple[str, str]]:
        errors = []
        if self.pmis and self.policy_loss != "darl":
            errors.append(("pmis", f"the per-version objective needs policy_loss=darl (got {self.policy_loss!r}); "
                           "set pmis=false for baselines"))
        if self.pmis_beta == "balance":
            if not self.pmis or self.policy_loss != "darl":
                errors.append(("pmis_beta", "balance weighs D-ARL's per-version objective: it needs pmis=true and "
                               "policy_loss=darl"))
            if self.rollout_is is not None and self.rollout_is != "token":
                errors.append(("pmis_beta", f"balance weights are per token: it needs rollout_is=token or null "
                               f"(got {self.rollout_is!r})"))
        if self.sg and not self.replay:
            errors.append(("sg", "variance-guided selection needs replay=true"))
        if self.sg and not self.recompute_proximal:
            errors.append(("sg", "selection scores use proximal log-probs: set recompute_proximal=true or sg=false"))
        return errors

"""The `algo` section, every D-ARL knob in one place: OmegaConf compatibility, defaults and derived
values, and each bad value or combination refused with its key named."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from megatron_darl.algo.config import AlgoConfig

BASELINE = dict(replay=False, sg=False, pmis=False)  # what the baselines' recipes set besides the loss


def fields(errors):
    return [f for f, _ in errors]


def test_loads_as_an_omegaconf_structured_config_with_overrides():
    assert set(OmegaConf.structured(AlgoConfig).keys()) == {f.name for f in dataclasses.fields(AlgoConfig)}
    overrides = OmegaConf.from_dotlist(["k=8", "max_reuse=2", "sg_tau_abs=0.04", "max_head_offpolicyness=2"])
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AlgoConfig), overrides))
    assert isinstance(cfg, AlgoConfig)
    assert (cfg.k, cfg.max_reuse, cfg.sg_tau_abs, cfg.max_head_offpolicyness) == (8, 2, 0.04, 2)
    refused = r"Value 'four' of type 'str' could not be converted to Integer\s+full_key: k\n"
    with pytest.raises(ValidationError, match=refused):
        OmegaConf.merge(OmegaConf.structured(AlgoConfig), OmegaConf.from_dotlist(["k=four"]))


def test_defaults_are_d_arl_and_valid():
    cfg = AlgoConfig()
    assert cfg.check() == []
    assert (cfg.policy_loss, cfg.replay, cfg.k, cfg.sg, cfg.sg_quantile, cfg.warmup, cfg.pmis, cfg.pmis_beta,
            cfg.max_head_offpolicyness) == ("darl", True, 4, True, 0.9, 5, True, "ess", 4)


def test_derived_values():
    assert AlgoConfig().effective_max_reuse == 4
    assert AlgoConfig(k=8, max_reuse=2).effective_max_reuse == 2
    assert AlgoConfig(replay=False, k=8, sg=False).effective_max_reuse == 1
    assert AlgoConfig(warmup=3).effective_warmup == 3
    assert AlgoConfig(sg=False, warmup=3).effective_warmup == 0  # warmup is part of selection
    assert AlgoConfig(pmis_beta="balance").effective_pmis_beta == "balance"
    assert AlgoConfig(pmis=False, pmis_beta="ess", policy_loss="darl").effective_pmis_beta == "tokens"


def test_window_and_selection_values_are_refused_by_name():
    bad = AlgoConfig(k=0, max_reuse=0, sg_quantile=0.0, sg_tau_abs=-1.0, warmup=-1, sg_tau_floor=-0.1,
                     max_head_offpolicyness=-1)
    assert fields(bad.check()) == ["max_head_offpolicyness", "k", "max_reuse", "warmup", "sg_quantile",
                                   "sg_tau_abs", "sg_tau_floor"]
    assert AlgoConfig._choices["sg_fill"] == ("fresh", "none")
    assert AlgoConfig._choices["pmis_beta"] == ("ess", "tokens", "balance")
    assert AlgoConfig._choices["balance_snapshots"] == ("exact", "interpolate", "auto")


def test_darl_without_proximal_recompute_names_both_keys():
    errors = AlgoConfig(policy_loss="darl", old_logprob="proximal", recompute_proximal=False, sg=False).check()
    assert fields(errors) == ["recompute_proximal"]
    msg = dict(errors)["recompute_proximal"]
    assert "policy_loss=darl" in msg and "old_logprob=proximal" in msg


def test_decoupled_needs_proximal_old_logprob():
    assert "old_logprob" in fields(AlgoConfig(policy_loss="decoupled", old_logprob="behavior", **BASELINE).check())


def test_naive_async_needs_no_recompute():
    cfg = AlgoConfig(policy_loss="ppo", old_logprob="behavior", recompute_proximal=False, **BASELINE)
    assert cfg.check() == [] and not cfg.uses_proximal
    assert AlgoConfig(policy_loss="ppo", old_logprob="behavior", rollout_is="token").uses_proximal
    assert not AlgoConfig(policy_loss="sg_weight", old_logprob="behavior").uses_proximal


def test_loss_values_are_refused_by_name():
    assert "ppo_n_minibatches" in fields(AlgoConfig(ppo_n_minibatches=0).check())
    assert "behav_clip" in fields(AlgoConfig(behav_clip=0.5).check())
    assert set(AlgoConfig._choices["policy_loss"]) == {"ppo", "decoupled", "darl", "sg_weight"}


def test_combinations_of_the_four_parts_are_refused_by_name():
    """The per-version objective is D-ARL's loss; selection needs replay and proximal log-probs;
    balance weights need the per-version objective and token-level weights."""
    assert fields(AlgoConfig(policy_loss="ppo", sg=False, replay=False).check()) == ["pmis"]
    assert fields(AlgoConfig(replay=False).check()) == ["sg"]
    assert fields(AlgoConfig(policy_loss="ppo", old_logprob="behavior", recompute_proximal=False, pmis=False,
                             replay=True).check()) == ["sg"]
    assert fields(AlgoConfig(pmis_beta="balance", pmis=False).check()) == ["pmis_beta"]
    assert fields(AlgoConfig(pmis_beta="balance", rollout_is="sequence").check()) == ["pmis_beta"]
    assert AlgoConfig(pmis_beta="balance", rollout_is="token").check() == []


def test_ppo_on_behavior_with_rollout_weights_is_refused_naming_the_keys():
    """The ratio exp(q - b) already corrects from mu to pi_theta: a rollout IS weight exp(p - b)
    on top of it applies the importance weight twice."""
    errors = AlgoConfig(policy_loss="ppo", old_logprob="behavior", rollout_is="token", **BASELINE).check()
    assert fields(errors) == ["rollout_is"]
    msg = dict(errors)["rollout_is"]
    assert "policy_loss=ppo" in msg and "old_logprob=behavior" in msg and "twice" in msg
    assert AlgoConfig(policy_loss="ppo", old_logprob="proximal", rollout_is="token", **BASELINE).check() == []
    assert AlgoConfig(policy_loss="ppo", old_logprob="behavior", **BASELINE).check() == []
    from megatron_darl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"algo\.rollout_is.*old_logprob=behavior"):
        load_config(None, ["model.hf_dir=/m", "algo.policy_loss=ppo", "algo.old_logprob=behavior",
                           "algo.rollout_is=sequence", "algo.replay=false", "algo.sg=false", "algo.pmis=false"])


def test_trust_anchor_is_d_arl_s_and_mixture_needs_the_balance_mixture():
    assert AlgoConfig(trust_anchor="behavior").check() == []
    assert AlgoConfig(trust_anchor="mixture", pmis_beta="balance").check() == []
    assert fields(AlgoConfig(trust_anchor="mixture").check()) == ["trust_anchor"]
    assert "pmis_beta=balance" in dict(AlgoConfig(trust_anchor="mixture").check())["trust_anchor"]
    off = AlgoConfig(policy_loss="decoupled", trust_anchor="behavior", **BASELINE).check()
    assert fields(off) == ["trust_anchor"] and "policy_loss=darl" in dict(off)["trust_anchor"]
    assert fields(AlgoConfig(trust_anchor="behavior", behav_clip=5.0).check()) == ["behav_clip"]
    assert AlgoConfig._choices["trust_anchor"] == ("proximal", "behavior", "mixture")


def test_d_arl_anchors_at_the_behavior_policy_unless_told_and_baselines_keep_theirs():
    assert AlgoConfig().trust_anchor is None and AlgoConfig().anchor == "behavior"
    for loss, extra in (("ppo", dict(old_logprob="behavior")), ("decoupled", {}), ("sg_weight", {})):
        cfg = AlgoConfig(policy_loss=loss, **extra, **BASELINE)
        assert cfg.anchor == "proximal" and cfg.check() == []
    assert AlgoConfig(trust_anchor="proximal").anchor == "proximal"
    # behav_clip belongs to the proximal anchor: refused under the default, named as the default
    errors = dict(AlgoConfig(behav_clip=5.0).check())
    assert list(errors) == ["behav_clip"]
    assert "trust_anchor=behavior (policy_loss=darl's default)" in errors["behav_clip"]
    assert AlgoConfig(trust_anchor="proximal", behav_clip=5.0).check() == []
    from megatron_darl.config import load_config

    assert load_config(None, ["model.hf_dir=/m"]).algo.anchor == "behavior"
    assert load_config(None, ["model.hf_dir=/m", "algo.trust_anchor=proximal"]).algo.anchor == "proximal"


def test_selection_fills_the_batch_with_never_trained_groups_first_by_default():
    assert AlgoConfig().sg_new_first is True


def test_naive_async_recomputes_proximal_log_probs_only_for_diagnostics_when_asked():
    naive = AlgoConfig(policy_loss="ppo", old_logprob="behavior", **BASELINE)
    assert naive.computes_proximal and not naive.uses_proximal
    assert not dataclasses.replace(naive, recompute_proximal=False).computes_proximal
    assert not AlgoConfig(policy_loss="sg_weight", old_logprob="behavior", **BASELINE).computes_proximal
    assert AlgoConfig().computes_proximal

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

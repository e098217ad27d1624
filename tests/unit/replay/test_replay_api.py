"""Replay configs: OmegaConf compatibility, validation messages, derived values."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from megatron_darl.replay.api import ReplayConfig, StalenessConfig


def test_configs_load_as_omegaconf_structured_with_overrides():
    for cls in (ReplayConfig, StalenessConfig):
        base = OmegaConf.structured(cls)
        assert set(base.keys()) == {f.name for f in dataclasses.fields(cls)}
    overrides = OmegaConf.from_dotlist(["k=8", "max_reuse=2", "sg_tau_abs=0.04"])
    merged = OmegaConf.merge(OmegaConf.structured(ReplayConfig), overrides)
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, ReplayConfig) and (cfg.k, cfg.max_reuse, cfg.sg_tau_abs) == (8, 2, 0.04)
    with pytest.raises(Exception, match="k"):
        OmegaConf.merge(OmegaConf.structured(ReplayConfig), OmegaConf.from_dotlist(["k=four"]))


def test_defaults_and_effective_max_reuse():
    cfg = ReplayConfig()
    assert (cfg.enable, cfg.k, cfg.sg, cfg.sg_quantile, cfg.warmup, cfg.pmis_beta) == (True, 4, True, 0.9, 5, "ess")
    assert cfg.effective_max_reuse == 4
    assert ReplayConfig(k=8, max_reuse=2).effective_max_reuse == 2
    assert ReplayConfig(enable=False, k=8).effective_max_reuse == 1
    assert ReplayConfig(ring_checksum=True).effective_ring_checksum
    assert not ReplayConfig(ring_checksum=False).effective_ring_checksum
    assert StalenessConfig().max_head_offpolicyness == 4


def test_check_names_each_bad_field():
    bad = ReplayConfig(k=0, max_reuse=0, sg_quantile=0.0, sg_tau_abs=-1.0, warmup=-1, ring_bytes=10, ring_name="a/b")
    fields = [f for f, _ in bad.check()]
    assert fields == ["k", "max_reuse", "sg_quantile", "sg_tau_abs", "warmup", "ring_bytes", "ring_name"]
    assert ReplayConfig().check() == [] and StalenessConfig().check() == []
    assert StalenessConfig(max_head_offpolicyness=-1).check()[0][0] == "max_head_offpolicyness"
    assert ReplayConfig._choices == {"sg_fill": ("fresh", "none"), "pmis_beta": ("ess", "tokens", "balance"),
                                     "balance_snapshots": ("exact", "interpolate", "auto")}

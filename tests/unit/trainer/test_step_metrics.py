"""One source for each logged figure: the behavior-weight statistics of a step describe the
weights its loss used (AReaL's cap 5, verl's truncation at 2, the balance heuristic), and the
loop's own diagnostics never overwrite them."""

import numpy as np
import pytest

from megatron_darl.algo.config import AlgoConfig
from megatron_darl.learner.train_step import minibatch_constants, weight_diagnostics
from megatron_darl.trainer.loop import step_diagnostics
from megatron_darl.types import TrainBatch

WEIGHT_KEYS = ("algo/is/", "algo/ess_frac", "algo/tokens_frac", "algo/kl_", "algo/beta/")


def _batch() -> TrainBatch:
    """Two versions; log weights spread over [-1.5, 2.2] so some exceed 2 and some exceed 5."""
    rng = np.random.default_rng(11)
    b, width, prompt = 12, 10, 2
    versions = np.repeat([3, 4], b // 2)
    mask = np.zeros((b, width), np.float32)
    mask[:, prompt:] = 1.0
    behav = np.where(mask > 0, -2.0 - rng.random((b, width)), 0.0).astype(np.float32)
    log_w = rng.uniform(-1.5, 2.2, size=(b, width)) * (1.0 + (versions[:, None] == 3))
    prox = np.where(mask > 0, behav + log_w, 0.0).astype(np.float32)
    return TrainBatch(tokens=rng.integers(0, 30, (b, width)), lengths=np.full(b, width), loss_mask=mask,
                      advantages=rng.normal(size=b).astype(np.float32), behav_logprobs=behav,
                      token_versions=np.where(mask > 0, versions[:, None], -1), versions=versions,
                      group_index=np.repeat(np.arange(b // 2), 2), rewards=rng.random(b).astype(np.float32),
                      prompt_ids=np.arange(b), prox_logprobs=prox)


def _stats(a: AlgoConfig, batch: TrainBatch, pmis: str = "ess", prox_version=None) -> dict:
    whole, metrics = minibatch_constants(a, batch, np.arange(batch.batch_size), None, pmis, prox_version)
    return {**weight_diagnostics(a, batch, whole), **metrics}  # as train_step merges them


def _ess_frac(w: np.ndarray) -> float:
    return float(w.sum() ** 2 / (w ** 2).sum() / w.size)


def test_areal_cap_five_logs_the_capped_weights_it_used():
    batch = _batch()
    m = batch.loss_mask > 0
    w = np.exp(batch.prox_logprobs.astype(np.float64) - batch.behav_logprobs)[m]
    assert (w > 5).any() and ((w > 2) & (w <= 5)).any()
    used = np.where(w > 5, 0.0, w)  # AReaL: tokens above the cap get weight 0
    out = _stats(AlgoConfig(policy_loss="decoupled", behav_weight_cap=5.0), batch)
    assert out["algo/is/frac_capped"] == pytest.approx(float((w > 5).mean()))
    assert out["algo/is/max"] == pytest.approx(float(used.max()), rel=1e-5) and out["algo/is/max"] > 2
    assert out["algo/ess_frac"] == pytest.approx(_ess_frac(used), rel=1e-5)
    assert not any(k.startswith("algo/is/frac_truncated") or k.startswith("algo/is/frac_vetoed") for k in out)
    # verl's token IS truncated at 2 is another loss, with other figures
    verl = _stats(AlgoConfig(policy_loss="ppo", old_logprob="proximal", rollout_is="token",
                                  rollout_is_veto_threshold=None), batch)
    assert verl["algo/is/max"] == pytest.approx(2.0) and "algo/is/frac_capped" not in verl
    assert verl["algo/ess_frac"] == pytest.approx(_ess_frac(np.minimum(w, 2.0)), rel=1e-5)


def test_balance_logs_the_ess_of_the_balance_weights():
    batch = _batch()
    a = AlgoConfig(policy_loss="darl", rollout_is="token", rollout_is_threshold=1e6,
                        rollout_is_veto_threshold=None)
    out = _stats(a, batch, "balance", prox_version=5)
    # naive reference: the mixture of the two versions' (interpolated) log mu_k, alpha_k = N_k / N
    m = batch.loss_mask > 0
    p, b = batch.prox_logprobs.astype(np.float64), batch.behav_logprobs.astype(np.float64)
    v = batch.versions[:, None]
    mu = {k: np.exp(np.where(v == k, b, b + (k - v) / (5 - v) * (p - b))) for k in (3, 4)}
    mix = 0.5 * mu[3] + 0.5 * mu[4]
    w = (np.exp(p) / mix)[m]
    assert out["algo/ess_frac"] == pytest.approx(_ess_frac(w), rel=1e-4)
    assert out["algo/is/p99"] == pytest.approx(float(np.sort(w)[int(np.ceil(0.99 * w.size)) - 1]), rel=1e-4)
    plain = _stats(AlgoConfig(policy_loss="darl", rollout_is="token"), batch, "ess")
    assert abs(plain["algo/ess_frac"] - out["algo/ess_frac"]) > 1e-3  # another figure: the check can fail


def test_baselines_without_behavior_weights_log_drift_and_the_ess_of_the_weights_they_skip():
    """Naive async and synchronous PPO apply no weight: they log KL and the ESS of exp(p - b), the
    weight a correction would apply, so ESS compares across every cell; no `algo/is/*`."""
    batch = _batch()
    m = batch.loss_mask > 0
    l_tok = batch.prox_logprobs.astype(np.float64) - batch.behav_logprobs
    for cell in (AlgoConfig(policy_loss="ppo", old_logprob="proximal"),
                 AlgoConfig(policy_loss="ppo", old_logprob="behavior", pmis=False)):
        out = _stats(cell, batch)
        assert out["algo/ess_frac"] == pytest.approx(_ess_frac(np.exp(l_tok[m])), rel=1e-5)
        v3 = m & (batch.versions[:, None] == 3)
        assert out["algo/ess_frac/v3"] == pytest.approx(_ess_frac(np.exp(l_tok[v3])), rel=1e-5)
        assert out["algo/kl_k3"] == pytest.approx(float(np.mean(np.exp(l_tok[m]) - 1 - l_tok[m])), rel=1e-5)
        assert out["algo/kl_k3/v3"] == pytest.approx(float(np.mean(np.exp(l_tok[v3]) - 1 - l_tok[v3])), rel=1e-5)
        assert out["algo/tokens_frac/v3"] == 0.5
        assert not any(k.startswith("algo/is/") for k in out)
    batch.prox_logprobs = None  # naive async that asked for no recompute: no proximal policy at all
    assert _stats(AlgoConfig(policy_loss="ppo", old_logprob="behavior", recompute_proximal=False), batch) == {}


def test_the_loop_diagnostics_describe_the_data_only():
    batch = _batch()
    out = step_diagnostics(batch, step=5)
    assert not any(k.startswith(WEIGHT_KEYS) for k in out)
    assert out["algo/staleness/batch/1"] == 0.5 and out["algo/staleness/batch/2"] == 0.5
    assert out["rollout/reward_mean/v3"] == pytest.approx(float(batch.rewards[:6].mean()))


def test_mismatch_is_measured_where_the_learner_has_the_tokens_version():
    """`algo/mismatch_*` compare b with the learner's log-prob at the token's own version: the
    proximal one (version 4 here) and kept snapshots (version 3), never a later version's p."""
    batch = _batch()
    m, v4 = batch.loss_mask > 0, (batch.token_versions == 4)
    a = AlgoConfig(policy_loss="ppo", old_logprob="proximal", clip_high=0.28)
    d = (batch.prox_logprobs.astype(np.float64) - batch.behav_logprobs)[m & v4]
    out = weight_diagnostics(a, batch, {}, prox_version=4)
    assert out["algo/mismatch_tokens_frac"] == pytest.approx(0.5)
    assert out["algo/mismatch_abs_mean"] == pytest.approx(float(np.abs(d).mean()), rel=1e-6)
    assert out["algo/mismatch_kl"] == pytest.approx(float((np.expm1(d) - d).mean()), rel=1e-5)
    r = np.exp(d)
    assert out["algo/mismatch_clip_frac"] == pytest.approx(float(((r < 0.8) | (r > 1.28)).mean()))
    snap = batch.behav_logprobs + np.float32(1e-3) * (batch.token_versions == 3)
    batch.behav_logprobs_by_version = {3: snap}  # a kept snapshot of version 3: all tokens at hand
    both = weight_diagnostics(a, batch, {}, prox_version=4)
    assert both["algo/mismatch_tokens_frac"] == 1.0
    assert both["algo/mismatch_abs_mean"] == pytest.approx((np.abs(d).sum() + 1e-3 * d.size) / m.sum(), rel=1e-4)
    assert weight_diagnostics(a, _batch(), {})["algo/mismatch_tokens_frac"] == 0.0  # no version at hand

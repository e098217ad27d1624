"""Balance heuristic per token: the later tokens of an interrupted rollout were sampled by a
newer version; their own version uses b, sets the interpolation gap and counts in alpha_k."""

import numpy as np
import pytest
import torch

from megatron_darl import algo
from megatron_darl.algo.config import AlgoConfig
from megatron_darl.learner.packing import micro_batch
from megatron_darl.learner.train_step import minibatch_constants, minibatch_share, policy_loss
from megatron_darl.types import TrainBatch

PROX_VERSION = 6


def _batch() -> TrainBatch:
    """8 rows; rows 0-3 began under version 3 and were interrupted: from token 4 on, version 5
    generated them (their sequence version stays 3). Rows 4-7 are version 4 throughout."""
    rng = np.random.default_rng(5)
    b, width, prompt = 8, 12, 2
    mask = np.zeros((b, width), np.float32)
    mask[:, prompt:] = 1.0
    tv = np.where(mask > 0, 4, -1)
    tv[:4, prompt:] = 3
    tv[:4, prompt + 4:] = 5
    behav = np.where(mask > 0, -2.0 - rng.random((b, width)), 0.0).astype(np.float32)
    prox = np.where(mask > 0, behav + 0.4 * rng.normal(size=(b, width)), 0.0).astype(np.float32)
    return TrainBatch(tokens=rng.integers(0, 30, (b, width)), lengths=np.full(b, width), loss_mask=mask,
                      advantages=rng.normal(size=b).astype(np.float32), behav_logprobs=behav,
                      token_versions=tv.astype(np.int64), versions=np.array([3] * 4 + [4] * 4, np.int64),
                      group_index=np.repeat(np.arange(4), 2), rewards=np.zeros(b, np.float32),
                      prompt_ids=np.arange(b), prox_logprobs=prox)


def _reference_loss(batch: TrainBatch, logp: np.ndarray) -> float:
    """-(1/N) sum m rho min(r A, clip(r) A), rho = p / sum_k alpha_k mu_k per token (beta = N_k/N
    for balance), log mu_k interpolated from each TOKEN's version, alpha_k by token counts."""
    m = batch.loss_mask > 0
    p, b = batch.prox_logprobs.astype(np.float64), batch.behav_logprobs.astype(np.float64)
    tv = batch.token_versions
    ks = sorted(set(tv[m].tolist()))
    alpha = {k: float((tv[m] == k).sum()) / m.sum() for k in ks}
    mix = np.zeros_like(p)
    for k in ks:
        gap = PROX_VERSION - tv
        log_mu = np.where(tv == k, b, b + (k - tv) / np.where(gap > 0, gap, 1) * (p - b))
        mix += alpha[k] * np.exp(log_mu)
    rho = np.exp(p) / mix
    r = np.exp(logp - p)
    adv = batch.advantages[:, None]
    obj = np.where(m, rho * np.minimum(r * adv, np.clip(r, 0.8, 1.2) * adv), 0.0)
    return float(-obj.sum() / m.sum())


def test_balance_uses_each_tokens_own_version():
    batch = _batch()
    logp = batch.prox_logprobs + 0.05 * np.random.default_rng(1).normal(size=batch.tokens.shape)
    a = AlgoConfig(policy_loss="darl", trust_anchor="proximal", rollout_is="token", rollout_is_threshold=1e6,
                        rollout_is_veto_threshold=None, ppo_n_minibatches=1)
    rows = np.arange(batch.batch_size)
    whole, metrics = minibatch_constants(a, batch, rows, None, "balance", prox_version=PROX_VERSION)
    assert sorted(whole["needed"]) == [3, 4, 5] and whole["mix"][5] == 4 * 6
    mb = micro_batch(batch, rows, torch.device("cpu"))
    lp = torch.tensor(logp, dtype=torch.float32)
    got = float(policy_loss(a, minibatch_share(whole, batch, rows), mb, lp, torch.ones_like(lp))[0])
    assert got == pytest.approx(_reference_loss(batch, logp), rel=1e-4)
    # per sequence instead (every token of rows 0-3 read as version 3): another loss
    flat = _batch()
    flat.token_versions = np.where(flat.loss_mask > 0, flat.versions[:, None], -1)
    assert abs(_reference_loss(flat, logp) - got) > 1e-3


def test_algo_counts_and_interpolates_per_token():
    batch = _batch()
    mask = torch.as_tensor(batch.loss_mask) > 0
    tv = torch.as_tensor(batch.token_versions)
    assert algo.version_token_counts(tv, mask) == {3: 16.0, 4: 40.0, 5: 24.0}
    assert algo.version_token_counts(torch.as_tensor(batch.versions), mask) == {3: 40.0, 4: 40.0}
    p, b = torch.as_tensor(batch.prox_logprobs), torch.as_tensor(batch.behav_logprobs)
    out = algo.interpolate_version_logp(p, b, tv, PROX_VERSION, [5])
    late = mask & (tv == 5)
    assert torch.equal(out[5][late], b[late])  # a token's own version is its b, exactly
    early = mask & (tv == 3)
    torch.testing.assert_close(out[5][early], (b + 2 / 3 * (p - b))[early])

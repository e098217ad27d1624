"""Several optimizer updates per step: a random, seeded partition of the selected batch into
minibatches that each hold a mix of versions, and per-version weights of the WHOLE batch."""

import numpy as np
import pytest
import torch

from megatron_darl.algo.config import AlgoConfig
from megatron_darl.learner.packing import micro_batch, split_minibatches
from megatron_darl.learner.train_step import minibatch_constants, minibatch_share, policy_loss
from megatron_darl.types import TrainBatch

CPU = torch.device("cpu")
G, GROUPS = 4, 16  # 16 groups of 4: 8 of version 5 then 8 of version 4, as selection orders them


def _selected_batch(seed: int = 0) -> TrainBatch:
    """A batch in selection order (ascending score, freshest first): every version-5 group
    before every version-4 group; the stale version drifted more."""
    rng = np.random.default_rng(seed)
    b, width, prompt = GROUPS * G, 12, 3
    versions = np.repeat(np.where(np.arange(GROUPS) < GROUPS // 2, 5, 4), G)
    lengths = rng.integers(prompt + 2, width + 1, size=b)
    mask = ((np.arange(width)[None] >= prompt) & (np.arange(width)[None] < lengths[:, None])).astype(np.float32)
    behav = np.where(mask > 0, -1.0 - rng.random((b, width)), 0.0).astype(np.float32)
    drift = np.where(versions == 5, 0.1, 0.6)[:, None]
    prox = (behav + drift * rng.normal(size=(b, width)) * mask).astype(np.float32)
    return TrainBatch(tokens=rng.integers(0, 50, (b, width)), lengths=lengths.astype(np.int64), loss_mask=mask,
                      advantages=rng.normal(size=b).astype(np.float32), behav_logprobs=behav,
                      token_versions=np.where(mask > 0, versions[:, None], -1).astype(np.int64),
                      versions=versions.astype(np.int64), group_index=np.repeat(np.arange(GROUPS), G),
                      rewards=np.zeros(b, np.float32), prompt_ids=np.arange(b), prox_logprobs=prox)


def _ess_beta(batch: TrainBatch, rows: np.ndarray, cap: float = 2.0) -> dict[int, float]:
    """Naive reference: beta_k proportional to (sum rho)^2 / sum rho^2 over version k's tokens."""
    ess = {}
    for k in np.unique(batch.versions[rows]):
        r = rows[batch.versions[rows] == k]
        m = batch.loss_mask[r] > 0
        rho = np.minimum(np.exp(batch.prox_logprobs[r][m].astype(np.float64) - batch.behav_logprobs[r][m]), cap)
        ess[int(k)] = rho.sum() ** 2 / (rho ** 2).sum()
    total = sum(ess.values())
    return {k: v / total for k, v in ess.items()}


def test_minibatches_are_a_seeded_random_partition_of_whole_groups():
    batch = _selected_batch()
    gi = batch.group_index
    seen_last = []
    for step in range(20):
        parts = split_minibatches(gi, 2, (1234, step))
        again = split_minibatches(gi, 2, (1234, step))  # what every rank computes
        assert [p.tolist() for p in parts] == [p.tolist() for p in again]
        assert sorted(np.concatenate(parts).tolist()) == list(range(len(gi)))
        assert [len(set(gi[p].tolist())) for p in parts] == [GROUPS // 2] * 2  # balanced, groups whole
        for p in parts:
            for g in set(gi[p].tolist()):
                assert set(np.flatnonzero(gi == g)) <= set(p.tolist())
        assert all(len(set(batch.versions[p].tolist())) == 2 for p in parts), (step, parts)
        seen_last.append(float(batch.versions[parts[-1]].mean()))
    # the last update is not always on the stalest groups (contiguous slices gave 4.0 every step)
    assert 4.3 < np.mean(seen_last) < 4.7
    assert len({tuple(split_minibatches(gi, 2, (1234, s))[0].tolist()) for s in range(5)}) > 1


def test_beta_and_counts_are_whole_batch_constants_in_every_minibatch():
    batch = _selected_batch()
    a = AlgoConfig(policy_loss="darl", trust_anchor="proximal", rollout_is="token", ppo_n_minibatches=2)
    everything = np.arange(batch.batch_size)
    whole, metrics = minibatch_constants(a, batch, everything, None, "ess")
    want = _ess_beta(batch, everything)
    assert whole["beta"] == pytest.approx(want, rel=1e-5)
    assert 0.2 < want[4] < 0.8  # both versions weigh: a per-minibatch beta of one version would be 1.0
    assert metrics["algo/beta/v4"] == pytest.approx(want[4], rel=1e-5)
    n = batch.loss_mask.sum()
    for rows in split_minibatches(batch.group_index, 2, (1234, 3)):
        consts = minibatch_share(whole, batch, rows)
        n_mb = batch.loss_mask[rows].sum()
        assert consts["beta"] == whole["beta"] and consts["den"] == n_mb
        for k, n_k in whole["counts"].items():
            assert consts["counts"][k] == pytest.approx(n_k * n_mb / n)


def _minibatch_loss(a, consts, batch, rows, logp):
    mb = micro_batch(batch, rows, CPU)
    lp = logp[torch.as_tensor(rows), : mb["tokens"].shape[1]]
    return float(policy_loss(a, consts, mb, lp, torch.ones_like(lp))[0])


def test_a_minibatch_of_beta_tokens_is_its_token_mean_and_ess_is_the_whole_batch_estimator():
    batch = _selected_batch(1)
    logp = torch.tensor(batch.prox_logprobs + 0.05 * np.random.default_rng(2).normal(size=batch.tokens.shape),
                        dtype=torch.float32)
    darl = AlgoConfig(policy_loss="darl", trust_anchor="proximal", rollout_is="token", ppo_n_minibatches=2)
    verl = AlgoConfig(policy_loss="ppo", old_logprob="proximal", rollout_is="token", ppo_n_minibatches=2)
    everything = np.arange(batch.batch_size)
    tok, _ = minibatch_constants(darl, batch, everything, None, "tokens")
    ess, _ = minibatch_constants(darl, batch, everything, None, "ess")
    ppo, _ = minibatch_constants(verl, batch, everything, None)
    for rows in split_minibatches(batch.group_index, 2, (7, 0)):
        want = _minibatch_loss(verl, minibatch_share(ppo, batch, rows), batch, rows, logp)
        got = _minibatch_loss(darl, minibatch_share(tok, batch, rows), batch, rows, logp)
        assert got == pytest.approx(want, rel=1e-5)
        # ess: -sum_k beta_k * N / (N_k * N_mb) * sum over the minibatch's version-k tokens
        m = batch.loss_mask[rows] > 0
        rho = np.minimum(np.exp(batch.prox_logprobs[rows] - batch.behav_logprobs[rows]), 2.0)
        r = np.exp(logp.numpy()[rows] - batch.prox_logprobs[rows])
        adv = batch.advantages[rows][:, None]
        obj = np.where(m, rho * np.minimum(r * adv, np.clip(r, 0.8, 1.2) * adv), 0.0)
        n, n_mb = batch.loss_mask.sum(), m.sum()
        ref = -sum(ess["beta"][k] * n / (ess["counts"][k] * n_mb) * obj[batch.versions[rows] == k].sum()
                   for k in (4, 5))
        assert _minibatch_loss(darl, minibatch_share(ess, batch, rows), batch, rows, logp) == \
            pytest.approx(ref, rel=1e-4)

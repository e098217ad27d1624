"""Candidate batches, advantages per group, D-ARL gating and group subsets."""

import numpy as np

from megatron_darl.algo.config import AlgoConfig
from megatron_darl.trainer.batching import candidate_batch, choose_groups, group_advantages, take_groups
from megatron_darl.trainer.replay_store import Candidates, ReplayGroup
from megatron_darl.types import Trajectory


def _group(gid, version, rng, g=4):
    trajs = []
    for i in range(g):
        n = int(rng.integers(1, 6))
        trajs.append(Trajectory(rng.integers(0, 50, 3), rng.integers(0, 50, n), rng.normal(size=n) - 2,
                                np.full(n, version), float(rng.integers(0, 2)), gid * 10 + i, gid))
    return ReplayGroup(gid, version, trajs)


def _cands(versions, seed=0):
    rng = np.random.default_rng(seed)
    return Candidates(step=max(versions) + 1, groups=[_group(100 + i, v, rng) for i, v in enumerate(versions)])


def test_candidate_batch_advantages_are_per_group():
    cands = _cands([0, 0, 1])
    b = candidate_batch(cands, AlgoConfig())
    assert b.batch_size == 12 and b.group_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    for g in range(3):
        r = b.rewards[b.group_index == g]
        expect = (r - r.mean()) / (r.std() + 1e-6)
        np.testing.assert_allclose(b.advantages[b.group_index == g], expect, rtol=1e-5, atol=1e-6)
    dr = group_advantages(b.rewards, b.group_index, AlgoConfig(advantage="drgrpo"))
    np.testing.assert_allclose(dr[:4], b.rewards[:4] - b.rewards[:4].mean(), atol=1e-6)


def test_take_groups_cuts_whole_groups_in_chosen_order():
    cands = _cands([0, 1, 1, 2])
    b = candidate_batch(cands, AlgoConfig())
    b.prox_logprobs = b.behav_logprobs + 0.1 * b.loss_mask
    sub = take_groups(b, np.array([2, 0]))
    assert sub.batch_size == 8 and sub.group_index.tolist() == [0] * 4 + [1] * 4
    assert set(sub.prompt_ids[:4]) == {t.prompt_id for t in cands.groups[2].trajectories}
    rows = np.flatnonzero(b.group_index == 2)
    np.testing.assert_array_equal(sub.tokens[:4], b.tokens[rows][:, : sub.tokens.shape[1]])
    assert sub.tokens.shape[1] == sub.lengths.max()  # trimmed to the longest kept sequence
    np.testing.assert_allclose(sub.prox_logprobs - sub.behav_logprobs, 0.1 * sub.loss_mask, atol=1e-6)
    assert sub.behav_logprobs_by_version is None
    b.behav_logprobs_by_version = {0: b.behav_logprobs + 1.0, 1: b.behav_logprobs + 2.0}
    sub = take_groups(b, np.array([2, 0]))
    assert sorted(sub.behav_logprobs_by_version) == [0, 1]
    for k, lp in sub.behav_logprobs_by_version.items():
        assert lp.shape == sub.behav_logprobs.shape
        np.testing.assert_allclose(lp - sub.behav_logprobs, k + 1.0, atol=1e-6)


def test_choose_groups_drops_the_drifted_stale_group():
    cands = _cands([0, 0, 1, 1, 1])
    b = candidate_batch(cands, AlgoConfig())
    drift = np.zeros(5)
    drift[0] = 3.0  # stale group 0 no longer matches the current policy
    b.prox_logprobs = b.behav_logprobs + drift[b.group_index][:, None] * b.loss_mask + \
        0.01 * np.arange(5)[b.group_index][:, None] * b.loss_mask
    rc = AlgoConfig(sg=True, sg_quantile=1.0, warmup=0, sg_new_first=False)  # every group ranked by score
    chosen, m = choose_groups(b, cands, 3, rc, step=5)
    assert 0 not in chosen.tolist() and len(chosen) == 3
    assert m["algo/select/filtered_frac/v0"] > 0
    # selection off: FIFO, oldest first
    chosen_fifo, _ = choose_groups(b, cands, 3, AlgoConfig(sg=False), step=5)
    assert chosen_fifo.tolist() == [0, 1, 2]


def test_choose_groups_warmup_trains_a_full_batch():
    """In warmup the store offers never-trained groups only, of several versions (the gate lets
    eta of them exist); the step trains a full batch of them, oldest first, not the newest
    version alone (which trained 64, 64, 30, 30, 17 of 64 groups in a demo run)."""
    cands = _cands([0, 1, 2, 2, 2])
    b = candidate_batch(cands, AlgoConfig())
    b.prox_logprobs = b.behav_logprobs.copy()
    chosen, m = choose_groups(b, cands, 4, AlgoConfig(sg=True, warmup=5), step=1)
    assert chosen.tolist() == [0, 1, 2, 3] and m["algo/select/n_groups"] == 4


def test_threshold_floor_admits_stale_groups_that_still_match():
    """Where engine and learner agree (the CPU demo), the freshest groups score ~1e-13 and their
    quantile alone admits no stale group; the floor `algo.sg_tau_floor` admits the stale ones
    whose weights still match, in ascending score, and gates out the drifted one."""
    cands = _cands([0, 0, 0, 1, 2, 2])
    for g in cands.groups[:3]:
        g.reuse = 1
    b = candidate_batch(cands, AlgoConfig())
    drift = np.array([0.05, 3.0, 0.02, 0.01, 1e-7, 2e-7])[b.group_index][:, None]  # group 1 drifted
    b.prox_logprobs = (b.behav_logprobs + drift * b.loss_mask).astype(np.float64)
    ranked = dict(sg=True, warmup=0, sg_fill="none", sg_new_first=False)  # every group ranked by score
    chosen, m = choose_groups(b, cands, 5, AlgoConfig(**ranked), step=3)
    assert chosen.tolist() == [4, 5, 3, 2, 0]
    assert m["algo/select/reused_admitted"] == 2 and m["algo/select/admitted_frac"] == 5 / 6
    assert m["algo/select/tau"] == 0.01 and m["algo/select/tau_quantile"] < 1e-12
    assert m["algo/select/filtered_groups"] == 1  # the drifted group 1
    off, m_off = choose_groups(b, cands, 5, AlgoConfig(**ranked, sg_tau_floor=0.0), step=3)
    assert off.tolist() == [4]  # the quantile alone (q = 0.9 of 1e-14, 4e-14): no stale group
    assert m_off["algo/select/filtered_groups"] == 5
    # never-trained first (the default): groups 3, 4, 5 in pool order, then the admitted reused ones
    new_first, m_new = choose_groups(b, cands, 5, AlgoConfig(sg=True, warmup=0, sg_fill="none"), step=3)
    assert new_first.tolist() == [3, 4, 5, 2, 0] and m_new["algo/select/filtered_groups"] == 1
    gated, _ = choose_groups(b, cands, 5, AlgoConfig(sg=True, warmup=0, sg_fill="none", sg_tau_floor=0.0), step=3)
    assert gated.tolist() == [3, 4, 5]  # the gate holds back reused groups only


def test_fifo_takes_never_trained_groups_first_then_reused_oldest_first():
    cands = _cands([0, 1, 1, 2, 3, 3])
    for i in (0, 2, 3):
        cands.groups[i].reuse = 1
    chosen, m = choose_groups(None, cands, 5, AlgoConfig(sg=False, warmup=0), step=4)
    assert chosen.tolist() == [1, 4, 5, 0, 2] and m["algo/select/reused_admitted"] == 3


def test_fifo_freshest_reuse_order_takes_the_newest_reused_groups_first():
    """`algo.reuse_order=freshest` (the budget size's, for every FIFO replay cell): the reused
    groups by newest version first, ties in pool order; never-trained ones still come first."""
    cands = _cands([0, 1, 1, 2, 3, 3])
    for i in (0, 2, 3):
        cands.groups[i].reuse = 1
    chosen, _ = choose_groups(None, cands, 5, AlgoConfig(sg=False, warmup=0, reuse_order="freshest"), step=4)
    assert chosen.tolist() == [1, 4, 5, 3, 2]


def test_reused_admitted_counts_what_selection_admits():
    """The feed plans the next step from `algo/select/reused_admitted`: it must be selection's own
    admission rule (tau for the freshest version, min(tau, tau_abs) for stale ones)."""
    import torch

    from megatron_darl import algo

    rng = np.random.default_rng(1)
    for trial in range(20):
        cands = _cands([0, 0, 1, 1, 2, 2, 2, 1], seed=trial)
        for i, g in enumerate(cands.groups):
            g.reuse = i % 2
        b = candidate_batch(cands, AlgoConfig())
        b.prox_logprobs = (b.behav_logprobs + rng.normal(0, 0.2, b.tokens.shape) * b.loss_mask).astype(np.float32)
        rc = AlgoConfig(sg=True, warmup=0, sg_quantile=0.7, sg_tau_abs=0.03)
        _, m = choose_groups(b, cands, 8, rc, step=3)
        scores = algo.variance_scores(torch.as_tensor(b.prox_logprobs), torch.as_tensor(b.behav_logprobs),
                                      torch.as_tensor(b.loss_mask))
        _, g_scores, _ = algo.group_scores(scores, torch.as_tensor(b.group_index), torch.as_tensor(b.versions))
        admitted = algo.select_groups(g_scores, torch.as_tensor(cands.versions), quantile=0.7, tau_abs=0.03,
                                      batch_groups=8, fill="none")
        assert m["algo/select/reused_admitted"] == sum(cands.groups[int(i)].reuse for i in admitted)

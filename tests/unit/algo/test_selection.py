"""Variance scores, group scores and group selection against the naive references."""

import random

import pytest
import torch

from megatron_darl.algo import (
    admitted_groups,
    group_scores,
    select_groups,
    selection_metrics,
    selection_threshold,
    variance_scores,
)
from tests.helpers import algo_reference as ref


@pytest.mark.parametrize("b,t", [(1, 1), (5, 7), (9, 3)])
def test_variance_scores_match_reference(b, t):
    _, prox, behav, _, mask, _ = ref.rand_inputs(b, t, seed=b, empty_rows=[0] if b > 1 else ())
    got = variance_scores(prox, behav, mask)
    torch.testing.assert_close(got, torch.tensor(ref.variance_scores(*[x.tolist() for x in (prox, behav, mask)]),
                                                 dtype=torch.float64))


def test_variance_scores_extreme_and_empty_rows_are_finite():
    prox = torch.tensor([[3e38, 0.0], [0.0, 0.0]])
    behav = torch.tensor([[-3e38, 0.0], [0.0, float("inf")]])
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    s = variance_scores(prox, behav, mask)
    assert bool(torch.isfinite(s).all()) and float(s[1]) == 0.0


def test_group_scores_mean_and_oldest_version():
    scores = torch.tensor([1.0, 3.0, 2.0, 4.0, 10.0])
    gid = torch.tensor([7, 7, 2, 2, 5])
    versions = torch.tensor([4, 3, 5, 5, 1])
    ids, gs, gv = group_scores(scores, gid, versions)
    assert ids.tolist() == [2, 5, 7] and gs.tolist() == [3.0, 10.0, 2.0] and gv.tolist() == [5, 1, 3]


@pytest.mark.parametrize("seed", range(12))
def test_select_groups_matches_reference(seed):
    rng = random.Random(seed)
    g = rng.randint(1, 30)
    versions = [rng.randint(0, 4) for _ in range(g)]
    scores = [round(rng.random() * 0.1, 2) for _ in range(g)]  # rounding makes ties
    q = rng.choice([0.5, 0.9, 1.0])
    tau_abs = rng.choice([None, 0.04])
    batch = rng.randint(0, g + 2)
    fill = rng.choice(["fresh", "none"])
    got = select_groups(torch.tensor(scores, dtype=torch.float64), torch.tensor(versions), quantile=q,
                        tau_abs=tau_abs, batch_groups=batch, fill=fill)
    assert got.dtype == torch.long
    assert got.tolist() == ref.select(scores, versions, q, tau_abs, batch, fill)


def _random_pool(seed):
    rng = random.Random(seed)
    g = rng.randint(2, 30)
    versions = [rng.randint(0, 4) for _ in range(g)]
    scores = [round(rng.random() * 0.1, 2) for _ in range(g)]
    new = [rng.random() < 0.5 for _ in range(g)]
    return rng, versions, scores, new


@pytest.mark.parametrize("seed", range(40))
def test_new_first_never_lets_a_reused_group_displace_a_never_trained_one(seed):
    """Whatever the scores: every never-trained group is in the batch when it has room for them,
    before any reused one; the reused ones that fill the rest are those the published ranking
    picks among the reused alone."""
    rng, versions, scores, new = _random_pool(seed)
    batch = rng.randint(1, len(versions) + 2)
    kw = dict(quantile=rng.choice([0.5, 0.9, 1.0]), tau_abs=rng.choice([None, 0.04]), batch_groups=batch,
              fill=rng.choice(["fresh", "none"]))
    got = select_groups(torch.tensor(scores, dtype=torch.float64), torch.tensor(versions),
                        never_trained=torch.tensor(new), **kw).tolist()
    fresh = [i for i in range(len(new)) if new[i]]
    assert got[: len(fresh)] == fresh[:batch]  # all of them (pool order), first
    assert all(not new[i] for i in got[len(fresh):]) and len(set(got)) == len(got)
    room = batch - len(fresh)
    if room > 0:  # the rest: the gate and the ranking applied to the reused groups, tau from the whole pool
        tau, ok = admitted_groups(torch.tensor(scores, dtype=torch.float64), torch.tensor(versions),
                                  quantile=kw["quantile"], tau_abs=kw["tau_abs"])
        reused = [i for i in range(len(new)) if not new[i]]
        admitted = sorted((i for i in reused if ok[i]), key=lambda i: (scores[i], -versions[i], i))[:room]
        assert got[len(fresh): len(fresh) + len(admitted)] == admitted


def test_a_better_scoring_reused_group_displaces_a_never_trained_one_only_when_ranked_together():
    scores = torch.tensor([0.001, 0.03, 0.002], dtype=torch.float64)  # group 0 reused and best matched
    versions = torch.tensor([2, 3, 3])
    new = torch.tensor([False, True, True])
    kw = dict(quantile=1.0, batch_groups=2, fill="fresh")
    assert select_groups(scores, versions, **kw).tolist() == [0, 2]  # the published ranking: group 1 left out
    assert select_groups(scores, versions, never_trained=new, **kw).tolist() == [1, 2]
    assert select_groups(scores, versions, never_trained=new, quantile=1.0, batch_groups=3).tolist() == [1, 2, 0]


def test_selection_threshold_uses_the_freshest_groups_only():
    scores = torch.tensor([0.0, 1.0, 2.0, 100.0, 200.0])
    versions = torch.tensor([3, 3, 3, 1, 2])
    assert selection_threshold(scores, versions, quantile=0.5) == 1.0
    assert selection_threshold(scores, versions, quantile=1.0) == 2.0


def test_tau_abs_applies_to_stale_groups_only_and_fill_prefers_fresh():
    scores = torch.tensor([0.05, 0.06, 0.03, 0.01, 0.5])
    versions = torch.tensor([5, 5, 4, 4, 3])
    # tau = quantile([0.05, 0.06], 1.0) = 0.06; stale limit min(0.06, 0.02) admits only index 3
    got = select_groups(scores, versions, quantile=1.0, tau_abs=0.02, batch_groups=4)
    assert got.tolist() == [3, 0, 1, 2]
    got = select_groups(scores, versions, quantile=1.0, tau_abs=0.02, batch_groups=5, fill="none")
    assert got.tolist() == [3, 0, 1]


def test_threshold_floor():
    scores = torch.tensor([1e-13, 3e-13, 0.004, 0.02, 0.008])
    versions = torch.tensor([5, 5, 4, 4, 3])
    assert selection_threshold(scores, versions, quantile=1.0) == pytest.approx(3e-13)
    assert selection_threshold(scores, versions, quantile=1.0, tau_floor=0.01) == 0.01
    assert select_groups(scores, versions, quantile=1.0, batch_groups=5, fill="none").tolist() == [0, 1]
    got = select_groups(scores, versions, quantile=1.0, tau_floor=0.01, batch_groups=5, fill="none")
    assert got.tolist() == [0, 1, 2, 4]
    tau, ok = admitted_groups(scores, versions, quantile=1.0, tau_abs=0.005, tau_floor=0.01)
    assert tau == 0.01 and ok.tolist() == [True, True, True, False, False]
    with pytest.raises(ValueError, match="tau_floor"):
        selection_threshold(scores, versions, tau_floor=-1.0)


def test_selection_metrics_and_errors():
    versions = torch.tensor([1, 1, 2, 2])
    m = selection_metrics(versions, torch.tensor([0, 2, 3]), tau=0.1)
    assert m == {"algo/select/n_groups": 3.0, "algo/select/filtered_frac/v1": 0.5,
                 "algo/select/filtered_frac/v2": 0.0, "algo/select/tau": 0.1}
    with pytest.raises(ValueError, match="group_scores"):
        select_groups(torch.tensor([float("nan")]), torch.tensor([0]), batch_groups=1)
    with pytest.raises(ValueError, match="fill"):
        select_groups(torch.tensor([0.0]), torch.tensor([0]), batch_groups=1, fill="random")
    assert select_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long), batch_groups=3).numel() == 0

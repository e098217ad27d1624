"""D-ARL with the PPO clip anchored behind the data: at each sample's behavior policy, or at the
balance mixture of the batch's behavior versions. Against per-token loops, the equivalence with
naive async PPO, gradients, micro-batch additivity and the clip fraction every cell reports."""

import math

import pytest
import torch

from megatron_darl import algo
from megatron_darl.algo.config import TRUST_ANCHORS as CONFIG_ANCHORS
from megatron_darl.algo.config import AlgoConfig
from tests.helpers import algo_reference as ref


def _clip_term(r, a, lo=0.2, hi=0.2):
    return min(r * a, min(max(r, 1 - lo), 1 + hi) * a)


def _naive_anchored(q, anchor, adv, mask, versions, beta, lo=0.2, hi=0.2):
    """-sum_k beta_k (1/N_k) sum_{i in S_k} sum_j m_ij min(R A, clip(R) A), R = exp(q - anchor): a loop."""
    n_k, s_k = {}, {}
    for i in range(len(mask)):
        k = int(versions[i])
        for j in range(len(mask[i])):
            if mask[i][j]:
                n_k[k] = n_k.get(k, 0) + 1
                s_k[k] = s_k.get(k, 0.0) + _clip_term(math.exp(q[i][j] - anchor[i][j]), adv[i], lo, hi)
    return -sum(beta[k] * s_k[k] / n_k[k] for k in n_k)


def _inputs(seed, b=7, t=6, scale=0.5):
    logp, prox, behav, adv, mask, versions = ref.rand_inputs(b, t, seed=seed, scale=scale, empty_rows=[2])
    return logp.requires_grad_(True), prox, behav, adv, mask, versions


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("pmis", ["ess", "tokens"])
def test_behavior_anchor_matches_the_per_token_loop(seed, pmis):
    logp, prox, behav, adv, mask, versions = _inputs(seed)
    loss, metrics = algo.darl_policy_loss(logp, prox, behav, adv, mask, versions, pmis=pmis, anchor="behavior")
    rho, _ = algo.rollout_is_weights(prox, behav, mask)  # beta_k still from the versions' ESS
    beta = ref.pmis_beta(versions.tolist(), rho.tolist(), mask.tolist(), mode=pmis)
    want = _naive_anchored(logp.tolist(), behav.tolist(), adv.tolist(), mask.tolist(), versions.tolist(), beta)
    assert loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    proximal, _ = algo.darl_policy_loss(logp, prox, behav, adv, mask, versions, pmis=pmis)
    assert abs(proximal.item() - want) > 1e-4  # the proximal form is another loss: the check can fail
    assert float(metrics["algo/clip_frac"]) > 0  # the clip acts against b at theta = theta_prox


def test_behavior_anchor_with_one_version_and_token_beta_is_naive_async_ppo():
    """K = 1, no selection, beta = tokens: exactly PPO with old_logprob = behavior, loss and gradient."""
    logp, prox, behav, adv, mask, _ = _inputs(5, b=9, t=8, scale=0.6)
    versions = torch.zeros(9, dtype=torch.long)
    darl, dm = algo.darl_policy_loss(logp, prox, behav, adv, mask, versions, pmis="tokens", anchor="behavior")
    naive, nm = algo.ppo_loss(logp, behav, adv, mask)
    assert darl.item() == pytest.approx(naive.item(), rel=1e-12)
    torch.testing.assert_close(_grad(darl, logp), _grad(naive, logp), rtol=1e-12, atol=1e-14)
    assert float(dm["algo/clip_frac"]) == pytest.approx(float(nm["algo/clip_frac"]))
    assert float(nm["algo/clip_frac"]) > 0


def test_mixture_anchor_matches_the_sum_of_alpha_mu_loop():
    logp, prox, behav, adv, mask, versions = _inputs(11, b=8, t=5)
    g = torch.Generator().manual_seed(3)
    by_version = {k: behav + 0.4 * torch.randn(behav.shape, generator=g, dtype=behav.dtype) for k in (0, 1, 2)}
    counts = algo.version_token_counts(versions, mask)
    loss, _ = algo.darl_policy_loss(logp, prox, behav, adv, mask, versions, pmis="balance", anchor="mixture",
                                    behav_logp_by_version=by_version, is_threshold=1e9, is_veto_threshold=None)
    n = sum(float(c) for c in counts.values())
    alpha = {k: float(c) / n for k, c in counts.items()}
    mix = [[math.log(sum(alpha[k] * math.exp(by_version[k][i][j]) for k in alpha)) for j in range(5)]
           for i in range(8)]
    want = _naive_anchored(logp.tolist(), mix, adv.tolist(), mask.tolist(), versions.tolist(), alpha)
    assert loss.item() == pytest.approx(want, rel=1e-10)
    behav_only, _ = algo.darl_policy_loss(logp, prox, behav, adv, mask, versions, pmis="tokens", anchor="behavior")
    assert abs(behav_only.item() - want) > 1e-4


def test_anchored_gradient_matches_finite_differences():
    logp, prox, behav, adv, mask, versions = _inputs(21, b=4, t=3, scale=0.1)  # ratios inside the clip

    def f(x):
        return algo.darl_policy_loss(x, prox, behav, adv, mask, versions, pmis="ess", anchor="behavior")[0]

    g = _grad(f(logp), logp)
    eps = 1e-6
    for i, j in [(0, 0), (1, 2), (3, 1)]:
        d = torch.zeros_like(logp)
        d[i, j] = eps
        fd = ((f(logp.detach() + d)).item() - (f(logp.detach() - d)).item()) / (2 * eps)
        assert float(g[i, j]) == pytest.approx(fd, rel=1e-5, abs=1e-9)


def test_micro_batches_with_batch_constants_sum_to_the_full_anchored_loss():
    logp, prox, behav, adv, mask, versions = _inputs(8, b=10, t=6)
    beta, counts, _ = algo.pmis_batch_constants(prox, behav, mask, versions, pmis="ess")
    full, _ = algo.darl_policy_loss(logp, prox, behav, adv, mask, versions, beta=beta, version_token_counts=counts,
                                    anchor="behavior")
    parts = [algo.darl_policy_loss(logp[s], prox[s], behav[s], adv[s], mask[s], versions[s], beta=beta,
                                   version_token_counts=counts, anchor="behavior")[0]
             for s in (slice(0, 3), slice(3, 10))]
    assert (sum(parts)).item() == pytest.approx(full.item(), rel=1e-12)


def test_behavior_clip_fraction_matches_a_loop():
    logp, _, behav, adv, mask, _ = _inputs(4, b=6, t=7, scale=0.7)
    got = float(algo.behavior_clip_fraction(logp, behav, adv, mask, clip_low=0.2, clip_high=0.28))
    hits = n = 0
    for i in range(6):
        for j in range(7):
            if mask[i, j]:
                r, a = math.exp((logp[i, j] - behav[i, j]).item()), float(adv[i])
                hits += min(max(r, 0.8), 1.28) * a < r * a
                n += 1
    assert got == pytest.approx(hits / n) and 0 < got < 1
    half = float(algo.behavior_clip_fraction(logp, behav, adv, mask, clip_low=0.2, clip_high=0.28, den=2 * n))
    assert half == pytest.approx(hits / n / 2)


def test_anchor_options_that_mean_nothing_are_refused():
    logp, prox, behav, adv, mask, versions = _inputs(0)
    with pytest.raises(ValueError, match="anchor must be one of"):
        algo.darl_policy_loss(logp, prox, behav, adv, mask, versions, anchor="theta")
    with pytest.raises(ValueError, match="behav_clip=None"):
        algo.darl_policy_loss(logp, prox, behav, adv, mask, versions, anchor="behavior", behav_clip="mask")
    with pytest.raises(ValueError, match="behav_logp_by_version"):
        algo.anchor_log_prob("mixture", behav, mask)
    assert CONFIG_ANCHORS == algo.TRUST_ANCHORS and AlgoConfig().anchor == "behavior"

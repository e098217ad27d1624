"""P-MIS coefficients, balance weights and darl_policy_loss: references, equivalences,
finite-difference gradients, micro-batch additivity and the rollout-IS options object."""

import dataclasses
import inspect
import math

import pytest
import torch

from megatron_darl.algo import (
    RolloutISOptions,
    balance_weights,
    darl_policy_loss,
    decoupled_ppo_loss,
    interpolate_version_logp,
    pmis_batch_constants,
    pmis_behavior_weights,
    pmis_coefficients,
    ppo_loss,
    rollout_is_weights,
    sg_policy_loss,
)
from tests.helpers import algo_reference as ref

SHAPES = [(1, 1), (5, 4), (9, 11)]


def lists(*ts):
    return [t.tolist() for t in ts]


@pytest.mark.parametrize("b,t", SHAPES)
@pytest.mark.parametrize("mode", ["ess", "tokens"])
def test_coefficients_match_reference(b, t, mode):
    _, prox, behav, _, mask, versions = ref.rand_inputs(b, t, seed=b * 3 + t, scale=0.8,
                                                        empty_rows=[0] if b > 1 else ())
    w, _ = rollout_is_weights(prox, behav, mask)
    beta, metrics = pmis_coefficients(versions, w, mask, mode=mode)
    want = ref.pmis_beta(versions.tolist(), w.tolist(), mask.tolist(), mode=mode)
    assert beta.keys() == want.keys()
    for k in want:
        assert math.isclose(beta[k], want[k], rel_tol=1e-9, abs_tol=1e-12)
        assert f"algo/beta/v{k}" in metrics and f"algo/ess_frac/v{k}" in metrics
    if sum(map(sum, mask.tolist())):
        assert math.isclose(sum(beta.values()), 1.0, rel_tol=1e-12)


def test_sequence_level_ess_counts_sequences():
    w = torch.tensor([[2.0, 2.0, 2.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    versions = torch.tensor([0, 0, 1])
    beta, metrics = pmis_coefficients(versions, w, mask, level="sequence")
    # version 0: sequence weights (2, 1): ESS = 9/5; version 1: ESS = 1
    assert math.isclose(beta[0], (9 / 5) / (9 / 5 + 1), rel_tol=1e-6)
    assert math.isclose(float(metrics["algo/ess_frac/v0"]), 0.9, rel_tol=1e-6)


@pytest.mark.parametrize("b,t", SHAPES)
@pytest.mark.parametrize("is_kw", [dict(level="token", mode="truncate"),
                                   dict(level="sequence", mode="mask", threshold=3.0),
                                   dict(level="geometric", mode="truncate", threshold=1.5)])
def test_darl_loss_matches_reference(b, t, is_kw):
    logp, prox, behav, adv, mask, versions = ref.rand_inputs(b, t, seed=40 + b, scale=0.4,
                                                             empty_rows=[1] if b > 2 else ())
    lib_kw = {f"is_{k}": v for k, v in is_kw.items()}
    loss, metrics = darl_policy_loss(logp, prox, behav, adv, mask, versions, pmis="ess", **lib_kw)
    w = ref.is_weights(prox.tolist(), behav.tolist(), mask.tolist(), **is_kw)
    rows = [[x for x, keep in zip(wr, mr) if keep] for wr, mr in zip(w, mask.tolist())]
    if is_kw["level"] == "token":
        beta = ref.pmis_beta(versions.tolist(), w, mask.tolist())
    else:  # ESS over sequences, each with its (constant) weight
        seq_w = [[r[0]] if r else [] for r in rows]
        beta = ref.pmis_beta(versions.tolist(), seq_w, [[1] if r else [] for r in rows])
    want = ref.darl(*lists(logp, prox, behav, adv, mask, versions), beta, **is_kw)
    assert math.isclose(float(loss), want, rel_tol=1e-9, abs_tol=1e-12)
    assert {"algo/clip_frac", "algo/ess_frac"} <= metrics.keys()


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("behav_clip", [None, "ratio", "mask"])
def test_tokens_mode_is_the_collapsed_token_mean(ratio_level, behav_clip):
    logp, prox, behav, adv, mask, versions = ref.rand_inputs(8, 9, seed=11, scale=0.6, empty_rows=[4])
    q1 = logp.clone().requires_grad_(True)
    a, _ = darl_policy_loss(q1, prox, behav, adv, mask, versions, pmis="tokens", ratio_level=ratio_level,
                            behav_clip=behav_clip, is_threshold=1e6, is_veto_threshold=None)
    ga, = torch.autograd.grad(a, q1)
    q2 = logp.clone().requires_grad_(True)
    if behav_clip is None:  # verl-style: PPO against prox with the rollout IS weights
        w, _ = rollout_is_weights(prox, behav, mask, threshold=1e6, veto_threshold=None)
        b, _ = ppo_loss(q2, prox, adv, mask, token_weights=w, ratio_level=ratio_level)
    else:  # AReaL decoupled with the same (uncapped) weights
        b, _ = decoupled_ppo_loss(q2, prox, behav, adv, mask, ratio_level=ratio_level, behav_clip=behav_clip)
    gb, = torch.autograd.grad(b, q2)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)


def test_one_version_makes_ess_and_tokens_equal():
    logp, prox, behav, adv, mask, _ = ref.rand_inputs(6, 7, seed=12, scale=0.7, empty_rows=[2])
    versions = torch.full((6,), 3)
    a, ma = darl_policy_loss(logp, prox, behav, adv, mask, versions, pmis="ess")
    b, mb = darl_policy_loss(logp, prox, behav, adv, mask, versions, pmis="tokens")
    assert float(a) == float(b) and float(ma["algo/beta/v3"]) == 1.0
    # and ess differs from tokens with two versions of unequal drift (the test can fail)
    versions = torch.tensor([0, 0, 0, 1, 1, 1])
    c, _ = darl_policy_loss(logp, prox, behav * torch.tensor([1.0] * 3 + [1.3] * 3, dtype=torch.float64).unsqueeze(-1),
                            adv, mask, versions, pmis="ess")
    d, _ = darl_policy_loss(logp, prox, behav * torch.tensor([1.0] * 3 + [1.3] * 3, dtype=torch.float64).unsqueeze(-1),
                            adv, mask, versions, pmis="tokens")
    assert abs(float(c) - float(d)) > 1e-6


@pytest.mark.parametrize("kw", [dict(), dict(ratio_level="sequence"), dict(behav_clip="ratio"),
                                dict(is_level="geometric", is_mode="mask", is_threshold=4.0), dict(pmis="tokens")])
def test_darl_gradient_matches_finite_differences(kw):
    # surrogate="sg" is left out on purpose: its weights are stop-gradient functions of q, so
    # the loss value's finite differences are not its gradient (checked analytically instead).
    logp, prox, behav, adv, mask, _ = ref.rand_inputs(4, 3, seed=13, scale=0.3, empty_rows=[2])
    versions = torch.tensor([0, 1, 1, 2])
    q = logp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: darl_policy_loss(x, prox, behav, adv, mask, versions, **kw)[0], (q,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("kw", [dict(pmis="ess"), dict(pmis="tokens", is_level="sequence"),
                                dict(pmis="ess", behav_clip="mask", ratio_level="sequence"), dict(pmis="balance")])
def test_micro_batches_with_batch_constants_sum_to_the_full_loss(kw):
    logp, prox, behav, adv, mask, versions = ref.rand_inputs(9, 6, seed=14, scale=0.5, empty_rows=[3])
    by_version = interpolate_version_logp(prox, behav, versions, 3, [0, 1, 2]) if kw["pmis"] == "balance" else None
    const_kw = {k: v for k, v in kw.items() if k.startswith("is_") or k == "pmis"}
    beta, counts, metrics = pmis_batch_constants(prox, behav, mask, versions, behav_logp_by_version=by_version,
                                                 **const_kw)
    assert any(k.startswith("algo/beta/v") for k in metrics)
    q_full = logp.clone().requires_grad_(True)
    full, full_metrics = darl_policy_loss(q_full, prox, behav, adv, mask, versions,
                                          behav_logp_by_version=by_version, **kw)
    g_full, = torch.autograd.grad(full, q_full)
    q = logp.clone().requires_grad_(True)
    total, clip_frac, start = 0.0, 0.0, 0
    for size in [2, 4, 3]:
        sl = slice(start, start + size)
        part_by_v = None if by_version is None else {k: v[sl] for k, v in by_version.items()}
        part, m = darl_policy_loss(q[sl], prox[sl], behav[sl], adv[sl], mask[sl], versions[sl], beta=beta,
                                   version_token_counts=counts, behav_logp_by_version=part_by_v, **kw)
        assert not any(k.startswith("algo/beta/") for k in m)
        total, clip_frac, start = total + part, clip_frac + m["algo/clip_frac"], start + size
    g, = torch.autograd.grad(total, q)
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g, g_full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(clip_frac, full_metrics["algo/clip_frac"], rtol=1e-12, atol=1e-14)


def test_missing_version_in_beta_is_named():
    logp, prox, behav, adv, mask, _ = ref.rand_inputs(3, 2, seed=1)
    with pytest.raises(ValueError, match="version 7"):
        darl_policy_loss(logp, prox, behav, adv, mask, torch.tensor([7, 0, 0]), beta={0: 1.0},
                         version_token_counts={0: 4.0, 7: 2.0})
    with pytest.raises(ValueError, match="behav_logp_by_version"):
        darl_policy_loss(logp, prox, behav, adv, mask, torch.tensor([0, 0, 0]), pmis="balance")
    with pytest.raises(ValueError, match="surrogate"):
        darl_policy_loss(logp, prox, behav, adv, mask, torch.tensor([0, 0, 0]), surrogate="sg", behav_clip="ratio")


def test_balance_weights_match_the_mixture_reference():
    _, prox, behav, _, mask, versions = ref.rand_inputs(6, 5, seed=15, scale=0.5, empty_rows=[1])
    g = torch.Generator().manual_seed(15)
    by_v = {k: behav + 0.3 * torch.randn(6, 5, generator=g, dtype=torch.float64) for k in range(3)}
    for k in range(3):  # each sample's own version scores it with its own behavior log-prob
        by_v[k][versions == k] = behav[versions == k]
    w, _ = balance_weights(prox, behav, by_v, versions, mask, threshold=1e6, veto_threshold=None)
    m, v = mask.tolist(), versions.tolist()
    n = {k: sum(sum(m[i]) for i in range(6) if v[i] == k) for k in set(v)}
    total = sum(n.values())
    for i in range(6):
        for j in range(5):
            mix = sum(n[k] / total * math.exp(float(by_v[k][i, j])) for k in n if n[k] > 0)
            want = math.exp(float(prox[i, j])) / mix if m[i][j] else 0.0
            assert math.isclose(float(w[i, j]), want, rel_tol=1e-9, abs_tol=1e-15)


def test_balance_with_one_version_is_plain_importance_sampling():
    logp, prox, behav, adv, mask, _ = ref.rand_inputs(5, 6, seed=16, scale=0.5, empty_rows=[0])
    versions = torch.full((5,), 2)
    wb, _ = balance_weights(prox, behav, {2: behav}, versions, mask)
    wi, _ = rollout_is_weights(prox, behav, mask)
    torch.testing.assert_close(wb, wi, rtol=1e-12, atol=0)
    a, _ = darl_policy_loss(logp, prox, behav, adv, mask, versions, pmis="balance", behav_logp_by_version={2: behav})
    b, _ = darl_policy_loss(logp, prox, behav, adv, mask, versions, pmis="tokens")
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_interpolation_is_exact_at_both_ends():
    _, prox, behav, _, _, _ = ref.rand_inputs(3, 4, seed=17)
    versions = torch.tensor([1, 3, 5])
    out = interpolate_version_logp(prox, behav, versions, 5, [1, 3, 5, 4])
    torch.testing.assert_close(out[1][0], behav[0]) and torch.testing.assert_close(out[5][0], prox[0])
    torch.testing.assert_close(out[3][1], behav[1])
    torch.testing.assert_close(out[3][0], 0.5 * (behav[0] + prox[0]))
    torch.testing.assert_close(out[4][2], behav[2])  # fresh sample: no drift to interpolate
    with pytest.raises(ValueError, match="prox_version"):
        interpolate_version_logp(prox, behav, versions, 4, [1])


def test_sg_surrogate_per_version():
    logp, _, behav, adv, mask, versions = ref.rand_inputs(7, 5, seed=18, empty_rows=[6])
    a, _ = darl_policy_loss(logp, None, behav, adv, mask, versions, surrogate="sg", pmis="tokens")
    b, _ = sg_policy_loss(logp, behav, adv, mask)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    c, metrics = darl_policy_loss(logp, None, behav, adv, mask, versions, surrogate="sg", pmis="ess")
    q, bl, ad, m, v = lists(logp, behav, adv, mask, versions)
    w = [[min(math.exp(q[i][j] - bl[i][j]), 2.0) if m[i][j] else 0.0 for j in range(5)] for i in range(7)]
    beta = ref.pmis_beta(v, w, m)
    want = 0.0
    for k in beta:
        rows = [i for i in range(7) if v[i] == k]
        n_k = sum(sum(m[i]) for i in rows)
        s = sum(w[i][j] * q[i][j] * ad[i] for i in rows for j in range(5) if m[i][j])
        want -= beta[k] * (s / n_k if n_k else 0.0)
    assert math.isclose(float(c), want, rel_tol=1e-10)


@pytest.mark.parametrize("pmis", ["ess", "tokens"])
def test_darl_extreme_inputs_are_finite(pmis):
    logp = torch.tensor([[0.0, -1e4, 60.0], [-50.0, 0.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    prox = torch.tensor([[-1e4, 0.0, -60.0], [50.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    behav = torch.tensor([[1e4, -1e4, 0.0], [-50.0, 0.0, float("nan")], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    for kw in [dict(), dict(is_level="sequence"), dict(behav_clip="ratio"), dict(surrogate="sg")]:
        loss, metrics = darl_policy_loss(logp, prox, behav, torch.tensor([1.0, -1.0, 2.0]), mask,
                                         torch.tensor([0, 1, 2]), pmis=pmis, is_veto_threshold=None, **kw)
        grad, = torch.autograd.grad(loss, logp)
        assert bool(torch.isfinite(loss)) and bool(torch.isfinite(grad).all())
        assert all(bool(torch.isfinite(torch.as_tensor(v))) for v in metrics.values())


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_statistics_summed_over_shards_give_the_full_batch_beta(level):
    from megatron_darl.algo import pmis_beta_from_statistics, pmis_statistics

    _, prox, behav, _, mask, versions = ref.rand_inputs(10, 6, seed=19, scale=0.7, empty_rows=[4])
    w, _ = rollout_is_weights(prox, behav, mask)
    window = [0, 1, 2, 3]  # version 3 absent from the data: zero row, beta 0
    ks_a, a = pmis_statistics(versions[:4], w[:4], mask[:4], level=level, all_versions=window)
    ks_b, b = pmis_statistics(versions[4:], w[4:], mask[4:], level=level, all_versions=window)
    assert ks_a == ks_b == window
    beta, counts, metrics = pmis_beta_from_statistics(window, a + b)  # what all_reduce(SUM) gives
    want, want_metrics = pmis_coefficients(versions, w, mask, level=level)
    for k in want:
        assert math.isclose(beta[k], want[k], rel_tol=1e-12)
    assert beta[3] == 0.0 and counts[3] == 0.0
    assert math.isclose(float(metrics["algo/ess_frac"]), float(want_metrics["algo/ess_frac"]), rel_tol=1e-12)
    with pytest.raises(ValueError, match="all_versions"):
        pmis_statistics(versions, w, mask, all_versions=[0])


def test_tokens_mode_with_areal_cap_is_decoupled_ppo():
    # the mapping the integration page states: behav_imp_weight_cap = mask mode, lower bound 0
    logp, prox, behav, adv, mask, versions = ref.rand_inputs(8, 7, seed=23, scale=0.8, empty_rows=[1])
    a, _ = darl_policy_loss(logp, prox, behav, adv, mask, versions, pmis="tokens", is_mode="mask",
                            is_threshold=1.5, is_threshold_lower=0.0, is_veto_threshold=None)
    b, metrics = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_cap=1.5)
    assert float(metrics["algo/is/frac_capped"]) > 0  # the cap acts on this data
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("fn", [darl_policy_loss, pmis_batch_constants])
def test_the_public_is_keywords_are_the_options_fields_with_their_defaults(fn):
    # verl and AReaL callers pass is_level=..., is_threshold=...: the keywords stay, and each one
    # must default to what RolloutISOptions defaults to (the loss builds the object from them)
    params = inspect.signature(fn).parameters
    for f in dataclasses.fields(RolloutISOptions):
        p = params[f"is_{f.name}"]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default == f.default, (fn.__name__, f.name)


@pytest.mark.parametrize("opts", [dict(), dict(level="sequence", mode="mask", threshold=3.0),
                                  dict(level="geometric", mode="clip", threshold=1.5, threshold_lower=0.2),
                                  dict(threshold=1.2, veto_threshold=None), dict(veto_threshold=0.3)])
def test_behavior_weights_from_the_options_are_rollout_is_weights(opts):
    _, prox, behav, _, mask, versions = ref.rand_inputs(7, 6, seed=29, scale=0.9, empty_rows=[2])
    rho, metrics = pmis_behavior_weights(prox, behav, mask, versions, is_options=RolloutISOptions(**opts))
    want, want_metrics = rollout_is_weights(prox, behav, mask, **opts)
    assert torch.equal(rho, want) and metrics.keys() == want_metrics.keys()
    assert all(torch.equal(metrics[k], want_metrics[k]) for k in want_metrics)
    # the keywords reach the same weights through the loss: its beta_k is the options' ESS beta
    loss_kw = {f"is_{k}": v for k, v in opts.items()}
    _, loss_metrics = darl_policy_loss(prox, prox, behav, torch.ones(7, dtype=prox.dtype), mask, versions, **loss_kw)
    beta, _ = pmis_coefficients(versions, want, mask, level="token" if opts.get("level", "token") == "token"
                                else "sequence")
    assert all(torch.equal(loss_metrics[f"algo/beta/v{k}"], torch.tensor(b)) for k, b in beta.items())


def test_the_options_are_frozen_and_balance_needs_token_level():
    opts = RolloutISOptions(level="sequence")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.threshold = 3.0
    _, prox, behav, _, mask, versions = ref.rand_inputs(3, 4, seed=30)
    with pytest.raises(ValueError, match="is_level='token', got 'sequence'"):
        pmis_behavior_weights(prox, behav, mask, versions, is_options=opts, pmis="balance",
                              behav_logp_by_version={k: behav for k in range(3)})

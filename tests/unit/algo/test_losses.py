"""PPO, decoupled PPO, GSPO-style ratios, behav_clip and sg losses vs naive references."""

import math

import pytest
import torch

from megatron_darl.algo import decoupled_ppo_loss, ppo_loss, rollout_is_weights, sg_policy_loss
from tests.helpers import algo_reference as ref

SHAPES = [(1, 1), (4, 6), (7, 13)]


def lists(*ts):
    return [t.tolist() for t in ts]


@pytest.mark.parametrize("b,t", SHAPES)
@pytest.mark.parametrize("lo,hi", [(0.2, 0.2), (0.1, 0.28)])
def test_ppo_matches_reference(b, t, lo, hi):
    logp, prox, _, adv, mask, _ = ref.rand_inputs(b, t, seed=b + t, empty_rows=[1] if b > 2 else ())
    w = torch.rand(b, t, dtype=torch.float64)
    loss, metrics = ppo_loss(logp, prox, adv, mask, clip_low=lo, clip_high=hi, token_weights=w)
    want = ref.ppo(*lists(logp, prox, adv, mask), lo=lo, hi=hi, w=w.tolist())
    assert math.isclose(float(loss), want, rel_tol=1e-10, abs_tol=1e-12)
    assert set(metrics) == {"algo/clip_frac", "algo/ppo_kl"}


def test_advantages_per_token_equal_broadcast():
    logp, prox, _, adv, mask, _ = ref.rand_inputs(5, 7, seed=3)
    a, _ = ppo_loss(logp, prox, adv, mask)
    b, _ = ppo_loss(logp, prox, adv.unsqueeze(-1).expand(5, 7).clone(), mask)
    assert torch.equal(a, b)


def test_clip_fraction_counts_tokens_where_clip_acts():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])  # clipped: 1.5 (A>0), 0.5 (A<0); not: 1.1, 1.5 (A<0)
    _, metrics = ppo_loss(logp, old, adv, torch.ones(1, 4, dtype=torch.bool))
    assert math.isclose(float(metrics["algo/clip_frac"]), 0.5)


@pytest.mark.parametrize("b,t", SHAPES)
@pytest.mark.parametrize("cap", [None, 1.5])
def test_decoupled_matches_reference(b, t, cap):
    logp, prox, behav, adv, mask, _ = ref.rand_inputs(b, t, seed=10 + b, empty_rows=[0] if b > 2 else ())
    loss, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_cap=cap)
    want = ref.decoupled(*lists(logp, prox, behav, adv, mask), cap=cap)
    assert math.isclose(float(loss), want, rel_tol=1e-10, abs_tol=1e-12)


def test_decoupled_with_prox_equal_behav_is_plain_ppo():
    logp, prox, _, adv, mask, _ = ref.rand_inputs(6, 9, seed=4, empty_rows=[2])
    logp = logp.clone().requires_grad_(True)
    a, _ = decoupled_ppo_loss(logp, prox, prox.clone(), adv, mask, clip_low=0.1, clip_high=0.3)
    ga, = torch.autograd.grad(a, logp)
    b, _ = ppo_loss(logp, prox, adv, mask, clip_low=0.1, clip_high=0.3)
    gb, = torch.autograd.grad(b, logp)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-15)
    torch.testing.assert_close(ga, gb, rtol=0, atol=1e-15)


def test_decoupled_cap_keeps_the_original_denominator():
    logp = prox = torch.zeros(1, 4, dtype=torch.float64)
    behav = torch.log(torch.tensor([[1.0, 1.0, 1.0, 0.1]], dtype=torch.float64))  # w = 10 on the last
    adv = torch.ones(1, dtype=torch.float64)
    loss, metrics = decoupled_ppo_loss(logp, prox, behav, adv, torch.ones(1, 4, dtype=torch.bool), behav_weight_cap=5.0)
    assert math.isclose(float(loss), -3 / 4)  # not -3/3
    assert math.isclose(float(metrics["algo/is/frac_capped"]), 0.25)


@pytest.mark.parametrize("b,t", SHAPES)
def test_sequence_level_ratio_matches_reference(b, t):
    logp, prox, _, adv, mask, _ = ref.rand_inputs(b, t, seed=20 + t, scale=0.2, empty_rows=[2] if b > 2 else ())
    loss, _ = ppo_loss(logp, prox, adv, mask, ratio_level="sequence")
    assert math.isclose(float(loss), ref.seq_ppo(*lists(logp, prox, adv, mask)), rel_tol=1e-10, abs_tol=1e-12)


def test_behav_clip_ratio_matches_reference():
    logp, prox, behav, adv, mask, _ = ref.rand_inputs(6, 8, seed=5, scale=0.5)
    loss, metrics = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_clip="ratio")
    q, p, b, a, m = lists(logp, prox, behav, adv, mask)
    num, n = 0.0, 0
    for i in range(6):
        for j in range(8):
            if m[i][j]:
                n += 1
                w = math.exp(p[i][j] - b[i][j])
                o = w * ref.token_obj(q[i][j], p[i][j], a[i], 0.2, 0.2)
                total = math.exp(q[i][j] - b[i][j])
                num += min(o, ref.clamp(total, 0.8, 1.2) * a[i])
    assert math.isclose(float(loss), -num / n, rel_tol=1e-10)
    assert float(metrics["algo/behav_clip_frac"]) > 0  # the switch acts on this data


def test_behav_clip_ratio_stops_pushing_past_the_behavior_trust_region():
    # w = 3, r = 1: plain decoupled pushes up with weight 3; the total ratio 3 > 1.2 clips it.
    logp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    prox = torch.zeros(1, 1, dtype=torch.float64)
    behav = torch.full((1, 1), -math.log(3.0), dtype=torch.float64)
    m, a = torch.ones(1, 1, dtype=torch.bool), torch.ones(1, dtype=torch.float64)
    g_off, = torch.autograd.grad(decoupled_ppo_loss(logp, prox, behav, a, m)[0], logp)
    g_on, = torch.autograd.grad(decoupled_ppo_loss(logp, prox, behav, a, m, behav_clip="ratio")[0], logp)
    assert math.isclose(float(g_off), -3.0) and float(g_on) == 0.0


def test_behav_clip_mask_drops_tokens_outside_the_band():
    logp = prox = torch.zeros(1, 4, dtype=torch.float64)
    behav = torch.log(torch.tensor([[1.0, 0.1, 10.0, 0.5]], dtype=torch.float64))  # exp(l) = 1, 10, 0.1, 2
    m, a = torch.ones(1, 4, dtype=torch.bool), torch.ones(1, dtype=torch.float64)
    loss, metrics = decoupled_ppo_loss(logp, prox, behav, a, m, behav_clip="mask", behav_mask_threshold=5.0)
    assert math.isclose(float(loss), -(1.0 + 2.0) / 4)
    assert math.isclose(float(metrics["algo/behav_clip_frac"]), 0.5)
    with pytest.raises(ValueError, match="behav_clip"):
        decoupled_ppo_loss(logp, prox, behav, a, m, behav_clip="both")


def test_sg_loss_value_and_gradient():
    logp, _, behav, adv, mask, _ = ref.rand_inputs(5, 6, seed=7, empty_rows=[3])
    logp = logp.clone().requires_grad_(True)
    loss, metrics = sg_policy_loss(logp, behav, adv, mask, threshold=1.5)
    grad, = torch.autograd.grad(loss, logp)
    q, b, a, m = lists(logp.detach(), behav, adv, mask)
    n = sum(map(sum, m))
    want_loss, want_grad = 0.0, [[0.0] * 6 for _ in range(5)]
    for i in range(5):
        for j in range(6):
            if m[i][j]:
                w = min(math.exp(q[i][j] - b[i][j]), 1.5)
                want_loss -= w * q[i][j] * a[i] / n
                want_grad[i][j] = -w * a[i] / n
    assert math.isclose(float(loss.detach()), want_loss, rel_tol=1e-10)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64))
    assert 0 <= float(metrics["algo/sg/frac_truncated"]) <= 1


def _split_sum(fn, tensors, per_row, mask, splits):
    """Sum of fn over row micro-batches, with the whole batch's token count."""
    den = float(mask.sum())
    total, start = 0.0, 0
    for size in splits:
        sl = slice(start, start + size)
        total = total + fn(*[t[sl] for t in tensors], *[t[sl] for t in per_row], mask[sl], den)
        start += size
    return total


@pytest.mark.parametrize("which", ["ppo", "decoupled", "decoupled_seq_behavclip", "sg"])
def test_micro_batches_sum_to_the_full_batch(which):
    logp, prox, behav, adv, mask, _ = ref.rand_inputs(8, 10, seed=9, empty_rows=[5])
    fns = {
        "ppo": lambda q, p, b, a, m, den=None: ppo_loss(q, p, a, m, token_weights=rollout_is_weights(p, b, m)[0],
                                                         loss_denominator=den)[0],
        "decoupled": lambda q, p, b, a, m, den=None: decoupled_ppo_loss(q, p, b, a, m, behav_weight_cap=2.0,
                                                                         loss_denominator=den)[0],
        "decoupled_seq_behavclip": lambda q, p, b, a, m, den=None: decoupled_ppo_loss(
            q, p, b, a, m, ratio_level="sequence", behav_clip="ratio", loss_denominator=den)[0],
        "sg": lambda q, p, b, a, m, den=None: sg_policy_loss(q, b, a, m, loss_denominator=den)[0],
    }
    fn = fns[which]
    q_full = logp.clone().requires_grad_(True)
    full = fn(q_full, prox, behav, adv, mask)
    g_full, = torch.autograd.grad(full, q_full)
    q_mb = logp.clone().requires_grad_(True)
    summed = _split_sum(lambda q, p, b, a, m, den: fn(q, p, b, a, m, den), (q_mb, prox, behav), (adv,), mask, [3, 1, 4])
    g_mb, = torch.autograd.grad(summed, q_mb)
    torch.testing.assert_close(summed, full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_mb, g_full, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_inputs_give_finite_losses_and_gradients(dtype):
    logp = torch.tensor([[0.0, -1e4, 60.0], [-50.0, 0.0, 0.0]], dtype=dtype, requires_grad=True)
    prox = torch.tensor([[-1e4, 0.0, -60.0], [50.0, 0.0, 0.0]], dtype=dtype)
    behav = torch.tensor([[1e4, -1e4, 0.0], [-50.0, 0.0, float("nan")]], dtype=dtype)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=dtype)
    for loss, _ in [
        ppo_loss(logp, prox, adv, mask),
        ppo_loss(logp, prox, adv, mask, ratio_level="sequence"),
        decoupled_ppo_loss(logp, prox, behav, adv, mask),
        decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_cap=5.0, behav_clip="ratio"),
        decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_clip="mask"),
        sg_policy_loss(logp, behav, adv, mask),
    ]:
        grad, = torch.autograd.grad(loss, logp)
        assert bool(torch.isfinite(loss)) and bool(torch.isfinite(grad).all())


def test_all_masked_batch_gives_zero_loss_with_a_graph():
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, metrics = ppo_loss(logp, torch.zeros(2, 3), torch.ones(2), mask)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(logp.grad.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="loss_denominator"):
        ppo_loss(logp, torch.zeros(2, 3), torch.ones(2), mask, loss_denominator=0)

"""rollout_is_weights against the naive reference; veto, empty rows, extreme log-ratios."""

import math

import pytest
import torch

from megatron_darl.algo import rollout_is_weights
from tests.helpers import algo_reference as ref

SHAPES = [(1, 1), (3, 5), (6, 17)]


@pytest.mark.parametrize("b,t", SHAPES)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode,lower", [("truncate", None), ("mask", None), ("clip", 0.3), ("mask", 0.0)])
def test_weights_match_reference(b, t, level, mode, lower):
    _, prox, behav, _, mask, _ = ref.rand_inputs(b, t, seed=b * t, scale=0.6, empty_rows=[0] if b > 2 else ())
    got, metrics = rollout_is_weights(prox, behav, mask, level=level, mode=mode, threshold=1.8,
                                      threshold_lower=lower, veto_threshold=0.05)
    want = ref.is_weights(prox.tolist(), behav.tolist(), mask.tolist(), level=level,
                          mode="truncate" if mode == "truncate" else "mask",
                          threshold=1.8, lower=lower, veto=0.05)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    assert all(k.startswith("algo/is/") for k in metrics)
    assert bool((got[~mask] == 0).all())


def test_veto_zeroes_the_whole_row_and_counts_it():
    prox = torch.zeros(3, 4)
    behav = torch.zeros(3, 4)
    behav[1, 2] = 10.0  # exp(-10) < 1e-4: catastrophic token
    behav[2, 3] = 10.0  # same, but off the mask: must not veto
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 3] = False
    w, metrics = rollout_is_weights(prox, behav, mask)
    assert torch.equal(w[1], torch.zeros(4))
    assert torch.equal(w[0], torch.ones(4)) and torch.equal(w[2, :3], torch.ones(3))
    assert math.isclose(float(metrics["algo/is/frac_vetoed"]), 1 / 3, rel_tol=1e-6)
    w_off, _ = rollout_is_weights(prox, behav, mask, veto_threshold=None)
    assert float(w_off[1, 0]) == 1.0


def test_truncation_fraction_and_cap():
    prox = torch.log(torch.tensor([[1.0, 3.0, 0.5, 2.5]]))
    behav = torch.zeros(1, 4)
    w, metrics = rollout_is_weights(prox, behav, torch.ones(1, 4, dtype=torch.bool), threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.5, 2.0]]))
    assert math.isclose(float(metrics["algo/is/frac_truncated"]), 0.5)
    w, metrics = rollout_is_weights(prox, behav, torch.ones(1, 4, dtype=torch.bool), mode="mask",
                                    threshold=2.0, veto_threshold=None)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 0.5, 0.0]]))
    assert math.isclose(float(metrics["algo/is/frac_masked"]), 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_extreme_log_ratios_stay_finite(dtype, level, mode):
    prox = torch.tensor([[0.0, -1e4, 300.0, -80.0], [1e4, 1e4, 1e4, 1e4], [-3e38, 0.0, 0.0, 0.0]], dtype=dtype)
    behav = torch.tensor([[-1e4, 0.0, -300.0, 0.0], [-1e4, -1e4, -1e4, -1e4], [0.0, 0.0, 0.0, 0.0]], dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    prox[1, 3] = float("nan")  # padding garbage must not leak
    w, metrics = rollout_is_weights(prox, behav, mask, level=level, mode=mode, threshold=5.0, veto_threshold=None)
    assert bool(torch.isfinite(w).all()) and all(bool(torch.isfinite(v)) for v in metrics.values())
    assert float(w.max()) <= 5.0


def test_weights_carry_no_gradient():
    prox = torch.randn(2, 3, requires_grad=True)
    w, _ = rollout_is_weights(prox, torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool))
    assert not w.requires_grad


def test_bad_options_are_named():
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="level"):
        rollout_is_weights(x, x, m, level="word")
    with pytest.raises(ValueError, match="mode"):
        rollout_is_weights(x, x, m, mode="soft")
    with pytest.raises(ValueError, match="threshold_lower"):
        rollout_is_weights(x, x, m, threshold=2.0, threshold_lower=3.0)
    with pytest.raises(ValueError, match="behav_logp"):
        rollout_is_weights(x, torch.zeros(2, 4), m)

"""Engine-learner mismatch figures against a naive per-token loop: mean and max |b - p|, the k3
KL(mu || pi), the share of ratios outside the PPO clip at lr = 0, and the token share whose
version the learner has at hand (the proximal version or a kept snapshot)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_darl.algo import learner_logp_at_behavior_version, mismatch_metrics


def _naive(p, b, mask, at_hand, lo, hi) -> dict[str, float]:
    diffs, total = [], 0
    for i in range(p.shape[0]):
        for j in range(p.shape[1]):
            if mask[i][j]:
                total += 1
                if at_hand[i][j]:
                    diffs.append(float(p[i][j]) - float(b[i][j]))
    out = {"algo/mismatch_tokens_frac": len(diffs) / total}
    if diffs:
        ratios = [math.exp(d) for d in diffs]
        out.update({
            "algo/mismatch_abs_mean": sum(abs(d) for d in diffs) / len(diffs),
            "algo/mismatch_abs_max": max(abs(d) for d in diffs),
            # r - 1 - l as expm1(l) - l: exp(l) - 1 alone cancels to nothing at l ~ 1e-6
            "algo/mismatch_kl": sum(math.expm1(d) - d for d in diffs) / len(diffs),
            "algo/mismatch_clip_frac": sum(r < 1 - lo or r > 1 + hi for r in ratios) / len(diffs),
        })
    return out


def _case(seed: int = 0, scale: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    b = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    p = b + torch.randn(6, 9, generator=g, dtype=torch.float64) * scale
    mask = torch.rand(6, 9, generator=g) > 0.2
    at_hand = torch.rand(6, 9, generator=g) > 0.4
    return p, b, mask, at_hand


@pytest.mark.parametrize(("scale", "lo", "hi"), [(0.3, 0.2, 0.2), (0.3, 0.2, 0.28), (1e-6, 0.2, 0.2)])
def test_metrics_equal_a_naive_per_token_loop(scale, lo, hi):
    p, b, mask, at_hand = _case(scale=scale)
    got = mismatch_metrics(p, b, mask, at_hand, clip_low=lo, clip_high=hi)
    want = _naive(p, b, mask, at_hand, lo, hi)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-18), k
    if scale > 0.1:
        assert 0 < got["algo/mismatch_clip_frac"] < 1 and got["algo/mismatch_kl"] > 0
    else:  # the fp32 engine's case: nothing clipped, KL ~ l^2 / 2 resolved in float64
        assert got["algo/mismatch_clip_frac"] == 0 and 0 < got["algo/mismatch_kl"] < 1e-11


def test_float32_inputs_keep_the_small_kl_resolved():
    p, b, mask, at_hand = _case(scale=1e-4)
    got = mismatch_metrics(p.float(), b.float(), mask, at_hand)
    want = _naive(p.float().double(), b.float().double(), mask, at_hand, 0.2, 0.2)
    assert got["algo/mismatch_kl"] == pytest.approx(want["algo/mismatch_kl"], rel=1e-6)


def test_no_token_at_hand_reports_only_the_share():
    p, b, mask, _ = _case()
    assert mismatch_metrics(p, b, mask, torch.zeros_like(mask)) == {"algo/mismatch_tokens_frac": 0.0}
    assert mismatch_metrics(p, b, torch.zeros_like(mask)) == {"algo/mismatch_tokens_frac": 0.0}


def test_learner_logp_is_taken_at_each_tokens_own_version():
    g = torch.Generator().manual_seed(3)
    prox, snap = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    versions = torch.tensor([[7, 7, 6, 6, 5]] * 4)
    logp, at_hand = learner_logp_at_behavior_version(prox, versions, 7, {6: snap})
    for i in range(4):
        for j in range(5):
            v = int(versions[i, j])
            assert bool(at_hand[i, j]) == (v in (6, 7))
            assert float(logp[i, j]) == (float(prox[i, j]) if v == 7 else float(snap[i, j]) if v == 6 else 0.0)
    _, none = learner_logp_at_behavior_version(prox, versions, None)
    assert not none.any()
    with pytest.raises(ValueError, match="token_versions has shape"):
        learner_logp_at_behavior_version(prox, versions[:, :3], 7)

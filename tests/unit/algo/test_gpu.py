"""The algo functions on CUDA give the CPU results and keep every tensor on the device."""

import pytest
import torch

from megatron_darl.algo import (
    behavior_clip_fraction,
    darl_policy_loss,
    decoupled_ppo_loss,
    diagnostics,
    group_scores,
    grpo_advantages,
    pmis_batch_constants,
    pmis_statistics,
    select_groups,
    variance_scores,
)
from tests.helpers import algo_reference as ref

pytestmark = pytest.mark.gpu


def _on(device, *ts):
    return [t.to(device) for t in ts]


@pytest.mark.parametrize("kw", [dict(), dict(pmis="tokens", is_level="sequence"), dict(behav_clip="ratio"),
                                dict(surrogate="sg")])
def test_cuda_matches_cpu(kw):
    cpu = ref.rand_inputs(16, 64, seed=31, scale=0.5, empty_rows=[3], dtype=torch.float32)
    results = {}
    for dev in ("cpu", "cuda"):
        logp, prox, behav, adv, mask, versions = _on(dev, *cpu)
        logp = logp.clone().requires_grad_(True)
        loss, metrics = darl_policy_loss(logp, prox, behav, adv, mask, versions, **kw)
        grad, = torch.autograd.grad(loss, logp)
        assert loss.device.type == dev and grad.device.type == dev
        results[dev] = (loss.detach().cpu(), grad.cpu(), {k: float(v) for k, v in metrics.items()})
    torch.testing.assert_close(results["cuda"][0], results["cpu"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results["cuda"][1], results["cpu"][1], rtol=1e-5, atol=1e-7)
    assert results["cuda"][2].keys() == results["cpu"][2].keys()


def test_cuda_micro_batches_and_helpers():
    logp, prox, behav, adv, mask, versions = _on("cuda", *ref.rand_inputs(12, 32, seed=32, dtype=torch.float32))
    beta, counts, _ = pmis_batch_constants(prox, behav, mask, versions)
    full, _ = darl_policy_loss(logp, prox, behav, adv, mask, versions)
    parts = sum(darl_policy_loss(logp[s], prox[s], behav[s], adv[s], mask[s], versions[s], beta=beta,
                                 version_token_counts=counts)[0] for s in (slice(0, 5), slice(5, 12)))
    torch.testing.assert_close(parts, full, rtol=1e-5, atol=1e-6)
    assert decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_weight_cap=5.0)[0].is_cuda
    ks, stats = pmis_statistics(versions, torch.ones_like(prox), mask)
    assert stats.is_cuda  # ready for an NCCL all_reduce
    out = diagnostics(prox, behav, mask, versions, current_version=3)
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in out.values())
    groups = torch.arange(12, device="cuda") // 4
    assert grpo_advantages(torch.rand(12, device="cuda"), groups).is_cuda
    _, gs, gv = group_scores(variance_scores(prox, behav, mask), groups, versions)
    assert select_groups(gs, gv, batch_groups=2).numel() == 2
    assert select_groups(gs, gv, batch_groups=2, never_trained=gv == gv.max()).numel() == 2
    assert behavior_clip_fraction(logp, behav, adv, mask, den=float(mask.sum())).is_cuda
    anchored, _ = darl_policy_loss(logp, prox, behav, adv, mask, versions, anchor="behavior")
    on_cpu, _ = darl_policy_loss(*[t.cpu() for t in (logp, prox, behav, adv, mask, versions)], anchor="behavior")
    torch.testing.assert_close(anchored.cpu(), on_cpu, rtol=1e-5, atol=1e-6)

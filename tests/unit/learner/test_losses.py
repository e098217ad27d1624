"""The train step's loss heads: micro-batch losses (and gradients) add up to the minibatch's,
for every policy loss, and a beta passed by the loop is used as given."""

import numpy as np
import pytest
import torch

from megatron_darl.algo.config import AlgoConfig
from megatron_darl.learner.packing import micro_batch
from megatron_darl.learner.train_step import minibatch_constants, policy_loss
from tests.helpers import learner_worker as W

CPU = torch.device("cpu")


def _split_pmis(kw):
    """`pmis` is the learner's beta mode (from algo.pmis_beta), not an AlgoConfig field."""
    kw = dict(kw)
    return kw.pop("pmis", "ess"), kw


def _setup(policy: str, **kw):
    batch = W.make_batch()
    rng = np.random.RandomState(1)
    batch.prox_logprobs = (batch.behav_logprobs
                           + 0.2 * rng.randn(*batch.tokens.shape) * batch.loss_mask).astype(np.float32)
    algo = AlgoConfig(policy_loss=policy, **kw)
    logp = torch.tensor(batch.prox_logprobs + 0.1 * rng.randn(*batch.tokens.shape), dtype=torch.float32)
    return batch, algo, logp


def _loss(algo, consts, batch, rows, logp_full):
    mb = micro_batch(batch, rows, CPU)
    width = mb["tokens"].shape[1]
    logp = logp_full[torch.as_tensor(rows), :width]
    return policy_loss(algo, consts, mb, logp, torch.ones_like(logp))


@pytest.mark.parametrize("policy,kw", [
    ("ppo", {"old_logprob": "behavior"}), ("ppo", {"rollout_is": "sequence"}), ("decoupled", {"behav_clip": 3.0}),
    ("darl", {}), ("darl", {"pmis": "tokens", "ratio_level": "sequence"}), ("sg_weight", {"old_logprob": "behavior"}),
    ("decoupled", {"entropy_coef": 0.01}),
])
def test_micro_batch_losses_and_grads_add_up(policy, kw):
    pmis, kw = _split_pmis(kw)
    batch, algo, logp = _setup(policy, **kw)
    rows = np.arange(batch.batch_size)
    consts, _ = minibatch_constants(algo, batch, rows, None, pmis)
    whole_logp = logp.clone().requires_grad_()
    whole, metrics = _loss(algo, consts, batch, rows, whole_logp)
    whole.backward()
    parts_logp = logp.clone().requires_grad_()
    total, summed = 0.0, {}
    for part in (np.array([0, 5]), np.array([1, 2, 7]), np.array([3, 4, 6])):
        loss, m = _loss(algo, consts, batch, part, parts_logp)
        loss.backward()
        total += float(loss)
        for k, v in m.items():
            summed[k] = summed.get(k, 0.0) + float(v)
    assert abs(total - float(whole)) < 1e-6
    assert torch.allclose(parts_logp.grad, whole_logp.grad, atol=1e-7)
    assert float(whole_logp.grad.abs().sum()) > 0
    for k in ("train/loss", "train/entropy"):
        assert abs(summed[k] - float(metrics[k])) < 1e-6, k


def test_loop_beta_is_used_as_given():
    batch, algo, logp = _setup("darl")
    rows = np.arange(batch.batch_size)
    computed, _ = minibatch_constants(algo, batch, rows, None, "tokens")
    given, metrics = minibatch_constants(algo, batch, rows, dict(computed["beta"]), "tokens")
    assert given["beta"] == computed["beta"] and metrics == {}
    same = float(_loss(algo, given, batch, rows, logp)[0])
    assert abs(same - float(_loss(algo, computed, batch, rows, logp)[0])) < 1e-7
    skewed, _ = minibatch_constants(algo, batch, rows, {2: 0.9, 3: 0.1}, "tokens")
    assert abs(float(_loss(algo, skewed, batch, rows, logp)[0]) - same) > 1e-4


def test_missing_proximal_logprobs_is_refused():
    from megatron_darl.learner.train_step import train_step

    batch = W.make_batch()
    with pytest.raises(ValueError, match="prox_logprobs"):
        train_step([], None, None, batch, AlgoConfig(policy_loss="darl"), None, pg=None, device=CPU,
                   temperature=1.0, vocab_size=256)

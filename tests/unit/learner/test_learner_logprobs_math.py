"""Vocab-parallel log-prob/entropy function against torch's log_softmax (values and gradients)."""

import torch

from megatron_darl.learner.logprobs import VocabParallelLogProbs, token_logprobs


def _reference(z, target):
    logp_all = torch.log_softmax(z, -1)
    return logp_all.gather(-1, target[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


def test_values_and_gradients_match_log_softmax():
    torch.manual_seed(0)
    n, v, valid = 7, 13, 11  # two trailing padding columns, excluded from the softmax
    z = (torch.randn(n, v, dtype=torch.float64) * 3).requires_grad_()
    target = torch.randint(0, valid, (n,))
    g1, g2 = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    lp, ent = VocabParallelLogProbs.apply(z, target, 0, valid, None)
    (lp * g1 + ent * g2).sum().backward()
    z_ref = z.detach()[:, :valid].clone().requires_grad_()
    lp_ref, ent_ref = _reference(z_ref, target)
    (lp_ref * g1 + ent_ref * g2).sum().backward()
    assert torch.allclose(lp, lp_ref, atol=1e-10) and torch.allclose(ent, ent_ref, atol=1e-10)
    assert torch.allclose(z.grad[:, :valid], z_ref.grad, atol=1e-10)
    assert torch.all(z.grad[:, valid:] == 0)  # padding logits get no gradient


def test_temperature_and_alignment():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 8)
    tokens = torch.randint(0, 8, (2, 5))
    lp, ent = token_logprobs(logits, tokens, 0.7, 8, None)
    assert lp.shape == (2, 5) and torch.all(lp[:, 0] == 0) and torch.all(ent[:, 0] == 0)
    ref = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert torch.allclose(lp[:, 1:], ref, atol=1e-6)

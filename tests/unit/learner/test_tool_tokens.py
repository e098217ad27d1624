"""Multi-turn responses: the learner trains only the tokens the policy sampled. A batch made from
trajectories whose responses hold tool output (`policy_mask` 0) goes through the train step's
loss heads (`minibatch_constants`, `micro_batch`, `policy_loss`); its loss equals a naive
per-token reference summed over policy tokens only, the gradient is exactly 0 on tool tokens,
and whatever the tool tokens' log-probs are (current, proximal) changes nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_darl.algo.config import AlgoConfig
from megatron_darl.learner.packing import micro_batch
from megatron_darl.learner.train_step import minibatch_constants, policy_loss
from megatron_darl.types import Trajectory, make_train_batch
from tests.helpers import algo_reference as ref

CPU = torch.device("cpu")


def _episodes(seed: int = 0) -> list[Trajectory]:
    """Two groups of 2: a response of policy turns with 0-2 tool outputs between them."""
    rng = np.random.RandomState(seed)
    out = []
    for i, layout in enumerate(([1] * 3 + [0] * 4 + [1] * 5, [1] * 9, [1] * 2 + [0] * 3 + [1] * 2 + [0] * 2 + [1],
                                [1] * 4 + [0] * 6 + [1] * 2)):
        mask = np.array(layout, np.uint8)
        n = len(mask)
        versions = np.where(mask > 0, 5 - i % 2, -1)
        logp = np.where(mask > 0, -2.0 + 0.5 * rng.randn(n), 0.0)
        out.append(Trajectory(rng.randint(0, 200, 3), rng.randint(0, 200, n), logp, versions,
                              float(rng.rand()), 10 + i, 20 + i // 2, policy_mask=mask))
    return out


def _batch(seed: int = 0):
    trajs = _episodes(seed)
    batch = make_train_batch(trajs, np.array([0.9, -0.9, 0.4, -0.4], np.float32))
    rng = np.random.RandomState(seed + 1)
    batch.prox_logprobs = (batch.behav_logprobs + 0.3 * rng.randn(*batch.tokens.shape) * batch.loss_mask).astype(
        np.float32)
    logp = torch.tensor(batch.prox_logprobs + 0.2 * rng.randn(*batch.tokens.shape), dtype=torch.float32)
    return trajs, batch, logp


def _tool_positions(trajs: list[Trajectory], width: int) -> np.ndarray:
    tool = np.zeros((len(trajs), width), bool)
    for i, t in enumerate(trajs):
        p = len(t.prompt_ids)
        tool[i, p:p + len(t.response_ids)] = t.policy_mask == 0
    return tool


def _loss(algo: AlgoConfig, batch, logp: torch.Tensor, pmis: str = "ess"):
    rows = np.arange(batch.batch_size)
    consts, _ = minibatch_constants(algo, batch, rows, None, pmis)
    mb = micro_batch(batch, rows, CPU)
    return policy_loss(algo, consts, mb, logp[:, :mb["tokens"].shape[1]], torch.zeros_like(logp))


def test_the_batch_masks_tool_output_and_keeps_it_as_context():
    trajs, batch, _ = _batch()
    tool = _tool_positions(trajs, batch.tokens.shape[1])
    assert tool.sum() == 4 + 5 + 6 and (batch.loss_mask[tool] == 0).all()
    assert (batch.token_versions[tool] == -1).all() and (batch.behav_logprobs[tool] == 0).all()
    assert batch.num_response_tokens == sum(t.num_policy_tokens for t in trajs) == 8 + 9 + 5 + 6
    for i, t in enumerate(trajs):  # the tokens themselves are in the sequence the learner reads
        np.testing.assert_array_equal(batch.tokens[i, 3:3 + len(t.response_ids)], t.response_ids)


@pytest.mark.parametrize("policy,kw", [("ppo", {"old_logprob": "behavior"}), ("decoupled", {})])
def test_loss_equals_a_naive_reference_over_policy_tokens(policy, kw):
    trajs, batch, logp = _batch()
    algo = AlgoConfig(policy_loss=policy, **kw)
    loss, _ = _loss(algo, batch, logp)
    m = (batch.loss_mask > 0).tolist()
    adv = batch.advantages.tolist()
    q, p, b = logp.double().tolist(), batch.prox_logprobs.tolist(), batch.behav_logprobs.tolist()
    want = ref.ppo(q, b, adv, m) if policy == "ppo" else ref.decoupled(q, p, b, adv, m)
    assert math.isclose(float(loss), want, rel_tol=1e-5, abs_tol=1e-7)
    # the same loss counted wrongly, over every response token, differs: the test can fail
    every = [[bool(x) or bool(y) for x, y in zip(r, tr)] for r, tr in zip(m, _tool_positions(trajs, len(m[0])))]
    wrong = ref.ppo(q, b, adv, every) if policy == "ppo" else ref.decoupled(q, p, b, adv, every)
    assert abs(wrong - want) > 1e-3


@pytest.mark.parametrize("policy,kw,pmis", [
    ("ppo", {"old_logprob": "behavior"}, "ess"), ("decoupled", {}, "ess"), ("darl", {}, "ess"),
    ("darl", {}, "tokens"), ("darl", {"ratio_level": "sequence"}, "ess"),
    ("sg_weight", {"old_logprob": "behavior"}, "ess"),
])
def test_tool_tokens_get_no_gradient_and_move_nothing(policy, kw, pmis):
    trajs, batch, logp = _batch(3)
    tool = torch.as_tensor(_tool_positions(trajs, batch.tokens.shape[1]))
    algo = AlgoConfig(policy_loss=policy, **kw)
    x = logp.clone().requires_grad_()
    loss, metrics = _loss(algo, batch, x, pmis)
    loss.backward()
    assert torch.isfinite(loss) and x.grad[tool].abs().max() == 0 and x.grad[~tool].abs().max() > 0
    # other values at the tool positions: current and proximal log-probs of tokens never sampled
    moved = logp.clone()
    moved[tool] = -30.0
    batch.prox_logprobs = np.where(tool.numpy(), 3.0, batch.prox_logprobs).astype(np.float32)
    again, metrics2 = _loss(algo, batch, moved, pmis)
    assert float(again) == float(loss)
    assert {k: float(v) for k, v in metrics2.items()} == {k: float(v) for k, v in metrics.items()}

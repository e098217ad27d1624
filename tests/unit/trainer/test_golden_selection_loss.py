"""Selection and loss on a fixed candidate batch are what they were before the feed, the gate
and the candidate pool changed (what a step consumes): golden values recorded with the code of
main at 796f699 (`choose_groups`, `minibatch_constants`, `policy_loss` on one minibatch)."""

import numpy as np
import pytest
import torch

from megatron_darl.algo.config import AlgoConfig
from megatron_darl.learner.packing import micro_batch
from megatron_darl.learner.train_step import minibatch_constants, minibatch_share, policy_loss
from megatron_darl.trainer.batching import candidate_batch, choose_groups, take_groups
from megatron_darl.trainer.replay_store import Candidates, ReplayGroup
from megatron_darl.types import Trajectory

GOLDEN = {
    "chosen": [13, 14, 15, 7, 12, 8, 11, 9, 10, 4],
    "tau": 0.07772551402449608,
    "darl_ess_loss": -0.028502438217401505,
    "darl_ess_beta": {4: 0.10299699747063937, 5: 0.5041210240104654, 6: 0.39288197851889534},
    "darl_tokens_loss": -0.027709148824214935,
    "darl_tokens_beta": {4: 0.10738255033557047, 5: 0.5167785234899329, 6: 0.37583892617449666},
    "decoupled_loss": -0.029519779607653618,
}


def _candidates() -> Candidates:
    rng = np.random.default_rng(20240611)
    groups = []
    for i, v in enumerate([3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 5, 6, 6, 6, 6]):
        trajs = []
        for m in range(4):
            n = int(rng.integers(2, 7))
            trajs.append(Trajectory(rng.integers(3, 40, 4), rng.integers(3, 40, n), -1.0 - rng.random(n),
                                    np.full(n, v), float(rng.integers(0, 2)), 100 * i + m, 1000 + i))
        groups.append(ReplayGroup(1000 + i, v, trajs))
    return Candidates(6, groups)


def _fixed():
    cands = _candidates()
    batch = candidate_batch(cands, AlgoConfig(policy_loss="darl"))
    rng = np.random.default_rng(7)
    drift = 0.15 * (cands.step - batch.versions)[:, None]
    batch.prox_logprobs = ((batch.behav_logprobs + (drift + 0.2) * rng.normal(size=batch.tokens.shape))
                           * batch.loss_mask).astype(np.float32)
    logp = torch.tensor(batch.prox_logprobs + 0.05 * rng.normal(size=batch.tokens.shape), dtype=torch.float32)
    return cands, batch, logp


def test_selection_and_loss_on_a_fixed_candidate_batch_are_unchanged():
    cands, batch, logp = _fixed()
    published = AlgoConfig(sg=True, warmup=0, sg_quantile=0.9, sg_new_first=False)  # ranked together by score
    chosen, metrics = choose_groups(batch, cands, 10, published, cands.step)
    assert chosen.tolist() == GOLDEN["chosen"]
    assert metrics["algo/select/tau"] == pytest.approx(GOLDEN["tau"], rel=1e-12)
    train = take_groups(batch, chosen)
    order = np.concatenate([np.flatnonzero(batch.group_index == p) for p in chosen])
    rows = np.arange(train.batch_size)
    mb = micro_batch(train, rows, torch.device("cpu"))
    lp = logp[torch.as_tensor(order)][:, : mb["tokens"].shape[1]]
    for loss, pmis, key in (("darl", "ess", "darl_ess"), ("darl", "tokens", "darl_tokens"),
                            ("decoupled", "ess", "decoupled")):
        a = AlgoConfig(policy_loss=loss, trust_anchor="proximal", ppo_n_minibatches=1)  # the goldens' anchor
        whole, _ = minibatch_constants(a, train, rows, None, pmis)
        value = float(policy_loss(a, minibatch_share(whole, train, rows), mb, lp, torch.ones_like(lp))[0])
        assert value == pytest.approx(GOLDEN[f"{key}_loss"], rel=1e-5, abs=1e-8), key
        if loss == "darl":
            assert whole["beta"] == pytest.approx(GOLDEN[f"{key}_beta"], rel=1e-9)

"""One step's batch: selection recomputes proximal log-probs for every candidate (it scores them);
FIFO baselines choose first and recompute only the groups they train, with the same result."""

from dataclasses import replace

import numpy as np
import pytest

from megatron_darl.algo.config import AlgoConfig
from megatron_darl.config import RunConfig
from megatron_darl.trainer.batching import candidate_batch, choose_groups, prepare_batch, take_groups
from megatron_darl.trainer.replay_store import Candidates, ReplayGroup
from megatron_darl.types import Trajectory


class FakeLearner:
    """The learner calls prepare_batch makes; log-probs: behavior plus a per-prompt drift."""

    is_main, pmis = True, "ess"

    def __init__(self):
        self.recomputed: list[int] = []  # rows of each compute_logprobs call

    def broadcast_batch(self, batch):
        return batch

    def measures_mismatch(self, step):
        return False

    def compute_logprobs(self, batch):
        self.recomputed.append(batch.batch_size)
        drift = 0.05 * (batch.prompt_ids % 7)[:, None] * batch.loss_mask
        return (batch.behav_logprobs + drift).astype(np.float32)


def _cands() -> Candidates:
    rng = np.random.default_rng(3)
    groups = []
    for i, v in enumerate([2, 2, 3, 3, 4]):
        trajs = [Trajectory(rng.integers(3, 30, 3), rng.integers(3, 30, 4), -1.0 - rng.random(4), np.full(4, v),
                            float(m % 2), 10 * i + m, 100 + i) for m in range(4)]
        groups.append(ReplayGroup(100 + i, v, trajs, reuse=int(i == 0)))
    return Candidates(4, groups)


def _cfg(**window) -> RunConfig:
    cfg = RunConfig()
    cfg.train.batch_prompts = 3
    cfg.algo = AlgoConfig(**{"warmup": 0, **window}, policy_loss="ppo", old_logprob="proximal", rollout_is="token")
    return cfg


def test_fifo_recomputes_only_the_groups_it_trains():
    cands, learner = _cands(), FakeLearner()
    cfg = _cfg(replay=False, sg=False, pmis=False)
    train, chosen, metrics = prepare_batch(cfg, learner, cands, step=4)
    assert chosen.tolist() == [1, 2, 3] and learner.recomputed == [12]  # 3 groups x 4, not all 5 groups
    # (never-trained groups first: the reused group 0 does not crowd them out)
    full = candidate_batch(cands, cfg.algo)
    full.prox_logprobs = FakeLearner().compute_logprobs(full)
    want = take_groups(full, chosen)  # what recomputing every candidate first would have trained
    for name in ("tokens", "loss_mask", "advantages", "behav_logprobs", "prox_logprobs", "group_index"):
        np.testing.assert_array_equal(getattr(train, name), getattr(want, name), err_msg=name)
    assert metrics["perf/recompute_s"] >= 0 and metrics["perf/select_s"] >= 0
    assert metrics["algo/select/reused_admitted"] == 1.0  # FIFO takes every reused candidate
    # a loss without proximal log-probs (naive async) recomputes nothing
    cfg.algo = replace(cfg.algo, old_logprob="behavior", rollout_is=None, recompute_proximal=False)
    learner = FakeLearner()
    train, _, _ = prepare_batch(cfg, learner, cands, step=4)
    assert learner.recomputed == [] and train.prox_logprobs is None
    # unless it asks for them (recompute_proximal, the default): the drift diagnostics read them
    cfg.algo = replace(cfg.algo, recompute_proximal=True)
    learner = FakeLearner()
    train, _, _ = prepare_batch(cfg, learner, cands, step=4)
    assert learner.recomputed == [12]
    np.testing.assert_array_equal(train.prox_logprobs, want.prox_logprobs)


def test_selection_recomputes_every_candidate_and_chooses_as_before():
    cands, learner = _cands(), FakeLearner()
    cfg = _cfg(sg=True, sg_quantile=0.5)
    train, chosen, metrics = prepare_batch(cfg, learner, cands, step=4)
    assert learner.recomputed == [20]  # every candidate: selection scores them
    full = candidate_batch(cands, cfg.algo)
    full.prox_logprobs = FakeLearner().compute_logprobs(full)
    want_chosen, want_metrics = choose_groups(full, cands, 3, cfg.algo, 4)
    assert chosen.tolist() == want_chosen.tolist()
    np.testing.assert_array_equal(train.prox_logprobs, take_groups(full, chosen).prox_logprobs)
    assert metrics["algo/select/tau"] == pytest.approx(want_metrics["algo/select/tau"])
    assert {"perf/recompute_s", "perf/select_s", "algo/select/reused_admitted"} <= metrics.keys()

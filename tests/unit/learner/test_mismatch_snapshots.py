"""`learner.mismatch_every`: the learner keeps the weights of the versions a measuring step may
train (and no others), rescores a batch with them exactly as the learner of that version did,
restores its live weights, and refuses copies above the snapshot budget."""

import numpy as np
import pytest
import torch

from megatron_darl.learner import snapshots
from tests.helpers import learner_worker as W


def _learner(hf_dir, every, eta):
    from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_darl.learner.megatron_learner import MegatronLearner

    return MegatronLearner(ModelConfig(hf_dir=hf_dir, dtype="fp32", spec="local"), ParallelConfig(),
                           OptimConfig(lr=3e-3, grad_clip=1.0),
                           LearnerConfig(micro_batch_tokens=96, mismatch_every=every),
                           W.learner_algo("ppo", old_logprob="behavior", max_head_offpolicyness=eta), seed=1)


@pytest.mark.timeout(120)
def test_measuring_steps_rescore_with_the_versions_they_may_train(tmp_path, one_rank):
    hf = W.tiny_qwen3(str(tmp_path / "hf"))
    learner = _learner(hf, every=3, eta=2)
    assert learner.balance_mode is None and learner.snapshots is not None
    assert [s for s in range(8) if learner.measures_mismatch(s)] == [0, 3, 6]
    batch = W.make_batch()
    seen, kept = {}, {}
    for step in range(6):
        seen[step] = learner.compute_logprobs(batch)  # what version `step` scores
        train = W.make_batch()
        train.prox_logprobs = learner.compute_logprobs(train)
        learner.train_step(train)
        kept[step + 1] = learner.snapshots.versions
    # the steps that measure (3 and 6) may train tokens of the eta = 2 versions before them
    assert kept == {1: [], 2: [1], 3: [1, 2], 4: [2], 5: [4], 6: [4, 5]}
    live = [p.detach().clone() for c in learner.chunks for p in c.parameters()]
    got = learner.compute_version_logprobs(batch, [3, 4, 5, 6])
    assert sorted(got) == [4, 5, 6]  # version 3 was never kept: no measuring step trains it
    for v in (4, 5):
        np.testing.assert_array_equal(got[v], seen[v])
    assert np.abs(got[4] - got[6]).max() > 1e-3  # training moved the policy: the check can fail
    assert all(torch.equal(p, s) for p, s in zip((p for c in learner.chunks for p in c.parameters()), live))
    learner.close(keep_world=True)
    off = _learner(hf, every=0, eta=2)
    assert off.snapshots is None and not off.measures_mismatch(0)
    off.close(keep_world=True)


@pytest.mark.timeout(120)
def test_copies_above_the_budget_are_refused_naming_the_key(tmp_path, one_rank, monkeypatch):
    hf = W.tiny_qwen3(str(tmp_path / "hf"))
    monkeypatch.setattr(snapshots, "SNAPSHOT_BUDGET_BYTES", 1024)
    from megatron_darl.learner import megatron_learner

    monkeypatch.setattr(megatron_learner, "SNAPSHOT_BUDGET_BYTES", 1024)
    with pytest.raises(ValueError, match=r"learner\.mismatch_every=1 keeps CPU copies .* "
                                         r"algo\.max_head_offpolicyness=2 versions.*set learner\.mismatch_every=0"):
        _learner(hf, every=1, eta=2)

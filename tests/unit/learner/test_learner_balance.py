"""`pmis=balance` in the learner: kept snapshots rescore the batch exactly (against fresh learners
built from each exported version), the live weights come back bit for bit, one version is plain
IS, interpolation is flagged, and micro-batch losses add up."""

import socket

import numpy as np
import pytest
import torch

import learner_worker as W
from megatron_darl import algo
from megatron_darl.learner.api import AlgorithmConfig
from megatron_darl.learner.packing import micro_batch
from megatron_darl.learner.snapshots import SNAPSHOT_BUDGET_BYTES, PolicySnapshots, choose_mode
from megatron_darl.learner.train_step import minibatch_constants, policy_loss

CPU = torch.device("cpu")


def _batch(versions):
    batch = W.make_batch()
    rng = np.random.RandomState(2)
    batch.versions = np.asarray(versions, np.int64)
    noise = 0.3 * rng.randn(*batch.tokens.shape) * batch.loss_mask
    batch.prox_logprobs = (batch.behav_logprobs + noise).astype(np.float32)
    logp = torch.tensor(batch.prox_logprobs + 0.1 * rng.randn(*batch.tokens.shape), dtype=torch.float32)
    return batch, logp


def _loss(a, consts, batch, rows, logp_full):
    mb = micro_batch(batch, rows, CPU)
    logp = logp_full[torch.as_tensor(rows), : mb["tokens"].shape[1]]
    return policy_loss(a, consts, mb, logp, torch.ones_like(logp))


def test_choose_mode_and_snapshot_window():
    assert choose_mode("auto", 4, SNAPSHOT_BUDGET_BYTES // 4) == "exact"
    assert choose_mode("auto", 4, SNAPSHOT_BUDGET_BYTES // 4 + 1) == "interpolate"
    assert choose_mode("interpolate", 1, 1) == "interpolate" and choose_mode("exact", 99, 1 << 40) == "exact"
    with pytest.raises(ValueError, match="balance_snapshots"):
        choose_mode("sometimes", 1, 1)
    p = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    snaps = PolicySnapshots(p, k=2)
    values = []
    for v in range(4):  # keep before each "step", as MegatronLearner.train_step does
        snaps.keep(v)
        values.append([t.detach().clone() for t in p])
        with torch.no_grad():
            for t in p:
                t.add_(torch.randn_like(t))
        snaps.prune(v + 1)
    assert snaps.versions == [2, 3] and 1 not in snaps  # version 4 is live: 4 - 2 = 2 is the oldest kept
    live = [t.detach().clone() for t in p]
    with snaps.swapped(2):
        assert all(torch.equal(t, s) for t, s in zip(p, values[2]))
    assert all(torch.equal(t, s) for t, s in zip(p, live))


def test_balance_on_one_version_is_plain_is():
    batch, logp = _batch([3] * 8)
    a = AlgorithmConfig(policy_loss="darl", rollout_is="token")
    rows = np.arange(batch.batch_size)
    tok, _ = minibatch_constants(a, batch, rows, None, "tokens")
    bal, metrics = minibatch_constants(a, batch, rows, None, "balance", prox_version=5)
    assert metrics["algo/balance_interpolated"] == 0.0  # a row's own version is its behavior b
    ref, _ = _loss(a, tok, batch, rows, logp)
    got, _ = _loss(a, bal, batch, rows, logp)
    assert abs(float(got) - float(ref)) < 1e-7 and abs(float(ref)) > 1e-4


def test_interpolation_is_flagged_and_exact_versions_are_used():
    batch, logp = _batch([3, 3, 2, 2, 3, 3, 2, 2])
    a = AlgorithmConfig(policy_loss="darl", ppo_n_minibatches=1)
    rows = np.arange(batch.batch_size)
    interp, m = minibatch_constants(a, batch, rows, None, "balance", prox_version=4)
    assert m["algo/balance_exact"] == 0.0 and m["algo/balance_interpolated"] == 2.0
    # naive reference: darl_policy_loss on the whole batch with the interpolated log mu_k, own version = b
    t = lambda x: torch.as_tensor(x, dtype=torch.float32)  # noqa: E731
    prox, behav, vers = t(batch.prox_logprobs), t(batch.behav_logprobs), torch.as_tensor(batch.versions)
    by_v = algo.interpolate_version_logp(prox, behav, vers, 4, [2, 3])
    ref, _ = algo.darl_policy_loss(logp, prox, behav, t(batch.advantages), t(batch.loss_mask) > 0, vers,
                                   pmis="balance", behav_logp_by_version=by_v)
    assert abs(float(_loss(a, interp, batch, rows, logp)[0]) - float(ref)) < 1e-6
    # exact log mu_k given for both versions: flagged exact, and they change the loss
    rng = np.random.RandomState(5)
    batch.behav_logprobs_by_version = {k: (batch.prox_logprobs + 0.5 * rng.randn(*batch.tokens.shape))
                                       .astype(np.float32) for k in (2, 3)}
    exact, m = minibatch_constants(a, batch, rows, None, "balance", prox_version=4)
    assert m["algo/balance_exact"] == 1.0 and m["algo/balance_interpolated"] == 0.0
    whole_logp = logp.clone().requires_grad_()
    whole, _ = _loss(a, exact, batch, rows, whole_logp)
    assert abs(float(whole) - float(ref)) > 1e-4
    whole.backward()
    parts_logp, total = logp.clone().requires_grad_(), 0.0
    for part in (np.array([0, 5]), np.array([1, 2, 7]), np.array([3, 4, 6])):  # micro-batches add up
        loss, _ = _loss(a, exact, batch, part, parts_logp)
        loss.backward()
        total += float(loss)
    assert abs(total - float(whole)) < 1e-6
    assert torch.allclose(parts_logp.grad, whole_logp.grad, atol=1e-7)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _learner(hf_dir, **kw):
    from megatron_darl.learner.api import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_darl.learner.megatron_learner import MegatronLearner

    return MegatronLearner(ModelConfig(hf_dir=hf_dir, dtype="fp32", spec="local"), ParallelConfig(),
                           OptimConfig(lr=3e-3, grad_clip=1.0), LearnerConfig(micro_batch_tokens=96),
                           AlgorithmConfig(policy_loss="darl", ppo_n_minibatches=1), temperature=0.9, seed=1,
                           pmis="balance", **kw)


@pytest.mark.timeout(120)
def test_kept_snapshots_rescore_like_fresh_learners(tmp_path, monkeypatch):
    import torch.distributed as dist

    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(k, v)
    torch.set_num_threads(1)
    hf = W.tiny_qwen3(str(tmp_path / "hf"))
    batch = W.make_batch()
    batch.versions = np.array([0, 0, 1, 1, 2, 2, 1, 1], np.int64)
    try:
        learner = _learner(hf, balance_snapshots="auto", replay_k=2)
        assert learner.balance_mode == "exact"  # a tiny model: K copies fit the budget
        for v in (0, 1):
            learner.export_hf(str(tmp_path / f"v{v}"))
            train = W.make_batch()
            train.versions = np.minimum(batch.versions, v)  # behavior versions are never ahead
            train.prox_logprobs = learner.compute_logprobs(train)
            train.behav_logprobs_by_version = learner.compute_version_logprobs(train, [0])
            m = learner.train_step(train)
            assert m["algo/balance_exact"] == 1.0  # version 0 is live (step 0) or kept (step 1)
        live = [p.detach().clone() for c in learner.chunks for p in c.parameters()]
        got = learner.compute_version_logprobs(batch, [0, 1, 2])
        sent = learner.broadcast_batch(W.make_batch())  # broadcast carries the per-version arrays
        assert sent.behav_logprobs_by_version is None
        batch.behav_logprobs_by_version = got
        sent = learner.broadcast_batch(batch)
        assert sorted(sent.behav_logprobs_by_version) == [0, 1, 2]
        assert all(np.array_equal(sent.behav_logprobs_by_version[v], got[v]) for v in got)
        batch.behav_logprobs_by_version = None
        assert all(torch.equal(p, s) for p, s in zip((p for c in learner.chunks for p in c.parameters()), live))
        np.testing.assert_array_equal(got[2], learner.compute_logprobs(batch))
        assert np.abs(got[0] - got[2]).max() > 1e-3  # training moved the policy: the check can fail
        learner.close(keep_world=True)
        for v in (0, 1):
            fresh = _learner(str(tmp_path / f"v{v}"), balance_snapshots="interpolate", replay_k=2)
            assert fresh.balance_mode == "interpolate" and fresh.snapshots is None
            np.testing.assert_allclose(got[v], fresh.compute_logprobs(batch), atol=1e-5, rtol=0)
            if v == 1:  # interpolate mode keeps nothing and trains; older versions are flagged
                fresh.step = 2  # as if resumed at step 2
                assert fresh.compute_version_logprobs(batch, [0, 1]) == {}
                batch.prox_logprobs = fresh.compute_logprobs(batch)
                m = fresh.train_step(batch)
                assert m["algo/balance_exact"] == 0.0 and m["algo/balance_interpolated"] == 2.0
            fresh.close(keep_world=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

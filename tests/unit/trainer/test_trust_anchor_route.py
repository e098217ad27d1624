"""What `algo.trust_anchor` reaches: the train step's loss head with a config, not the maths alone.
D-ARL anchored at the behavior policy with one version and beta = tokens is naive async PPO (loss
and gradient); anchored at the balance mixture it clips against sum_k alpha_k mu_k of the kept
snapshots; and every cell reports the clip fraction against b."""

import math

import numpy as np
import pytest
import torch

from megatron_darl.algo.config import AlgoConfig
from megatron_darl.learner.packing import micro_batch
from megatron_darl.learner.train_step import minibatch_constants, minibatch_share, policy_loss
from megatron_darl.types import TrainBatch

BASELINE = dict(replay=False, sg=False, pmis=False)


def _batch(versions, seed=3) -> TrainBatch:
    rng = np.random.default_rng(seed)
    b, width, prompt = len(versions), 9, 2
    versions = np.asarray(versions)
    mask = np.zeros((b, width), np.float32)
    for i in range(b):
        mask[i, prompt:prompt + int(rng.integers(2, width - prompt + 1))] = 1.0
    behav = np.where(mask > 0, -1.5 - rng.random((b, width)), 0.0).astype(np.float32)
    prox = np.where(mask > 0, behav + rng.normal(0.0, 0.5, (b, width)), 0.0).astype(np.float32)
    return TrainBatch(tokens=rng.integers(0, 30, (b, width)), lengths=np.full(b, width), loss_mask=mask,
                      advantages=rng.normal(size=b).astype(np.float32), behav_logprobs=behav,
                      token_versions=np.where(mask > 0, versions[:, None], -1), versions=versions,
                      group_index=np.repeat(np.arange(b // 2), 2), rewards=rng.random(b).astype(np.float32),
                      prompt_ids=np.arange(b), prox_logprobs=prox)


def _head(a: AlgoConfig, batch: TrainBatch, logp: torch.Tensor, pmis="tokens", prox_version=None):
    rows = np.arange(batch.batch_size)
    whole, _ = minibatch_constants(a, batch, rows, None, pmis, prox_version)
    mb = micro_batch(batch, rows, torch.device("cpu"))
    x = logp[:, : mb["tokens"].shape[1]].clone().requires_grad_(True)
    loss, metrics = policy_loss(a, minibatch_share(whole, batch, rows), mb, x, torch.zeros_like(x))
    (grad,) = torch.autograd.grad(loss, x)
    return float(loss.detach()), grad, {k: float(v) for k, v in metrics.items()}


def _logp(batch: TrainBatch, seed=1) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.tensor(batch.behav_logprobs + rng.normal(0.0, 0.4, batch.behav_logprobs.shape), dtype=torch.float32)


def test_behavior_anchored_darl_with_one_version_and_token_beta_is_naive_async_ppo():
    batch = _batch([5] * 8)
    logp = _logp(batch)
    darl = AlgoConfig(policy_loss="darl", trust_anchor="behavior", pmis_beta="tokens", k=1, sg=False,
                      ppo_n_minibatches=1)
    naive = AlgoConfig(policy_loss="ppo", old_logprob="behavior", ppo_n_minibatches=1, **BASELINE)
    assert darl.check() == [] and naive.check() == []
    d_loss, d_grad, d_m = _head(darl, batch, logp)
    n_loss, n_grad, n_m = _head(naive, batch, logp)
    assert d_loss == pytest.approx(n_loss, rel=1e-6)
    torch.testing.assert_close(d_grad, n_grad, rtol=1e-6, atol=1e-9)
    published, _, p_m = _head(AlgoConfig(policy_loss="darl", trust_anchor="proximal", pmis_beta="tokens",
                                         ppo_n_minibatches=1), batch, logp)
    assert abs(published - n_loss) > 1e-3  # the proximal-anchored form is another loss
    # the clip against b, in every cell: naive's own clip fraction, and the same figure for the others
    assert d_m["algo/clip_frac_behavior"] == pytest.approx(n_m["algo/clip_frac"]) and n_m["algo/clip_frac"] > 0
    assert n_m["algo/clip_frac_behavior"] == pytest.approx(n_m["algo/clip_frac"])
    assert p_m["algo/clip_frac_behavior"] == pytest.approx(n_m["algo/clip_frac"])
    assert p_m["algo/clip_frac"] != pytest.approx(n_m["algo/clip_frac"])


def test_mixture_anchor_clips_against_the_balance_mixture_of_the_kept_snapshots():
    batch = _batch([3, 3, 3, 3, 4, 4, 4, 4], seed=8)
    rng = np.random.default_rng(2)
    m = batch.loss_mask > 0
    snap = {k: np.where(m, batch.behav_logprobs + rng.normal(0.0, 0.3, m.shape), 0.0).astype(np.float32)
            for k in (3, 4)}
    batch.behav_logprobs_by_version = snap
    logp = _logp(batch, seed=4)
    a = AlgoConfig(policy_loss="darl", trust_anchor="mixture", pmis_beta="balance", ppo_n_minibatches=1)
    assert a.check() == []
    loss, _, _ = _head(a, batch, logp, pmis="balance", prox_version=5)
    # naive: alpha_k = N_k / N by token version; a token's own version density is its b
    n_k = {k: float((m & (batch.token_versions == k)).sum()) for k in (3, 4)}
    total, adv = sum(n_k.values()), batch.advantages
    acc = 0.0
    for i, j in zip(*np.nonzero(m)):
        own = int(batch.token_versions[i, j])
        mix = sum(n_k[k] / total * math.exp(float(batch.behav_logprobs[i, j] if k == own else snap[k][i, j]))
                  for k in (3, 4))
        r = math.exp(float(logp[i, j]) - math.log(mix))
        acc += min(r * adv[i], min(max(r, 0.8), 1.2) * adv[i])
    assert loss == pytest.approx(-acc / total, rel=1e-5)
    behav, _, _ = _head(AlgoConfig(policy_loss="darl", trust_anchor="behavior", pmis_beta="balance",
                                   ppo_n_minibatches=1), batch, logp, pmis="balance", prox_version=5)
    assert abs(behav - loss) > 1e-4  # the mixture is not each sample's own b: the check can fail


def _learner_step(hf_dir: str, a: AlgoConfig, batch: TrainBatch):
    """One `MegatronLearner.train_step` (real Megatron-Core on gloo, two optimizer steps) from the
    same weights: (metrics, parameters after it)."""
    from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
    from megatron_darl.learner.megatron_learner import MegatronLearner

    learner = MegatronLearner(ModelConfig(hf_dir=hf_dir, dtype="fp32", spec="local"), ParallelConfig(),
                              OptimConfig(lr=1e-3, grad_clip=1.0), LearnerConfig(micro_batch_tokens=64), a,
                              temperature=1.0, seed=3)
    try:
        batch.prox_logprobs = learner.compute_logprobs(batch)
        metrics = learner.train_step(batch)
        return metrics, {n: p.detach().clone() for c in learner.chunks for n, p in c.named_parameters()}
    finally:
        learner.close(keep_world=True)


@pytest.mark.timeout(300)
def test_a_real_learner_step_anchored_at_the_behavior_policy_is_naive_async_ppo(tmp_path, monkeypatch):
    import torch.distributed as dist

    from megatron_darl.channel.ports import free_port
    from tests.helpers import learner_worker as W

    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    torch.set_num_threads(1)
    hf = W.tiny_qwen3(str(tmp_path / "hf"))
    batch = W.make_batch()  # two behavior versions, behavior log-probs far from the model's: the clip acts
    darl = AlgoConfig(policy_loss="darl", trust_anchor="behavior", pmis_beta="tokens", k=1, sg=False)
    naive = AlgoConfig(policy_loss="ppo", old_logprob="behavior", **BASELINE)
    try:
        m_naive, p_naive = _learner_step(hf, naive, batch)
        m_darl, p_darl = _learner_step(hf, darl, batch)
        m_pub, p_pub = _learner_step(hf, AlgoConfig(policy_loss="darl", trust_anchor="proximal", pmis_beta="tokens",
                                                    k=1, sg=False), batch)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert m_naive["train/grad_norm"] > 0 and m_naive["algo/clip_frac"] > 0
    assert m_darl["train/loss"] == pytest.approx(m_naive["train/loss"], rel=1e-5, abs=1e-7)
    assert m_darl["train/grad_norm"] == pytest.approx(m_naive["train/grad_norm"], rel=1e-5)
    for name in p_naive:
        torch.testing.assert_close(p_darl[name], p_naive[name], rtol=1e-5, atol=1e-6, msg=name)
    assert m_darl["algo/clip_frac_behavior"] == pytest.approx(m_naive["algo/clip_frac"])
    # naive async logs the drift figures of every cell: ESS and KL of exp(p - b)
    assert 0 < m_naive["algo/ess_frac"] < 1 and m_naive["algo/kl_k3"] > 0
    # the proximal-anchored form is another update: the comparison can fail
    assert abs(m_pub["train/grad_norm"] - m_naive["train/grad_norm"]) > 1e-4 * m_naive["train/grad_norm"]


def test_d_arl_without_an_anchor_set_trains_the_behavior_anchored_loss():
    batch = _batch([3, 3, 4, 4, 5, 5, 5, 5], seed=5)
    logp = _logp(batch, seed=4)
    kw = dict(policy_loss="darl", pmis_beta="ess", ppo_n_minibatches=1)
    default, d_grad, _ = _head(AlgoConfig(**kw), batch, logp, pmis="ess")
    behavior, b_grad, _ = _head(AlgoConfig(trust_anchor="behavior", **kw), batch, logp, pmis="ess")
    proximal, _, _ = _head(AlgoConfig(trust_anchor="proximal", **kw), batch, logp, pmis="ess")
    assert AlgoConfig(**kw).trust_anchor is None and AlgoConfig(**kw).anchor == "behavior"
    assert default == behavior and torch.equal(d_grad, b_grad)
    assert abs(default - proximal) > 1e-3  # the other anchor is another loss: the check can fail

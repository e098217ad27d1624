"""K=1, selection off, `pmis=tokens` D-ARL clipped at the proximal policy
(`algo.trust_anchor=proximal`) is the decoupled (verl-style) objective, in the learner and end to
end through the training loop's data path. (At its default anchor, `behavior`, it is naive async
PPO instead: tests/unit/trainer/test_trust_anchor_route.py.)

The D-ARL side is the CPU demo recipe with those overrides, as `darl-train` hands it to the
learner (`AlgoConfig.effective_pmis_beta`: `algo.pmis_beta` sets the learner's beta_k). Through
`MegatronLearner.train_step` (the learner's own loss dispatch, micro-batching and
optimizer), the same batch and the same starting weights give the same `train/loss`, gradient
norm and updated parameters for
  - `policy_loss=darl, pmis=tokens` with token-level rollout IS truncated at 2, and
  - `policy_loss=ppo, old_logprob=proximal, rollout_is=token, rollout_is_mode=truncate,
    rollout_is_threshold=2` (verl's decoupled PPO).
The batch mixes three behavior versions with perturbed behavior log-probs, so the per-version
normalisation and the truncation both act (with one version the check would be weaker), and a
third run with `pmis=ess` must differ: the comparison can fail.

End to end (`test_k1_loop_trains_what_decoupled_trains`): `trainer.loop.train_loop` itself, with the
real replay feed and store, a real learner and a scripted ring standing in for generation,
trains the same groups in the same order with the same losses and the same final weights, and
reports the same consumption to the staleness gate. What differs, stated and tested in
tests/unit/replay/test_consumption.py: a straggler group older than the K=1 window when it
arrives is aged out by D-ARL (counted in `replay/evicted_untrained`, and replaced by generation)
and trained by decoupled PPO, which has no window.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron_darl.algo.config import AlgoConfig
from megatron_darl.channel.ports import free_port
from megatron_darl.config.learner import LearnerConfig, ModelConfig, OptimConfig, ParallelConfig
from megatron_darl.types import TrainBatch
from tests.helpers import REPO

# the D-ARL recipe with K=1, selection off, pmis_beta=tokens, the proximal anchor, token IS truncated at 2
DARL_K1_TOKENS = ["algo.k=1", "algo.sg=false", "algo.pmis=true", "algo.pmis_beta=tokens", "algo.trust_anchor=proximal",
                  "algo.policy_loss=darl", "algo.rollout_is=token", "algo.rollout_is_mode=truncate",
                  "algo.rollout_is_threshold=2.0", "algo.ppo_n_minibatches=2"]


def loss_configs() -> tuple[AlgoConfig, str, AlgoConfig]:
    """(D-ARL's loss config and beta_k rule as a run hands them to the learner, verl-style
    decoupled PPO with the same other settings)."""
    from megatron_darl.config import load_config

    cfg = load_config(os.path.join(REPO, "configs", "cpu_demo_darl.yaml"), DARL_K1_TOKENS)
    darl, pmis = cfg.algo, cfg.algo.effective_pmis_beta
    assert darl.policy_loss == "darl" and pmis == "tokens"
    decoupled = replace(darl, policy_loss="ppo", old_logprob="proximal", rollout_is="token",
                        rollout_is_mode="truncate", rollout_is_threshold=2.0, pmis=False)
    return darl, pmis, decoupled


def make_batch(vocab: int, seed: int = 0) -> TrainBatch:
    """6 groups x 4 responses; group g has behavior version g % 3 (a K=1 pool spans versions
    only through staleness); prompt 5 tokens, responses 3..8 tokens."""
    rng = np.random.default_rng(seed)
    groups, g_size, prompt = 6, 4, 5
    b = groups * g_size
    resp = rng.integers(3, 9, size=b)
    lengths = prompt + resp
    width = int(lengths.max())
    tokens = np.zeros((b, width), dtype=np.int64)
    mask = np.zeros((b, width), dtype=np.float32)
    tver = np.full((b, width), -1, dtype=np.int64)
    versions = np.repeat(np.arange(groups) % 3, g_size).astype(np.int64)
    for i in range(b):
        tokens[i, : lengths[i]] = rng.integers(4, vocab, size=lengths[i])
        mask[i, prompt: lengths[i]] = 1.0
        tver[i, prompt: lengths[i]] = versions[i]
    rewards = rng.integers(0, 2, size=b).astype(np.float32)
    group_index = np.repeat(np.arange(groups), g_size)
    adv = np.zeros(b, dtype=np.float32)
    for g in range(groups):
        r = rewards[group_index == g]
        adv[group_index == g] = (r - r.mean()) / (r.std() + 1e-6) if r.std() > 0 else rng.normal(size=g_size)
    return TrainBatch(tokens=tokens, lengths=lengths.astype(np.int64), loss_mask=mask, advantages=adv,
                      behav_logprobs=np.zeros((b, width), dtype=np.float32), token_versions=tver,
                      versions=versions, group_index=group_index.astype(np.int64), rewards=rewards,
                      prompt_ids=(1000 + group_index).astype(np.int64))


def train_once(hf_dir: str, algo_cfg: AlgoConfig, batch: TrainBatch | None, seed: int = 3):
    """A fresh learner from `hf_dir`: (metrics, parameters after the step, batch used)."""
    from megatron_darl.learner.megatron_learner import MegatronLearner

    learner = MegatronLearner(ModelConfig(hf_dir=hf_dir, init="hf", dtype="fp32", spec="local"), ParallelConfig(),
                              OptimConfig(lr=1e-3, grad_clip=1.0), LearnerConfig(micro_batch_tokens=64),
                              algo_cfg, temperature=1.0, seed=seed)
    try:
        if batch is None:
            batch = make_batch(learner.vocab_size)
            prox = learner.compute_logprobs(batch)
            # behavior = proximal perturbed per version: staler versions drift more; some
            # tokens then have weights above the cap 2 (truncated) and some far below
            rng = np.random.default_rng(1)
            noise = rng.normal(scale=0.25 * (1 + batch.versions[:, None]), size=prox.shape)
            batch.behav_logprobs = ((prox + noise) * batch.loss_mask).astype(np.float32)
        batch.prox_logprobs = learner.compute_logprobs(batch)
        metrics = learner.train_step(batch)
        params = {n: p.detach().clone() for c in learner.chunks for n, p in c.named_parameters()}
        return metrics, params, batch
    finally:
        learner.close(keep_world=True)


@pytest.mark.timeout(120)
def test_darl_tokens_k1_equals_verl_decoupled(warm_model, monkeypatch):
    import torch.distributed as dist

    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    torch.set_num_threads(1)
    try:
        darl, pmis, decoupled = loss_configs()
        m_dec, p_dec, batch = train_once(warm_model, decoupled, None)
        w = np.exp(batch.prox_logprobs - batch.behav_logprobs)[batch.loss_mask > 0]
        assert (w > 2).any() and (w < 0.5).any(), "the batch must exercise the truncation"
        m_darl, p_darl, _ = train_once(warm_model, darl, batch)
        m_ess, p_ess, _ = train_once(warm_model, replace(darl, pmis_beta="ess"), batch)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

    assert m_dec["train/grad_norm"] > 0
    assert m_darl["train/loss"] == pytest.approx(m_dec["train/loss"], rel=1e-5, abs=1e-7)
    assert m_darl["train/grad_norm"] == pytest.approx(m_dec["train/grad_norm"], rel=1e-5)
    assert p_dec.keys() == p_darl.keys()
    for name in p_dec:
        torch.testing.assert_close(p_darl[name], p_dec[name], rtol=1e-5, atol=1e-6, msg=name)
    # the check has teeth: inverse-variance beta_k weighs the versions differently
    assert abs(m_ess["train/grad_norm"] - m_dec["train/grad_norm"]) > 1e-4 * m_dec["train/grad_norm"]


def test_run_config_decides_the_learner_beta():
    """`algo.pmis_beta` / `algo.pmis` reach the learner's loss (balance included); an
    unknown beta_k rule is refused by name."""
    from megatron_darl.config import load_config
    from megatron_darl.learner.megatron_learner import MegatronLearner

    demo = os.path.join(REPO, "configs", "cpu_demo_darl.yaml")

    def beta(*overrides: str) -> str:
        return load_config(demo, list(overrides)).algo.effective_pmis_beta

    assert beta("algo.pmis_beta=ess") == "ess" and beta("algo.pmis_beta=tokens") == "tokens"
    assert beta("algo.pmis=false", "algo.pmis_beta=ess") == "tokens" and beta("algo.pmis_beta=balance") == "balance"
    with pytest.raises(ValueError, match="uniform"):
        MegatronLearner(ModelConfig(hf_dir="unused"), ParallelConfig(), OptimConfig(), LearnerConfig(),
                        AlgoConfig(pmis_beta="uniform"))


class _ScriptedRing:
    """Generation stand-in: the groups scripted for step s become readable once version s is
    published (step 0's from the start), in script order."""

    def __init__(self, schedule: dict):
        self.schedule, self.queue = schedule, list(schedule.get(0, []))

    def release(self, version: int) -> None:
        self.queue.extend(self.schedule.get(version, []))

    def get_trajectory(self, timeout: float = 0.0):
        return self.queue.pop(0) if self.queue else None


class _Publisher:
    def __init__(self, ring: _ScriptedRing):
        self.ring, self.last_publish_s, self.notices = ring, 0.0, []

    def publish(self, version: int, consumed=None, new_groups=None) -> None:
        self.notices.append((version, consumed, new_groups))
        self.ring.release(version)

    def rollout_metrics(self) -> dict:
        return {}


class _Telemetry:
    def __init__(self):
        self.trained, self.logged = [], []

    def record_trained(self, step: int, prompt_ids) -> None:
        self.trained.append((step, list(prompt_ids)))

    def log(self, step: int, metrics: dict) -> None:
        self.logged.append((step, dict(metrics)))


def _schedule(vocab: int, steps: int, batch: int, group: int, seed: int = 5) -> dict:
    """`batch` groups of `group` responses per step: every other one was begun by the previous
    version (generation runs ahead of training), so each step's pool mixes two versions."""
    from megatron_darl.types import Trajectory

    rng = np.random.default_rng(seed)
    out, gid = {}, 0
    for step in range(steps):
        out[step] = []
        for _ in range(batch):
            for m in range(group):
                n = int(rng.integers(3, 7))
                version = max(0, step - gid % 2)
                out[step].append(Trajectory(rng.integers(4, vocab, 4), rng.integers(4, vocab, n),
                                            -2.0 - 0.4 * rng.random(n), np.full(n, version), float(m % 2),
                                            1000 + gid, 1000 + gid))
            gid += 1
    return out


def _run_loop(hf_dir: str, overrides: list[str], steps: int = 4, batch: int = 3, group: int = 2):
    """train_loop with the real feed, store and learner; (telemetry, publisher, parameters)."""
    from megatron_darl.config import load_config
    from megatron_darl.learner.megatron_learner import MegatronLearner
    from megatron_darl.trainer.feed import ReplayFeed
    from megatron_darl.trainer.loop import Trainer, train_loop
    from megatron_darl.trainer.replay_store import ReplayStore

    cfg = load_config(os.path.join(REPO, "configs", "cpu_demo_darl.yaml"),
                      overrides + [f"train.steps={steps}", f"train.batch_prompts={batch}",
                                   f"rollout.group_size={group}", "checkpoint.every_steps=0",
                                   "algo.max_head_offpolicyness=1"])
    learner = MegatronLearner(ModelConfig(hf_dir=hf_dir, init="hf", dtype="fp32", spec="local"), ParallelConfig(),
                              OptimConfig(lr=1e-3, grad_clip=1.0), LearnerConfig(micro_batch_tokens=64),
                              cfg.algo, temperature=1.0, seed=cfg.train.seed)
    try:
        ring = _ScriptedRing(_schedule(learner.vocab_size, steps, batch, group))
        feed = ReplayFeed(ring, ReplayStore(cfg.algo, group), batch, cfg.algo.max_head_offpolicyness)
        publisher, telemetry = _Publisher(ring), _Telemetry()
        waits = iter(range(10_000))

        def alive():
            if next(waits) >= 9_999:
                raise RuntimeError("the scripted ring ran dry: the loop waits for data never scripted")

        done = train_loop(Trainer(cfg, learner, feed, publisher, None, telemetry, 0, alive, lambda: False))
        assert done == steps
        params = {n: p.detach().clone() for c in learner.chunks for n, p in c.named_parameters()}
        return telemetry, publisher, params
    finally:
        learner.close(keep_world=True)


@pytest.mark.timeout(300)
def test_k1_loop_trains_what_decoupled_trains(warm_model, monkeypatch):
    import torch.distributed as dist

    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    torch.set_num_threads(1)
    decoupled = ["algo.replay=false", "algo.sg=false", "algo.pmis=false", "algo.policy_loss=ppo",
                 "algo.old_logprob=proximal", "algo.rollout_is=token", "algo.rollout_is_mode=truncate",
                 "algo.rollout_is_threshold=2.0", "algo.ppo_n_minibatches=2"]
    try:
        t_dec, p_dec, w_dec = _run_loop(warm_model, decoupled)
        t_darl, p_darl, w_darl = _run_loop(warm_model, DARL_K1_TOKENS)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert t_darl.trained == t_dec.trained and len(t_dec.trained) == 4  # same groups, step by step
    assert p_darl.notices == p_dec.notices == [(v, 3 * v, 3) for v in range(1, 5)]  # AReaL's gate exactly
    for (step, m_darl), (_, m_dec) in zip(t_darl.logged, t_dec.logged):
        assert m_dec["train/grad_norm"] > 0
        assert m_darl["train/loss"] == pytest.approx(m_dec["train/loss"], rel=1e-5, abs=1e-7), step
        assert m_darl["train/grad_norm"] == pytest.approx(m_dec["train/grad_norm"], rel=1e-5), step
        assert m_darl["replay/trained_frac"] == m_dec["replay/trained_frac"] == 1.0
    for name in w_dec:
        torch.testing.assert_close(w_darl[name], w_dec[name], rtol=1e-5, atol=1e-6, msg=name)

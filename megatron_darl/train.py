"""The asynchronous training loop: read this file to know what a step does.

What it is: `train_loop()`, what every learner rank runs: wait for rollouts, recompute proximal
log-probs, select (D-ARL) or take FIFO (baselines), train, publish the new weights, checkpoint,
log. Generation runs concurrently in the rollout manager and engines; the staleness gate there
bounds how far it runs ahead (`staleness.max_head_offpolicyness`, 0 = synchronous). Run as a
module (`python -m megatron_darl.train --run-info ...`) it is one learner rank: the launcher
(`launch/`) starts it by that name, and `learner_side.py` builds what the loop works with.
What it is not: any of the machinery it calls (learner, replay, rollout) or the placement of
processes (`launch/`, which `darl-train` enters through `launch.runner.run`).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from megatron_darl import algo
from megatron_darl.batching import candidate_batch, choose_groups, take_groups
from megatron_darl.config import RunConfig


def train_loop(cfg: RunConfig, learner, feed, publisher, checkpointer, telemetry, start: int, alive,
               preempted) -> int:
    """Steps `start`..`train.steps`; returns the number of steps done. `feed` is None off the main rank."""
    step, main = start, learner.is_main
    needs_prox = cfg.algo.uses_proximal or cfg.replay.sg
    while step < cfg.train.steps:
        t0 = time.perf_counter()
        cands = feed.wait_candidates(step, alive) if main else None           # 1. rollouts from the ring
        batch = learner.broadcast_batch(candidate_batch(cands, cfg.algo) if main else None)
        if needs_prox:                                                          # 2. proximal log-probs
            batch.prox_logprobs = learner.compute_logprobs(batch)
        chosen, metrics = choose_groups(batch, cands, cfg.train.batch_prompts, cfg.replay, step) if main \
            else (None, {})                                                     # 3. D-ARL selection / FIFO
        train = learner.broadcast_batch(take_groups(batch, chosen) if main else None)
        if learner.pmis == "balance":                                           # balance: log mu_k per kept version
            older = sorted({int(v) for v in train.versions} - {step})           # (the current one is prox itself)
            train.behav_logprobs_by_version = learner.compute_version_logprobs(train, older)
        metrics.update(learner.train_step(train))                              # 4. train (minibatches)
        if main:
            feed.store.commit(step, cands.group_ids[chosen])
            telemetry.record_trained(step, sorted(set(train.prompt_ids.tolist())))
            metrics.update(step_diagnostics(train, step, cfg.algo))
            metrics.update(feed.store.metrics())
            for k, v in publisher.rollout_metrics().items():  # generation side; the batch's own keys win
                metrics.setdefault(k, v)
        step += 1
        publisher.publish(step)                                                 # 5. version = step
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 or preempted():
            checkpointer.save(step)                                             # 6. lossless checkpoint
        metrics.update({"perf/step_s": time.perf_counter() - t0, "perf/publish_s": publisher.last_publish_s,
                        "perf/wait_data_s": feed.wait_s if main else 0.0, "train/version": step})
        telemetry.log(step - 1, metrics)                                        # 7. log
        if preempted():
            break
    return step - start


def step_diagnostics(batch, step: int, acfg) -> dict:
    """ALGORITHM.md's per-step diagnostics on the batch that was trained (behavior weights with
    the configured IS options; without proximal log-probs the weights are exactly 1)."""
    t = lambda a: torch.as_tensor(a)  # noqa: E731
    prox = batch.prox_logprobs if batch.prox_logprobs is not None else batch.behav_logprobs
    out = algo.diagnostics(t(prox), t(batch.behav_logprobs), t(batch.loss_mask), t(batch.versions),
                           level=acfg.rollout_is or "token", mode=acfg.rollout_is_mode,
                           threshold=acfg.rollout_is_threshold, threshold_lower=acfg.rollout_is_threshold_lower,
                           veto_threshold=acfg.rollout_is_veto_threshold, current_version=step)
    out = {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in out.items()}
    for v in np.unique(batch.versions):
        out[f"rollout/reward_mean/v{int(v)}"] = float(batch.rewards[batch.versions == v].mean())
    out["rollout/reward_mean"] = float(batch.rewards.mean())
    out["rollout/response_len_mean"] = float(batch.loss_mask.sum(1).mean())
    return out


if __name__ == "__main__":
    from megatron_darl.learner_side import learner_main

    raise SystemExit(learner_main())

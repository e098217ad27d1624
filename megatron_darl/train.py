"""The asynchronous training loop: read this file to know what a step does.

What it is: `train_loop()`, what every learner rank runs: wait for rollouts, recompute proximal
log-probs, select (D-ARL) or take FIFO (baselines), train, publish the new weights, checkpoint,
log. Generation runs concurrently in the rollout manager and engines; the staleness gate there
bounds how far it runs ahead (`staleness.max_head_offpolicyness`, 0 = synchronous). Run as a
module (`python -m megatron_darl.train --run-info ...`) it is one learner rank: the launcher
(`launch/`) starts it by that name, and `learner_side.py` builds what the loop works with.
What it is not: any of the machinery it calls (learner, replay, rollout) or the placement of
processes (`launch/`, which `darl-train` enters through `launch.runner.run_local` or
`launch.slurm.run_slurm`).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from megatron_darl import algo
from megatron_darl.batching import prepare_batch
from megatron_darl.config import RunConfig


def train_loop(cfg: RunConfig, learner, feed, publisher, checkpointer, telemetry, start: int, alive,
               preempted, evaluator=None) -> int:
    """Steps `start`..`train.steps`; returns the number of steps done. `feed` is None off the main rank."""
    step, main = start, learner.is_main
    while step < cfg.train.steps:
        t0 = time.perf_counter()
        cands = feed.wait_candidates(step, alive) if main else None            # 1. rollouts from the ring
        train, chosen, metrics = prepare_batch(cfg, learner, cands, step)       # 2. recompute pi_prox, select
        metrics.update(learner.train_step(train))                              # 3. train (minibatches)
        if main:  # next step's share of new groups: what the reused groups selection admits leave
            metrics.update(batch_composition(cands, chosen))                   # before commit counts the reuse
            new_groups = feed.commit(step, cands.group_ids[chosen], metrics["algo/select/reused_admitted"])
            telemetry.record_trained(step, sorted(set(train.prompt_ids.tolist())))
            metrics.update(step_diagnostics(train, step))
            metrics.update(feed.store.metrics())
            for k, v in publisher.rollout_metrics().items():  # generation side; the batch's own keys win
                metrics.setdefault(k, v)
        step += 1
        # 4. version = step; the gate credits the groups used up and plans for the next steps' new groups
        publisher.publish(step, **(dict(consumed=feed.store.consumed, new_groups=new_groups) if main else {}))
        pace_s = max(0.0, cfg.train.min_step_s - (time.perf_counter() - t0))  # train.min_step_s: a slower
        time.sleep(pace_s)                                                      # learner, for staleness experiments
        stop = preempted()  # read once a step (a signal after this counts at the next step): the
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 or stop:  # loop stops
            checkpointer.save(step)                                             # 5. only after a save
        metrics.update({"perf/step_s": time.perf_counter() - t0, "perf/publish_s": publisher.last_publish_s,
                        "perf/pace_s": pace_s,
                        "perf/wait_data_s": feed.wait_s if main else 0.0, "train/version": step})
        if evaluator is not None:                                               # held-out accuracy (eval.every_steps)
            metrics.update(evaluator.maybe_run(step, publisher))
        telemetry.log(step - 1, metrics)                                        # 6. log
        if stop:
            break
    return step - start


def batch_composition(cands, chosen) -> dict:
    """Groups the step trained (`train/batch_groups`: `train.batch_prompts` at every step, warmup
    included) and the share of them trained at an earlier step (`replay/reused_frac`). Read
    before `feed.commit`, which counts this step's training."""
    reuse = cands.reuse[np.asarray(chosen, dtype=np.int64)]
    return {"train/batch_groups": float(len(reuse)),
            "replay/reused_frac": float((reuse > 0).mean()) if len(reuse) else 0.0}


def step_diagnostics(batch, step: int) -> dict:
    """What the trained batch was made of: reward per version, response length, staleness
    histogram. The behavior-weight statistics (ESS, rho, KL, token share per version) come from
    the train step alone, computed on the weights its loss used (`learner.train_step`)."""
    out = algo.staleness_histogram(torch.as_tensor(batch.versions), step)
    for v in np.unique(batch.versions):
        out[f"rollout/reward_mean/v{int(v)}"] = float(batch.rewards[batch.versions == v].mean())
    out["rollout/reward_mean"] = float(batch.rewards.mean())
    out["rollout/response_len_mean"] = float(batch.loss_mask.sum(1).mean())
    return out


if __name__ == "__main__":
    from megatron_darl.learner_side import learner_main

    raise SystemExit(learner_main(train_loop))

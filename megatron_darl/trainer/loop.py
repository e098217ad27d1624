"""The asynchronous training loop: read this file to know what a step does.

What it is: `train_loop(trainer)`, what every trainer rank runs: wait for rollouts, recompute
proximal log-probs, select (D-ARL) or take FIFO (baselines), train, publish the new weights,
checkpoint, log. `Trainer` is what the loop works with, typed: `rank.py` builds it (and starts the
process, `python -m megatron_darl.trainer`). Generation runs concurrently in the rollout manager
and engines; the staleness gate there bounds how far it runs ahead
(`algo.max_head_offpolicyness`, 0 = synchronous).
What it is not: any of the machinery it calls (batch building, the learner, the replay feed,
publication, checkpoints) or the placement of processes (`launch/`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from megatron_darl import algo
from megatron_darl.config import RunConfig
from megatron_darl.learner.api import Learner
from megatron_darl.trainer.batching import prepare_batch

if TYPE_CHECKING:  # the real classes, for readers and type checkers; tests pass stand-ins
    from megatron_darl.eval.periodic import PeriodicEvaluator
    from megatron_darl.trainer.checkpoints import RunCheckpointer
    from megatron_darl.trainer.feed import ReplayFeed
    from megatron_darl.trainer.publication import Publisher
    from megatron_darl.trainer.replay_store import Candidates
    from megatron_darl.trainer.telemetry import Telemetry
    from megatron_darl.types import TrainBatch


@dataclass
class Trainer:
    """What the loop works with on one rank (every rank holds one; `rank.build_trainer` makes it)."""

    cfg: RunConfig
    learner: Learner  # the Megatron-Core learner; every call is collective
    feed: ReplayFeed | None  # the ring -> replay store -> a step's candidates (main rank; None elsewhere)
    publisher: Publisher  # weights out, and the notice the rollout manager reads
    checkpointer: RunCheckpointer  # the learner, the replay store and the rollout state, saved together
    telemetry: Telemetry  # TensorBoard, metrics.jsonl, progress bar (main rank)
    start_step: int  # 0, or the step of the checkpoint resumed
    wait_alive: Callable[[], None]  # called while waiting for rollouts: raises if the launcher is gone
    preempted: Callable[[], bool]  # the preemption flag, agreed by every rank
    evaluator: PeriodicEvaluator | None = None  # held-out accuracy every eval.every_steps (main rank)
    # train.max_generated_samples: whether the rollout side has generated the budget, read once a
    # step and agreed by every rank (`rank.budget_check`); None: no budget
    budget_spent: Callable[[], bool] | None = None
    stopped_on: str = "steps"  # why the loop ended: "steps" (train.steps), "samples" (the budget), "preempted"


def train_loop(t: Trainer) -> int:
    """Steps `start_step`..`train.steps`, or fewer when the sample budget is spent (the run then
    ends as at train.steps: the last version is evaluated and exported, nothing else saved);
    returns the number of steps done."""
    step, main = t.start_step, t.learner.is_main
    if t.evaluator is not None and step == 0:
        t.evaluator.evaluate_start(t.publisher)  # version 0 on the curve (sample-scheduled evaluation)
    while step < t.cfg.train.steps:
        t0 = time.perf_counter()
        cands = _wait_rollouts(t, step) if main else None  # 1. rollouts from the ring
        batch, chosen, metrics = prepare_batch(t.cfg, t.learner, cands, step)  # 2. recompute pi_prox, select
        metrics.update(t.learner.train_step(batch))  # 3. train (minibatches)
        plan = _consume(t, step, cands, chosen, batch, metrics) if main else {}
        step += 1
        t.publisher.publish(step, **plan)  # 4. version = step; the gate credits what was used up
        pace_s = max(0.0, t.cfg.demo.min_step_s - (time.perf_counter() - t0))  # a slower learner,
        time.sleep(pace_s)  # for staleness experiments
        stop = t.preempted()  # read once a step (a signal after this counts at the next step):
        spent = not stop and t.budget_spent is not None and t.budget_spent()
        if stop or t.cfg.checkpoint.every_steps and step % t.cfg.checkpoint.every_steps == 0:
            t.checkpointer.save(step)  # 5. the loop stops only after a save
        metrics.update({"perf/step_s": time.perf_counter() - t0, "perf/publish_s": t.publisher.last_publish_s,
                        "perf/probe_learner_s": getattr(t.publisher, "last_probe_s", 0.0),  # the probe's forward
                        "perf/pace_s": pace_s, "perf/wait_data_s": t.feed.wait_s if main else 0.0,
                        "train/version": step})
        if t.evaluator is not None:  # held-out accuracy (eval.every_steps / every_samples)
            metrics.update(t.evaluator.maybe_run(step, t.publisher, final=spent or step >= t.cfg.train.steps))
        t.telemetry.log(step - 1, metrics)  # 6. log
        if stop or spent:
            t.stopped_on = "preempted" if stop else "samples"
            break
    return step - t.start_step


class DataStalled(RuntimeError):
    """A step waited `train.data_wait_timeout_s` for rollouts that never came."""


def _wait_rollouts(t: Trainer, step: int) -> Candidates:
    """Main rank: the step's candidates, waiting at most `train.data_wait_timeout_s` (0: no
    bound); past it, `DataStalled` names the step, what the learner holds and the rollout
    manager's last report (a live rollout side that generates nothing, e.g. every group filtered)."""
    limit = t.cfg.train.data_wait_timeout_s or None
    try:
        return t.feed.wait_candidates(step, t.wait_alive, timeout_s=limit)
    except TimeoutError as exc:
        raise DataStalled(f"{exc}; {t.publisher.rollout_report()}. Raise train.data_wait_timeout_s (now {limit:g} s) "
                          f"if generation is this slow, or set it to 0 to wait without a bound") from None


def _consume(t: Trainer, step: int, cands: Candidates, chosen: np.ndarray, batch: TrainBatch,
             metrics: dict) -> dict:
    """Main rank, after training: commit what the step trained to the replay store, record it and
    its diagnostics, and return what the publisher tells the staleness gate (the groups used up,
    the next step's share of new groups: what the reused groups selection admits leave)."""
    metrics.update(batch_composition(cands, chosen))  # before commit, which counts this step's reuse
    new_groups = t.feed.commit(step, cands.group_ids[chosen], metrics["algo/select/reused_admitted"],
                               filtered=int(metrics.get("algo/select/filtered_groups", 0)))
    t.telemetry.record_trained(step, sorted(set(batch.prompt_ids.tolist())))
    metrics.update(step_diagnostics(batch, step))
    metrics.update(t.feed.store.metrics())
    for k, v in t.publisher.rollout_metrics().items():  # generation side; the batch's own keys win
        metrics.setdefault(k, v)
    return {"consumed": t.feed.store.consumed, "new_groups": new_groups}


def batch_composition(cands: Candidates, chosen: np.ndarray) -> dict:
    """Groups the step trained (`train/batch_groups`: `train.batch_prompts` at every step, warmup
    included) and the share of them trained at an earlier step (`replay/reused_frac`). Read
    before `feed.commit`, which counts this step's training."""
    reuse = cands.reuse[np.asarray(chosen, dtype=np.int64)]
    return {"train/batch_groups": float(len(reuse)),
            "replay/reused_frac": float((reuse > 0).mean()) if len(reuse) else 0.0}


def step_diagnostics(batch: TrainBatch, step: int) -> dict:
    """What the trained batch was made of: reward per version, response length, staleness
    histogram. The behavior-weight statistics (ESS, rho, KL, token share per version) come from
    the train step alone, computed on the weights its loss used (`learner.train_step`)."""
    out = algo.staleness_histogram(torch.as_tensor(batch.versions), step)
    for v in np.unique(batch.versions):
        out[f"rollout/reward_mean/v{int(v)}"] = float(batch.rewards[batch.versions == v].mean())
    out["rollout/reward_mean"] = float(batch.rewards.mean())
    out["rollout/response_len_mean"] = float(batch.loss_mask.sum(1).mean())
    return out

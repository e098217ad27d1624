"""The asynchronous training loop (`darl-train`): read this file to know what a step does.

What it is: `run(cfg)`, the `darl-train` entry (hands the run to the local or Slurm launcher),
`learner_main()`, the entry of every learner rank, and `train_loop()`: wait for rollouts,
recompute proximal log-probs, select (D-ARL) or take FIFO (baselines), train, publish the new
weights, checkpoint, log. Generation runs concurrently in the rollout manager and engines; the
staleness gate there bounds how far it runs ahead (`staleness.max_head_offpolicyness`, 0 =
synchronous).
What it is not: any of the machinery it calls (learner, replay, rollout, launch).
"""

from __future__ import annotations

import argparse
import json
import signal
import time
import warnings

import numpy as np
import torch

from megatron_darl import algo
from megatron_darl.batching import candidate_batch, choose_groups, take_groups
from megatron_darl.config import RunConfig, load_config


def run(cfg: RunConfig) -> int:
    """`darl-train`: launch learners, engines and the rollout manager for this config."""
    if cfg.launch.mode == "slurm":
        import sys

        print("darl-train: launch.mode=slurm (submitit placement) is not part of this version; "
              "run with launch.mode=local", file=sys.stderr)
        return 2
    from megatron_darl.launch.runner import run_local

    return run_local(cfg)


def train_loop(cfg: RunConfig, learner, feed, publisher, checkpointer, telemetry, start: int, alive,
               preempted, evaluator=None) -> int:
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
        pace_s = max(0.0, cfg.train.min_step_s - (time.perf_counter() - t0))  # train.min_step_s: a slower
        time.sleep(pace_s)                                                      # learner, for staleness experiments
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 or preempted():
            checkpointer.save(step)                                             # 6. lossless checkpoint
        metrics.update({"perf/step_s": time.perf_counter() - t0, "perf/publish_s": publisher.last_publish_s,
                        "perf/pace_s": pace_s,
                        "perf/wait_data_s": feed.wait_s if main else 0.0, "train/version": step})
        if evaluator is not None:                                               # held-out accuracy (eval.every_steps)
            metrics.update(evaluator.maybe_run(step, publisher))
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


class _Preemption:
    """SIGTERM / SIGUSR1 set a flag; the loop checkpoints and stops at the end of the step.
    Ranks agree through an all-reduce, so they all stop at the same step."""

    def __init__(self):
        self.flag = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._set)

    def _set(self, *_):
        self.flag = True

    def __call__(self) -> bool:
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            dev = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
            t = torch.tensor([1.0 if self.flag else 0.0], device=dev)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            self.flag = bool(t.item())
        return self.flag


def learner_main(argv: list[str] | None = None) -> int:
    """Entry of one learner rank (started by the launcher with torchrun-style env vars)."""
    p = argparse.ArgumentParser(prog="megatron_darl.train")
    p.add_argument("--config", required=True, help="the resolved config the launcher wrote")
    p.add_argument("--run-info", required=True, help="JSON with ring name, notice/status paths, weights root")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    if not torch.cuda.is_available():  # expected on CPU: Megatron's fallbacks are the CPU path
        warnings.filterwarnings("ignore", message=r".*(Apex is|Transformer Engine and Apex are) not installed")
    with open(args.run_info, encoding="utf-8") as fh:
        info = json.load(fh)
    from megatron_darl.launch.runner import build_learner_side

    side = build_learner_side(cfg, info)
    try:
        done = train_loop(cfg, side.learner, side.feed, side.publisher, side.checkpointer, side.telemetry,
                          side.start_step, side.alive, side.preempted, side.evaluator)
        side.finish(done)
    finally:
        side.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(learner_main())

"""One trainer rank: what it builds around the training loop, and its process entry.

What it is: `build_trainer(cfg, info)` (the learner; the ring and replay feed on the main rank;
the publisher, checkpointer, telemetry and periodic evaluator; resumed from `info.resume`),
`TrainerRank`, which runs the loop and, after it, exports the final policy, tells the rollout
side to stop and closes everything, and `main()`, the entry of every trainer rank
(`python -m megatron_darl.trainer --run-info <run_dir>/run_info.json`, with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT from the launcher). A preemption while the main rank waits for
rollouts (which may never come) does not wait for the end of a step: the wait raises `Preempted`,
the main rank tells the other ranks (`preemption.py`), and every rank checkpoints what it has
and stops.
What it is not: the loop itself (`loop.py`) or the placement of ranks (`launch/`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from megatron_darl.channel.run_info import RunInfo
from megatron_darl.config import RunConfig, load_config
from megatron_darl.trainer.loop import DataStalled, Trainer, train_loop
from megatron_darl.trainer.preemption import (
    Preempted,
    Preemption,
    StepFeed,
    StoppableLearner,
    rank_sync,
    world_size,
)
from megatron_darl.trainer.publication import NonFiniteWeights


@dataclass
class TrainerRank:
    """One rank's `Trainer`, and what the rank does around the loop."""

    trainer: Trainer
    info: RunInfo

    def run(self) -> int:
        """The loop, then `finish`; `close` always. Returns the steps done."""
        try:
            try:
                done = train_loop(self.trainer)
            except Preempted as stop:
                self.trainer.stopped_on = "preempted"
                done = self.stop_at(stop.step)
            self.finish(done)
        finally:
            self.close()
        return done

    def stop_at(self, step: int) -> int:
        """After `Preempted(step)`: every rank checkpoints `step` steps; returns the steps done."""
        t = self.trainer
        if t.learner.is_main and world_size() > 1:
            t.learner.send_stop(step)
        if t.learner.is_main:
            print(f"darl-train: preempted while waiting for rollouts at step {step}: checkpointing", flush=True)
        t.checkpointer.save(step)
        return step - t.start_step

    def finish(self, steps_done: int) -> None:
        """Every rank, after the loop: export the final policy (collective), then the main rank
        tells the rollout side to stop and records where things are."""
        t = self.trainer
        t.learner.export_hf(self.info.final_model)
        if not t.learner.is_main:
            return
        t.publisher.drain()  # distributed: the last version is sent before the sender stops
        t.publisher.notify(stop=True)
        from megatron_darl.eval.periodic import samples_generated

        summary = {"steps_done": steps_done, "final_version": t.start_step + steps_done,
                   "tensorboard": t.telemetry.tensorboard_dir, "stopped_on": t.stopped_on,
                   "samples_generated": samples_generated(t.publisher.rollout_metrics(), t.cfg.rollout.group_size)}
        with open(os.path.join(self.info.run_dir, "learner_summary.json"), "w", encoding="utf-8") as fh:
            json.dump(summary, fh)

    def close(self) -> None:
        t = self.trainer
        t.publisher.close()
        if t.evaluator is not None:
            t.evaluator.close()
        t.telemetry.close()
        if t.feed is not None:
            t.feed.ring.close()
            t.feed.ring.unlink()
        t.learner.close()


def build_trainer(cfg: RunConfig, info: RunInfo) -> TrainerRank:
    """Construct a trainer rank's objects; resumes from `info.resume` when set."""
    from megatron_darl.eval.periodic import build_periodic_evaluator
    from megatron_darl.learner.checks import check_resolved_spec
    from megatron_darl.learner.megatron_learner import MegatronLearner
    from megatron_darl.learner.model import have_te
    from megatron_darl.trainer.checkpoints import RunCheckpointer
    from megatron_darl.trainer.publication import Publisher
    from megatron_darl.trainer.telemetry import Telemetry

    preemption = Preemption()  # before the slow start: a signal during it is not lost
    check_resolved_spec(cfg, torch.cuda.is_available(), have_te())
    learner: Any = MegatronLearner(cfg.model, cfg.parallel, cfg.optim, cfg.learner, cfg.algo,
                                   temperature=cfg.rollout.temperature, seed=cfg.train.seed)
    if world_size() > 1:
        learner = StoppableLearner(learner)
    if learner.is_main and learner.balance_mode is not None:
        how = ("exact: the K previous versions' weights are kept on CPU" if learner.balance_mode == "exact" else
               "interpolated log-linearly between b and p (an approximation)")
        print(f"darl-train: algo.pmis_beta=balance, algo.balance_snapshots="
              f"{cfg.algo.balance_snapshots} -> {learner.balance_mode} ({how})", flush=True)
    feed = _main_rank_feed(cfg, info) if learner.is_main else None
    publisher = Publisher(learner, info.weights_root, info.notice, info.status, info.weight_sync,
                          sender=_weight_sender(cfg, info, learner), probe_tokens=cfg.rollout.probe_tokens)
    alive = _launcher_alive()
    if world_size() > 1:
        rank_sync(alive)  # the other ranks check the launcher while they wait for the main one
    ckpt = RunCheckpointer(learner, feed, publisher, cfg.checkpoint_dir, info.status, cfg.rollout.group_size,
                           cfg.checkpoint.keep_last, alive,
                           save_budget_s=cfg.launch.signal_before_s if cfg.launch.mode == "slurm" else None)
    start = ckpt.resume(info.resume)
    publisher.publish(start)  # engines move to the policy being trained (v0, or the resumed one)
    tele = Telemetry(cfg.train.run_dir, cfg.train.steps, start_step=start, tensorboard=cfg.logging.tensorboard,
                     jsonl=cfg.logging.jsonl, progress=cfg.logging.progress, enabled=learner.is_main,
                     histogram_every=cfg.logging.histogram_every)
    evaluator = build_periodic_evaluator(cfg, learner.is_main)
    wait_alive = _waiting_check(alive, preemption, feed)
    return TrainerRank(Trainer(cfg, learner, feed, publisher, ckpt, tele, start, wait_alive, preemption, evaluator,
                               budget_check(cfg, publisher, learner.is_main)), info)


def budget_check(cfg: RunConfig, publisher: Any, is_main: bool):
    """`train.max_generated_samples` as the loop reads it once a step: on the main rank, whether the
    rollout manager's latest status (rewritten every second, so at most that old: the stop comes
    at the first step boundary at which the count it shows reaches the budget) counts that many
    generated samples; the other ranks take the main rank's answer. None without a budget."""
    budget = cfg.train.max_generated_samples
    if budget <= 0:
        return None
    from megatron_darl.eval.periodic import samples_generated

    def spent() -> bool:
        value = None
        if is_main:
            n = samples_generated(publisher.rollout_metrics(), cfg.rollout.group_size)
            value = n is not None and n >= budget
        return bool(rank_sync().from_main(value)) if world_size() > 1 else bool(value)

    return spent


def _main_rank_feed(cfg: RunConfig, info: RunInfo) -> StepFeed:
    """The node's ring buffer (created here) and the replay feed that empties it into the store."""
    from megatron_darl.channel.shm_ring import ShmRing
    from megatron_darl.channel.shm_space import shm_space_problem
    from megatron_darl.trainer.replay_store import ReplayStore

    problem = shm_space_problem(cfg.ring.size_bytes)
    if problem:
        raise RuntimeError(problem)
    ring = ShmRing.create(info.ring, cfg.ring.size_bytes, checksum=cfg.ring.effective_checksum)
    return StepFeed(ring, ReplayStore(cfg.algo, cfg.rollout.group_size), cfg.train.batch_prompts,
                    cfg.algo.max_head_offpolicyness)


def _launcher_alive():
    """A check that raises once the launcher (this process's parent) is gone."""
    parent = os.getppid()

    def alive() -> None:
        if os.getppid() != parent:
            raise RuntimeError("the launcher is gone; stopping this trainer rank")

    return alive


def _waiting_check(alive, preemption: Preemption, feed: StepFeed | None):
    """What the main rank calls while it waits for rollouts: the launcher must live, and a
    preemption ends the wait at once (`Preempted`), whatever the rollout side does."""

    def wait_alive() -> None:
        alive()
        if preemption.flag:
            raise Preempted(feed.waiting_step if feed is not None else 0)

    return wait_alive


def _weight_sender(cfg: RunConfig, info: RunInfo, learner: Any):
    """The main rank's broadcaster of `rollout.weight_sync=distributed` (None otherwise): NCCL
    when the learner runs on GPUs, gloo on CPU; rendezvous on the learner's own address."""
    if info.weight_sync != "distributed" or not learner.is_main:
        return None
    from megatron_darl.rollout.sglang_requests import flushes_cache
    from megatron_darl.trainer.weight_sender import WeightSender

    return WeightSender(info.notice, info.master_addr, info.weights_root, learner.hf_folder_info(),
                        backend="nccl" if torch.distributed.get_backend() == "nccl" else "gloo",
                        timeout_s=cfg.rollout.weight_sync_timeout_s, api_key=cfg.rollout.api_key,
                        flush_cache=flushes_cache(cfg.rollout.pause_mode))


def main(argv: list[str] | None = None) -> int:
    """Entry of one trainer rank (started by the launcher with torchrun-style env vars)."""
    p = argparse.ArgumentParser(prog="python -m megatron_darl.trainer")
    p.add_argument("--run-info", required=True, help="the run's run_info.json (ring, notice, weights, resume)")
    p.add_argument("--config", default=None, help="a resolved config (default: the one the run info names)")
    args = p.parse_args(argv)
    info = RunInfo.load(args.run_info)
    cfg = load_config(args.config or info.config)
    if not torch.cuda.is_available():  # expected on CPU: Megatron's fallbacks are the CPU path
        warnings.filterwarnings("ignore", message=r".*(Apex is|Transformer Engine and Apex are) not installed")
    try:
        build_trainer(cfg, info).run()
    except (DataStalled, NonFiniteWeights) as exc:  # a complete message: no traceback of ours to add
        print(f"[rank{os.environ.get('RANK', '0')}] darl-train stopped: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0

"""One learner rank: the objects it holds around the training loop, and its process entry.

What it is: `build_learner_side(cfg, info)` (learner, ring + replay feed on the main rank,
publisher, checkpointer, telemetry; resumed from `info.resume`), `LearnerSide.finish/close`,
`Preemption` (SIGTERM / SIGUSR1 / SIGUSR2 set a flag the loop reads at the end of each step,
agreed by all ranks) and `learner_main()`, the entry of every learner rank
(`python -m megatron_darl.train --run-info <run_dir>/run_info.json`, environment RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher). A preemption while the main rank waits
for rollouts (which may never come) does not wait for the end of a step: the wait raises
`Preempted`, the main rank tells the other ranks (they wait for its word in the rendezvous
store, outside any collective), and every rank checkpoints what it has and stops.
What it is not: the loop itself (`train.py`) or the placement of ranks (`launch/`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_darl.config import RunConfig, load_config
from megatron_darl.replay.feed import ReplayFeed
from megatron_darl.run_info import RunInfo

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)  # Slurm: TERM on preemption, USR2 before the limit


class Preempted(Exception):
    """A preemption noticed while waiting for rollouts: checkpoint `step` steps and stop."""

    def __init__(self, step: int):
        super().__init__(f"preempted while waiting for rollouts at step {step}")
        self.step = step


class Preemption:
    """SIGTERM / SIGUSR1 / SIGUSR2 set a flag; `self()` agrees on it over all ranks (through the
    rendezvous store, `rank_sync`: the others wait there while the main rank evaluates), so every
    rank stops after the same step."""

    def __init__(self):
        self.flag = False
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._set)

    def _set(self, *_):
        self.flag = True

    def __call__(self) -> bool:
        if _world() > 1:
            self.flag = rank_sync().any(self.flag)
        return self.flag


_SYNC = []


def rank_sync(alive: Callable[[], None] | None = None):
    """This process's one `StoreSync` (one call counter for every agreement of the loop)."""
    from megatron_darl.learner.collectives import StoreSync

    if not _SYNC:
        _SYNC.append(StoreSync())
    if alive is not None:
        _SYNC[0].alive = alive
    return _SYNC[0]


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


class _StepFeed(ReplayFeed):
    """The replay feed, remembering which step it is waiting for (what a preemption in the
    wait checkpoints)."""

    waiting_step = 0

    def wait_candidates(self, step: int, alive: Callable[[], None], timeout_s: float | None = None):
        self.waiting_step = step
        return super().wait_candidates(step, alive, timeout_s)


class _StoppableLearner:
    """The learner as the loop sees it on several ranks: every batch broadcast is preceded by a
    word from the main rank saying whether to go on. Ranks other than the main one wait for it
    while the main rank waits for rollouts, in the rendezvous store, not in a collective (whose
    timeout a long first batch would exceed); a preemption noticed there reaches them as
    `Preempted`."""

    def __init__(self, learner: Any):
        self._learner = learner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._learner, name)

    def broadcast_batch(self, batch):
        control = rank_sync().from_main({"stop": False} if self._learner.is_main else None)
        if control.get("stop"):
            raise Preempted(int(control["step"]))
        return self._learner.broadcast_batch(batch)

    def send_stop(self, step: int) -> None:
        """Main rank: release the other ranks from their wait with `Preempted(step)`."""
        rank_sync().from_main({"stop": True, "step": step})


@dataclass
class LearnerSide:
    """Everything one learner rank holds during `train_loop`."""

    learner: Any
    feed: Any  # None off the main rank
    publisher: Any
    checkpointer: Any
    telemetry: Any
    start_step: int
    alive: Callable[[], None]  # raises when the launcher is gone
    preempted: Preemption
    info: RunInfo
    evaluator: Any = None  # eval/periodic.py: held-out accuracy every eval.every_steps (main rank)

    def wait_alive(self) -> None:
        """What the main rank calls while it waits for rollouts: the launcher must live, and a
        preemption ends the wait at once (`Preempted`), whatever the rollout side does."""
        self.alive()
        if self.preempted.flag:
            raise Preempted(self.feed.waiting_step)

    def stop_at(self, step: int) -> int:
        """After `Preempted(step)`: every rank checkpoints `step` steps; returns the steps done."""
        if self.learner.is_main and _world() > 1:
            self.learner.send_stop(step)
        if self.learner.is_main:
            print(f"darl-train: preempted while waiting for rollouts at step {step}: checkpointing", flush=True)
        self.checkpointer.save(step)
        return step - self.start_step

    def finish(self, steps_done: int) -> None:
        """Every rank, after the loop: export the final policy (collective), then the main rank
        tells the rollout side to stop and records where things are."""
        self.learner.export_hf(self.info.final_model)
        if not self.learner.is_main:
            return
        self.publisher.drain()  # distributed: the last version is sent before the sender stops
        self.publisher.notify(stop=True)
        summary = {"steps_done": steps_done, "final_version": self.start_step + steps_done,
                   "tensorboard": self.telemetry.tensorboard_dir}
        with open(os.path.join(self.info.run_dir, "learner_summary.json"), "w", encoding="utf-8") as fh:
            json.dump(summary, fh)

    def close(self) -> None:
        self.publisher.close()
        if self.evaluator is not None:
            self.evaluator.close()
        self.telemetry.close()
        if self.feed is not None:
            self.feed.ring.close()
            self.feed.ring.unlink()
        self.learner.close()


def learner_pmis(cfg: RunConfig) -> str:
    """D-ARL's beta_k for the learner: `replay.pmis_beta`, or "tokens" (beta_k = N_k / N, one
    collapsed token mean) when `replay.pmis` is false."""
    return cfg.replay.pmis_beta if cfg.replay.pmis else "tokens"


def build_learner_side(cfg: RunConfig, info: RunInfo) -> LearnerSide:
    """Construct a learner rank's objects; resumes from `info.resume` when set."""
    from megatron_darl.learner.megatron_learner import MegatronLearner
    from megatron_darl.publication import Publisher
    from megatron_darl.replay.shm_ring import ShmRing
    from megatron_darl.replay.shm_space import shm_space_problem
    from megatron_darl.replay.store import ReplayStore
    from megatron_darl.resume import RunCheckpointer
    from megatron_darl.telemetry import Telemetry

    from megatron_darl.learner.model import have_te
    from megatron_darl.learner.preflight import check_resolved_spec

    preempted = Preemption()  # before the slow start: a signal during it is not lost
    check_resolved_spec(cfg, torch.cuda.is_available(), have_te())
    learner = MegatronLearner(cfg.model, cfg.parallel, cfg.optim, cfg.learner, cfg.algo,
                              temperature=cfg.rollout.temperature, seed=cfg.train.seed, pmis=learner_pmis(cfg),
                              balance_snapshots=cfg.replay.balance_snapshots, replay_k=cfg.replay.k)
    if _world() > 1:
        learner = _StoppableLearner(learner)
    if learner.is_main and learner.balance_mode is not None:
        how = ("exact: the K previous versions' weights are kept on CPU" if learner.balance_mode == "exact" else
               "interpolated log-linearly between b and p (an approximation)")
        print(f"darl-train: replay.pmis_beta=balance, replay.balance_snapshots="
              f"{cfg.replay.balance_snapshots} -> {learner.balance_mode} ({how})", flush=True)
    feed = None
    if learner.is_main:
        problem = shm_space_problem(cfg.replay.ring_bytes)
        if problem:
            raise RuntimeError(problem)
        ring = ShmRing.create(info.ring, cfg.replay.ring_bytes, checksum=cfg.replay.effective_ring_checksum)
        feed = _StepFeed(ring, ReplayStore(cfg.replay, cfg.rollout.group_size), cfg.train.batch_prompts,
                         cfg.staleness.max_head_offpolicyness)
    publisher = Publisher(learner, info.weights_root, info.notice, info.status, info.weights_kind,
                          sender=_weight_sender(cfg, info, learner))
    parent = os.getppid()

    def alive() -> None:
        if os.getppid() != parent:
            raise RuntimeError("the launcher is gone; stopping this learner rank")

    if _world() > 1:
        rank_sync(alive)  # the other ranks check the launcher while they wait for the main one
    ckpt = RunCheckpointer(learner, feed, publisher, cfg.checkpoint_dir, info.status, cfg.rollout.group_size,
                           cfg.checkpoint.keep_last, alive,
                           save_budget_s=cfg.launch.signal_before_s if cfg.launch.mode == "slurm" else None)
    start = ckpt.resume(info.resume)
    publisher.publish(start)  # engines move to the policy being trained (v0, or the resumed one)
    tele = Telemetry(cfg.train.run_dir, cfg.train.steps, start_step=start, tensorboard=cfg.logging.tensorboard,
                     jsonl=cfg.logging.jsonl, progress=cfg.logging.progress, enabled=learner.is_main,
                     histogram_every=cfg.logging.histogram_every)
    from megatron_darl.eval.periodic import build_periodic_evaluator

    evaluator = build_periodic_evaluator(cfg, learner.is_main)
    return LearnerSide(learner, feed, publisher, ckpt, tele, start, alive, preempted, info, evaluator)


def _weight_sender(cfg: RunConfig, info: RunInfo, learner: Any):
    """The main rank's broadcaster of `rollout.weight_sync=distributed` (None otherwise): NCCL
    when the learner runs on GPUs, gloo on CPU; rendezvous on the learner's own address."""
    if info.weights_kind != "distributed" or not learner.is_main:
        return None
    from megatron_darl.learner.weight_sender import WeightSender

    return WeightSender(info.notice, info.master_addr, info.weights_root, learner.hf_folder_info(),
                        backend="nccl" if torch.distributed.get_backend() == "nccl" else "gloo",
                        timeout_s=cfg.rollout.weight_sync_timeout_s, api_key=cfg.rollout.api_key)


def learner_main(train_loop: Callable[..., int], argv: list[str] | None = None) -> int:
    """Entry of one learner rank (started by the launcher with torchrun-style env vars) around
    `train_loop` (train.py's, which calls this as its `__main__`: this module does not import it)."""
    p = argparse.ArgumentParser(prog="python -m megatron_darl.train")
    p.add_argument("--run-info", required=True, help="the run's run_info.json (ring, notice, weights, resume)")
    p.add_argument("--config", default=None, help="a resolved config (default: the one the run info names)")
    args = p.parse_args(argv)
    info = RunInfo.load(args.run_info)
    cfg = load_config(args.config or info.config)
    if not torch.cuda.is_available():  # expected on CPU: Megatron's fallbacks are the CPU path
        warnings.filterwarnings("ignore", message=r".*(Apex is|Transformer Engine and Apex are) not installed")
    side = build_learner_side(cfg, info)
    try:
        try:
            done = train_loop(cfg, side.learner, side.feed, side.publisher, side.checkpointer, side.telemetry,
                              side.start_step, side.wait_alive, side.preempted, side.evaluator)
        except Preempted as stop:
            done = side.stop_at(stop.step)
        side.finish(done)
    finally:
        side.close()
    return 0

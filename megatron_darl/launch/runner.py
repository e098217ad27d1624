"""Wiring of one run on one machine: what the launcher starts, and what a learner rank holds.

What it is: `run_local(cfg)` (the `darl-train` path for `launch.mode=local`): warm start,
resolved config, embedded engines (health-checked), evaluation before training, the rollout
manager, the learner ranks (torchrun-style environment, gloo on CPU), evaluation after, and a
summary; all under a `Supervisor` that stops everything if any process fails and on exit.
`build_learner_side(cfg, info)` assembles a learner rank's objects (learner, ring + replay
feed on the main rank, publisher, checkpointer, telemetry).
What it is not: the training loop (`train.py`) or Slurm placement (`slurm.py`).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from megatron_darl.config import RunConfig, save_resolved
from megatron_darl.launch.local import Supervisor

PY = sys.executable


def run_paths(cfg: RunConfig, run_id: str) -> dict[str, Any]:
    """Names and paths shared by the launcher, the manager and the learner ranks."""
    run_dir = os.path.abspath(cfg.train.run_dir)
    embedded = cfg.rollout.backend == "torch"
    kind = cfg.rollout.weight_sync if cfg.rollout.weight_sync != "auto" else ("shm" if embedded else "disk")
    weights_root = f"/dev/shm/darl-{run_id}-weights" if kind == "shm" else os.path.join(run_dir, "weights")
    return {
        "run_id": run_id,
        "run_dir": run_dir,
        "ring": cfg.replay.ring_name or f"darl-{run_id}-ring",
        "notice": os.path.join(run_dir, "rollout", "notice.json"),
        "status": os.path.join(run_dir, "rollout", "status.json"),
        "weights_root": weights_root,
        "weights_kind": kind,
        "final_model": os.path.join(run_dir, "final_model"),
    }


@dataclass
class LearnerSide:
    """Everything one learner rank holds during `train_loop`."""

    learner: Any
    feed: Any  # None off the main rank
    publisher: Any
    checkpointer: Any
    telemetry: Any
    start_step: int
    alive: Callable[[], None]
    preempted: Callable[[], bool]
    info: dict[str, Any]
    evaluator: Any = None  # eval/periodic.py, main rank with eval.every_steps > 0

    def finish(self, steps_done: int) -> None:
        """Every rank, after the loop: export the final policy (collective), then the main rank
        tells the rollout side to stop and records where things are."""
        self.learner.export_hf(self.info["final_model"])
        if not self.learner.is_main:
            return
        self.publisher.notify(stop=True)
        summary = {"steps_done": steps_done, "final_version": self.start_step + steps_done,
                   "tensorboard": self.telemetry.tensorboard_dir}
        with open(os.path.join(self.info["run_dir"], "learner_summary.json"), "w", encoding="utf-8") as fh:
            json.dump(summary, fh)

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
        self.telemetry.close()
        if self.feed is not None:
            self.feed.ring.close()
            self.feed.ring.unlink()
        self.learner.close()


def build_learner_side(cfg: RunConfig, info: dict[str, Any]) -> LearnerSide:
    """Construct a learner rank's objects; resumes from `info["resume"]` when set."""
    from megatron_darl.learner.megatron_learner import MegatronLearner
    from megatron_darl.publication import Publisher
    from megatron_darl.replay.feed import ReplayFeed
    from megatron_darl.replay.shm_ring import ShmRing
    from megatron_darl.replay.store import ReplayStore
    from megatron_darl.resume import RunCheckpointer
    from megatron_darl.telemetry import Telemetry
    from megatron_darl.train import _Preemption

    preempted = _Preemption()
    learner = MegatronLearner(cfg.model, cfg.parallel, cfg.optim, cfg.learner, cfg.algo,
                              temperature=cfg.rollout.temperature, seed=cfg.train.seed, pmis=learner_pmis(cfg),
                              balance_snapshots=cfg.replay.balance_snapshots, replay_k=cfg.replay.k)
    if learner.is_main and learner.balance_mode is not None:
        how = ("exact: the K previous versions' weights are kept on CPU" if learner.balance_mode == "exact" else
               "interpolated log-linearly between b and p (an approximation)")
        print(f"darl-train: replay.pmis_beta=balance, replay.balance_snapshots="
              f"{cfg.replay.balance_snapshots} -> {learner.balance_mode} ({how})", flush=True)
    feed = None
    if learner.is_main:
        ring = ShmRing.create(info["ring"], cfg.replay.ring_bytes, checksum=cfg.replay.effective_ring_checksum)
        feed = ReplayFeed(ring, ReplayStore(cfg.replay, cfg.rollout.group_size), cfg.train.batch_prompts)
    publisher = Publisher(learner, info["weights_root"], info["notice"], info["status"], info["weights_kind"])
    parent = os.getppid()

    def alive() -> None:
        if os.getppid() != parent:
            raise RuntimeError("the launcher is gone; stopping this learner rank")

    ckpt = RunCheckpointer(learner, feed, publisher, cfg.checkpoint_dir, info["status"], cfg.rollout.group_size,
                           cfg.checkpoint.keep_last, alive)
    start = ckpt.resume(info.get("resume"))
    publisher.publish(start)  # engines move to the policy being trained (v0, or the resumed one)
    tele = Telemetry(cfg.train.run_dir, cfg.train.steps, start_step=start, tensorboard=cfg.logging.tensorboard,
                     jsonl=cfg.logging.jsonl, progress=cfg.logging.progress, enabled=learner.is_main,
                     histogram_every=cfg.logging.histogram_every)
    from megatron_darl.eval.periodic import build_periodic_evaluator

    evaluator = build_periodic_evaluator(cfg, learner.is_main)
    return LearnerSide(learner, feed, publisher, ckpt, tele, start, alive, preempted, info, evaluator)


def learner_pmis(cfg: RunConfig) -> str:
    """D-ARL's beta_k for the learner: `replay.pmis_beta`, or "tokens" (beta_k = N_k / N, one
    collapsed token mean) when `replay.pmis` is false."""
    return cfg.replay.pmis_beta if cfg.replay.pmis else "tokens"


def learner_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}


def new_run_id() -> str:
    return uuid.uuid4().hex[:10]


def write_run_info(cfg: RunConfig, info: dict[str, Any]) -> tuple[str, str]:
    """Save the resolved config and the run info where every child can read them. A notice or
    status left by an earlier run in this folder is removed: its weights, `stop` and
    `state_request` belong to processes that are gone, and a new manager must not act on them."""
    for stale in (info["notice"], info["status"]):
        if os.path.exists(stale):
            os.unlink(stale)
    cfg_path = save_resolved(cfg, info["run_dir"])
    info_path = os.path.join(info["run_dir"], "run_info.json")
    with open(info_path, "w", encoding="utf-8") as fh:
        json.dump(info, fh, indent=1)
    return cfg_path, info_path


def run_local(cfg: RunConfig) -> int:
    """`darl-train` on one machine; returns the exit code."""
    from megatron_darl.launch.session import LocalSession

    with Supervisor(os.path.join(os.path.abspath(cfg.train.run_dir), "logs")) as sup:
        return LocalSession(cfg, sup).run()

"""Preemption of a trainer rank: a signal sets a flag, every rank agrees on it, the run saves and stops.

What it is: `Preemption` (SIGTERM / SIGUSR1 / SIGUSR2 set a flag that `train_loop` reads once a
step, agreed by all ranks through the rendezvous store), `Preempted` (raised when the flag is set
while the main rank waits for rollouts, which may never come: the wait does not last to the end
of a step), `StoppableLearner` (the learner as the loop sees it on several ranks: before every
batch broadcast, a word from the main rank that tells the others whether to go on, so a
preemption noticed in the wait reaches them too) and `StepFeed` (the replay feed remembering the
step it waits for: the step a preemption in the wait checkpoints).
What it is not: the checkpoint itself (`checkpoints.py`) or the loop (`loop.py`).
"""

from __future__ import annotations

import signal
from typing import Any, Callable

import torch

from megatron_darl.trainer.feed import ReplayFeed

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
        if world_size() > 1:
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


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


class StepFeed(ReplayFeed):
    """The replay feed, remembering which step it is waiting for (what a preemption in the
    wait checkpoints)."""

    waiting_step = 0

    def wait_candidates(self, step: int, alive: Callable[[], None], timeout_s: float | None = None):
        self.waiting_step = step
        return super().wait_candidates(step, alive, timeout_s)


class StoppableLearner:
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

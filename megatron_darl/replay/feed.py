"""Replay feed: the learner's side of the on-node ring buffer, filling the replay store.

What it is: `ReplayFeed`, run on the main learner rank. It moves trajectories from the
shared-memory ring (written by the rollout manager) into the `ReplayStore`, counting every
record it takes (`received`), and blocks a train step until the store can fill it with at
least one batch of never-trained groups (so generation and training advance together, and
the staleness gate bounds how far generation runs ahead). While it waits it calls a liveness
check, so a dead rollout side stops the run instead of hanging it. `drain_to(n)` takes exactly
the first n records (checkpoints use it to match the manager's saved state).
What it is not: the ring buffer, the store's rules, or selection.
"""

from __future__ import annotations

import time
from typing import Callable

from megatron_darl.replay.shm_ring import ShmRing
from megatron_darl.replay.store import ReplayStore
from megatron_darl.replay.api import Candidates


class ReplayFeed:
    def __init__(self, ring: ShmRing, store: ReplayStore, batch_groups: int):
        self.ring, self.store, self.batch_groups = ring, store, batch_groups
        self.received = 0  # trajectories taken from the ring since the run began (checkpointed)
        self.wait_s = 0.0  # time the last step waited for data

    def _take_one(self, step: int, timeout: float) -> bool:
        traj = self.ring.get_trajectory(timeout=timeout)
        if traj is None:
            return False
        self.store.add(traj, step)
        self.received += 1
        return True

    def drain(self, step: int) -> int:
        """Take every record available now, without waiting."""
        n = 0
        while self._take_one(step, 0.0):
            n += 1
        return n

    def wait_candidates(self, step: int, alive: Callable[[], None], timeout_s: float | None = None) -> Candidates:
        """Block until the store can fill `batch_groups` with that many never-trained groups."""
        t0 = time.monotonic()
        self.drain(step)
        while not self.store.ready(step, self.batch_groups, min_new=self.batch_groups):
            if not self._take_one(step, 0.2):
                alive()  # raises when the rollout side died
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"step {step}: no batch of {self.batch_groups} groups within {timeout_s} s "
                                   f"(pool: {len(self.store)} groups, {self.store.num_pending} incomplete)")
        self.wait_s = time.monotonic() - t0
        return self.store.candidates(step)  # sorted by (version, group_id): arrival order never matters

    def drain_to(self, count: int, step: int, alive: Callable[[], None], timeout_s: float = 600.0) -> None:
        """Take records until exactly `count` have been received in total."""
        t0 = time.monotonic()
        while self.received < count:
            if not self._take_one(step, 0.2):
                alive()
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"ring: {count - self.received} announced records never arrived")

    def state_dict(self) -> dict:
        return {"received": self.received, "store": self.store.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.received = int(state["received"])
        self.store.load_state_dict(state["store"])

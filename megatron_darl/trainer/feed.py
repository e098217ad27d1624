"""Replay feed: the learner's side of the on-node ring buffer, filling the replay store.

What it is: `ReplayFeed`, run on the main learner rank. It moves trajectories from the
shared-memory ring (written by the rollout manager) into the `ReplayStore`, counting every
record it takes (`received`), and decides what each step consumes of new data, so that
generation is not spent on groups that age out untrained.
What it is not: the ring buffer, the store's rules, or selection.

- a step trains `batch_groups` groups: never-trained ones and reused ones;
- it is offered the OLDEST never-trained groups it takes (later ones wait) and the reused groups
  of versions older than `step - max_head_offpolicyness` (so a reused group never crowds out a
  never-trained one), as many as the batch has room for plus a quarter batch for selection to
  reject, freshest first;
- after each step the feed plans the next one's share of new groups, `new_groups` =
  `batch_groups` minus the reused groups expected to pass selection (the share admitted this
  step, applied to those the next step can be offered), at least batch_groups / max_reuse (a
  group is trained at most max_reuse times), more when too few reused groups can be offered;
- the learner reports that share and `ReplayStore.consumed` (groups trained once or aged out
  untrained) to the staleness gate in the weight notice. Baselines (no reuse) take
  `batch_groups` new groups every step: AReaL's gate exactly.
While it waits it calls a liveness check, so a dead rollout side stops the run instead of
hanging it. `drain_to(n)` takes exactly the first n records (checkpoints use it to match the
manager's saved state).
"""

from __future__ import annotations

import time
from typing import Callable

from megatron_darl.channel.shm_ring import ShmRing
from megatron_darl.trainer.replay_store import Candidates, ReplayStore


class ReplayFeed:
    def __init__(self, ring: ShmRing, store: ReplayStore, batch_groups: int, max_head_offpolicyness: int = 0):
        self.ring, self.store, self.batch_groups = ring, store, batch_groups
        self.eta = max_head_offpolicyness  # the gate's bound: new data of step t is of version >= t - eta
        self.received = 0  # trajectories taken from the ring since the run began (checkpointed)
        self.wait_s = 0.0  # time the last step waited for data
        self.new_groups = batch_groups  # planned never-trained groups of the next step (checkpointed)

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

    def step_new_groups(self, step: int) -> int:
        """Never-trained groups `step` takes: the plan, or more when the reused groups it may be
        offered cannot fill the batch."""
        short = self.batch_groups - self.store.reused_eligible(step, before=step - self.eta)
        return min(self.batch_groups, max(self.new_groups, short))

    def wait_candidates(self, step: int, alive: Callable[[], None], timeout_s: float | None = None) -> Candidates:
        """Block until the store holds the never-trained groups `step` takes; return the
        candidates: the oldest of those and the reused groups it may be offered (module docstring)."""
        t0 = time.monotonic()
        self.drain(step)
        need = self.step_new_groups(step)
        while not self.store.ready(step, self.batch_groups, min_new=need):
            if not self._take_one(step, 0.2):
                alive()  # raises when the rollout side died
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"step {step}: no batch of {self.batch_groups} groups ({need} never trained) "
                                   f"within {timeout_s:g} s (pool: {len(self.store)} groups, "
                                   f"{self.store.num_pending} incomplete)")
        self.wait_s = time.monotonic() - t0
        # room in the batch for reused groups, and a margin for selection to reject some
        room = self.batch_groups - need + -(-self.batch_groups // 4)
        # sorted by (version, group_id), not arrival
        return self.store.candidates(step, new_limit=need, reused_before=step - self.eta, reused_limit=room)

    def commit(self, step: int, group_ids, reused_admitted: int, filtered: int = 0) -> int:
        """Mark the chosen groups trained at `step` and plan the next step: of the reused groups
        it can be offered, the share selection admitted now (`reused_admitted` of those offered;
        all when none were) is expected to pass, and new groups fill the rest of the batch (at
        least batch_groups / max_reuse: a group is trained at most max_reuse times). Returns the
        never-trained groups the next step takes: the staleness gate's batch. `filtered`: the
        candidates selection's gate left out (counted by the store)."""
        offered = self.store.last_reused_offered
        self.store.commit(step, group_ids, filtered=filtered)
        rate = reused_admitted / offered if offered else 1.0  # admitted share of the offered reused groups
        expect = round(rate * self.store.reused_eligible(step + 1, before=step + 1 - self.eta))
        floor = -(-self.batch_groups // self.store.cfg.effective_max_reuse)
        self.new_groups = min(self.batch_groups, max(floor, self.batch_groups - expect))
        return self.step_new_groups(step + 1)

    def drain_to(self, count: int, step: int, alive: Callable[[], None], timeout_s: float = 600.0) -> None:
        """Take records until exactly `count` have been received in total."""
        t0 = time.monotonic()
        while self.received < count:
            if not self._take_one(step, 0.2):
                alive()
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"ring: {count - self.received} announced records never arrived")

    def state_dict(self) -> dict:
        return {"received": self.received, "new_groups": self.new_groups, "store": self.store.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.received = int(state["received"])
        self.new_groups = int(state.get("new_groups", self.batch_groups))
        self.store.load_state_dict(state["store"])

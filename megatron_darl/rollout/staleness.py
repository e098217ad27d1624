"""Staleness gate: AReaL's admission control for asynchronous generation.

What it is: a small asyncio-friendly counter (`aacquire`, `try_acquire`, `release`,
`on_version`, `state_dict`). Call it from the event loop's thread; another thread reports a
version with `loop.call_soon_threadsafe(gate.on_version, v)`.
What it is not: a rate limiter per engine or a queue of requests.

The rule: a new generation may start only while

    (max_head_offpolicyness + 1) * batch_size + consumed - (accepted + running) > 0

where `consumed` counts the generations the learner has used up, `batch_size` the units one
training step consumes, `accepted` the finished generations kept so far (cumulative over the
run) and `running` those in flight: at most eta + 1 batches are generated and not yet used
(eta = 0: synchronous training). A rejected generation (`release(accepted=False)`, e.g.
filtered or aborted) frees its place. The unit is whatever the caller counts in `batch_size`:
the rollout manager counts groups (one prompt's G responses) and acquires once per group.

`consumed` is one batch per version, `version * batch_size`, unless the learner reports it:
AReaL's rule `(eta + version + 1) * batch_size - (accepted + running) > 0`, which baselines keep.
A learner that trains some groups more than once (D-ARL's replay) reports with each version the
groups it used up in all (trained for the first time, or aged out untrained) and the new groups
its next step takes (`on_version(v, consumed=n, batch_size=b)`): generation then replaces
exactly what was used and runs eta of the learner's steps ahead.
"""

from __future__ import annotations

import asyncio
import time


class StalenessGate:
    """AReaL's admission rule over (version, accepted, running); see the module docstring."""

    def __init__(self, max_head_offpolicyness: int, batch_size: int, version: int = 0):
        """`version`: the learner's version at start; until the learner reports its
        consumption, `consumed = version * batch_size`."""
        if max_head_offpolicyness < 0:
            raise ValueError(f"StalenessGate: max_head_offpolicyness={max_head_offpolicyness} must be >= 0")
        if batch_size < 1:
            raise ValueError(f"StalenessGate: batch_size={batch_size} must be >= 1")
        self.eta = max_head_offpolicyness
        self.batch_size = batch_size
        self.version = version
        self.consumed = version * batch_size
        self.reported = False  # whether the learner ever reported `consumed` (then only reports count)
        self.accepted = 0
        self.running = 0
        self.rejected = 0
        self._waiters: list[asyncio.Future] = []

    def capacity(self) -> int:
        """How many more generations may start now (the left side of the rule, floored at 0)."""
        return max(0, (self.eta + 1) * self.batch_size + self.consumed - (self.accepted + self.running))

    def try_acquire(self) -> bool:
        """Start one generation if the rule allows it now."""
        if self.capacity() <= 0:
            return False
        self.running += 1
        return True

    async def aacquire(self, timeout: float | None = None) -> None:
        """Wait until one generation may start, and count it as running.

        Raises TimeoutError after `timeout` seconds (None: wait for as long as it takes).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        loop = asyncio.get_running_loop()
        while not self.try_acquire():
            fut = loop.create_future()
            self._waiters.append(fut)
            try:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"StalenessGate: no admission within {timeout} s (version={self.version}, "
                    f"accepted={self.accepted}, running={self.running}, eta={self.eta}, batch_size={self.batch_size})"
                ) from None
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)

    def release(self, accepted: bool) -> None:
        """A started generation ended: kept (`accepted`) or dropped (its place is freed)."""
        if self.running <= 0:
            raise RuntimeError("StalenessGate.release: no generation is running (release without acquire)")
        self.running -= 1
        if accepted:
            self.accepted += 1
        else:
            self.rejected += 1
            self._wake()

    def on_version(self, version: int, consumed: int | None = None, batch_size: int | None = None) -> None:
        """The learner moved to `version` having used up `consumed` generations in all (None:
        not reported, one batch per version unless it ever reported), and its next step takes
        `batch_size` (None: unchanged). Notifications older than the current version are
        ignored; a repeated version may bring a newer count."""
        if version < self.version:
            return
        if batch_size is not None:
            if batch_size < 1:
                raise ValueError(f"StalenessGate.on_version: batch_size={batch_size} must be >= 1")
            self.batch_size = batch_size
        if consumed is not None:
            if consumed < 0:
                raise ValueError(f"StalenessGate.on_version: consumed={consumed} must be >= 0")
            # a newer version's count is the truth (replacing the one-batch-per-version estimate);
            # counts for the same version only grow (an out-of-order notice cannot shrink it)
            self.consumed = consumed if version > self.version else max(self.consumed, consumed)
            self.reported = True
        elif not self.reported:
            self.consumed = max(self.consumed, version * self.batch_size)
        self.version = version
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/gate_capacity": float(self.capacity()),
            "rollout/gate_running": float(self.running),
            "rollout/gate_accepted": float(self.accepted),
            "rollout/gate_consumed": float(self.consumed),
            "rollout/gate_batch": float(self.batch_size),
            "rollout/gate_rejected": float(self.rejected),
        }

    def state_dict(self) -> dict[str, int]:
        """What a resumed run needs; in-flight generations are lost with the old processes."""
        return {"version": self.version, "accepted": self.accepted, "rejected": self.rejected,
                "consumed": self.consumed, "reported": self.reported, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int], lost_accepted: int = 0) -> None:
        """Restore exactly. `lost_accepted`: accepted generations the resumed run no longer has
        (neither trained nor in the restored pool); they are generated again, so a resumed run
        never waits for data that the gate would not admit."""
        self.version = int(state["version"])
        self.batch_size = int(state.get("batch_size", self.batch_size))
        self.consumed = int(state.get("consumed", self.version * self.batch_size))
        self.reported = bool(state.get("reported", False))
        self.accepted = max(0, int(state["accepted"]) - lost_accepted)
        self.rejected = int(state["rejected"])
        self.running = 0
        self._wake()

"""One engine as the rollout manager's dispatcher sees it: `EngineSlot`.

What it is: the engine's client, the version it serves, whether it is up, the requests in flight
on it (with the time it spent busy, for the idle fraction), and the marks the pool's failure
handling sets (`incarnation`, `partial`, `restart_wanted`, `last_restart`).
What it is not: the dispatch, failure, health and weight-loading rules that change those fields
(`engine_pool.py`), nor an engine client (`api.RolloutEngine`).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from megatron_darl.rollout.api import RolloutEngine


@dataclass(eq=False)  # slots compare by identity
class EngineSlot:
    """One engine as the dispatcher sees it."""

    index: int
    engine: RolloutEngine
    version: int
    up: bool = True
    inflight: dict[str, asyncio.Future] = field(default_factory=dict)
    busy_s: float = 0.0  # time with >= 1 request in flight (for the idle fraction)
    busy_since: float | None = None
    last_restart: float = -math.inf
    incarnation: int = 0  # +1 at every down: a distributed weight update then uses a new group
    # a distributed version failed on it: SGLang loads each bucket as it arrives, so it may hold a
    # mix of versions; it is neither resumed nor given requests until it loaded a whole version
    partial: bool = False
    restart_wanted: bool = False  # it failed the weight probe: a new process, not a reload, brings it back

    def add(self, rid: str, fut: asyncio.Future, now: float) -> None:
        if not self.inflight:
            self.busy_since = now
        self.inflight[rid] = fut

    def remove(self, rid: str, now: float) -> None:
        self.inflight.pop(rid, None)
        if not self.inflight and self.busy_since is not None:
            self.busy_s += now - self.busy_since
            self.busy_since = None

    def busy_total(self, now: float) -> float:
        return self.busy_s + (now - self.busy_since if self.busy_since is not None else 0.0)

"""Waiting in the rollout manager without losing a cancellation on Python 3.11.

What it is: `Signal` (waiters sleep until state changed, then re-check their own predicate) and
`await_within` (an `await` with a time limit), both built on `asyncio.wait` over a task or a
shared future: `asyncio.wait_for` can swallow a cancellation on 3.11, so a task would never stop.
What it is not: what is waited for (engines with room, engines up: `engine_pool.py`) or a lock.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable


class Signal:
    """Wake waiters when state changed; they re-check their own predicate. `asyncio.wait` on a
    shared future, not `wait_for`: on 3.11 that can swallow a cancellation (a task never stops)."""

    def __init__(self) -> None:
        self._fut: asyncio.Future | None = None

    def notify(self) -> None:
        if self._fut is not None and not self._fut.done():
            self._fut.set_result(None)
        self._fut = None

    async def wait_for(self, pred: Callable[[], bool], recheck_s: float = 0.5) -> None:
        while not pred():
            if self._fut is None:
                self._fut = asyncio.get_running_loop().create_future()
            # periodic re-check: a gate may open for reasons we are not told about
            await asyncio.wait({self._fut}, timeout=recheck_s)


async def await_within(awaitable: Any, timeout_s: float) -> Any:
    """`await` with a time limit (TimeoutError), cancellation-safe on Python 3.11 (see Signal)."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise TimeoutError(f"no answer within {timeout_s} s")
    return task.result()


"""The rollout manager's side of the learner's two files: the notice it polls, the status it writes.

What it is: `LearnerLink`, which polls the learner's `WeightNotice` and acts on it through the
manager (load the weights, save the manager's state at the path a checkpoint asks for, stop), and
writes the manager's `RolloutStatus` for the learner: after each of those, when the manager stops
or fails, and once a second while it polls (the counters, for the learner's logs).
What it is not: the files' format and their atomic writes (`channel/weight_notice.py`), nor what
the manager does with a version or a stop (`manager.py`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, Callable, Protocol

from megatron_darl.channel.json_files import write_json_atomic
from megatron_darl.channel.weight_notice import NoticePoller, RolloutStatus, write_status
from megatron_darl.rollout.turns import per_sample_metrics
from megatron_darl.types import WeightVersion

log = logging.getLogger(__name__)


class NoticeTarget(Protocol):
    """What the link needs of the manager (`manager.RolloutManager` has it); `pool` is its
    `engine_pool.EnginePool`."""

    version: int
    error: str | None
    inflight_groups: int
    pool: Any

    async def aupdate_weights(self, weights: WeightVersion, consumed: int | None = None,
                              new_groups: int | None = None, probe: Any = None) -> None: ...

    async def aclean_state(self) -> dict[str, Any]: ...

    def request_stop(self) -> None: ...

    def counters(self) -> dict[str, float]: ...


class LearnerLink:
    """Polls `notice_path` (None: never) and writes `status_path` (None: never) for `manager`.
    `reporters`: objects whose `metrics()` go into the status too (the gate, the prompt loader);
    one without it is skipped."""

    def __init__(self, manager: NoticeTarget, notice_path: str | None, status_path: str | None,
                 poll_interval_s: float, clock: Callable[[], float], reporters: tuple[Any, ...] = ()) -> None:
        self._manager, self.notice_path, self._status_path = manager, notice_path, status_path
        self._poll_s, self._clock, self._reporters = poll_interval_s, clock, reporters
        self._state_answered: str | None = None  # the last state_request answered

    async def aloop(self) -> None:
        """Forever: act on each new notice, then sleep the poll interval. A notice that does not
        parse is logged and polling goes on; a state that cannot be written ends the loop."""
        assert self.notice_path is not None
        poller = NoticePoller(self.notice_path)
        last_status = -math.inf
        while True:
            try:
                notice = poller.poll()
            except ValueError as exc:  # someone else wrote the file: say so, keep polling
                log.error("%s", exc)
                notice = None
            if notice is not None:
                mgr = self._manager
                if notice.weights is not None:
                    await mgr.aupdate_weights(notice.weights, consumed=notice.consumed, new_groups=notice.new_groups,
                                              probe=notice.probe)
                if notice.state_request and notice.state_request != self._state_answered:
                    state = await mgr.aclean_state()
                    try:
                        write_json_atomic(notice.state_request, state)
                    except OSError as exc:
                        raise OSError(f"cannot write the rollout state to {notice.state_request}: {exc}") from exc
                    self._state_answered = notice.state_request
                    self.write_status()
                if notice.stop:
                    mgr.request_stop()
            if self._clock() - last_status >= 1.0:  # counters for the learner's logs, once a second
                self.write_status()
                last_status = self._clock()
            await asyncio.sleep(self._poll_s)

    def write_status(self) -> None:
        if not self._status_path:
            return
        mgr = self._manager
        c = mgr.counters()
        extra: dict[str, float] = {}
        for r in self._reporters:  # the gate's state, data rows dropped (rollout/prompts_rejected)
            extra.update(getattr(r, "metrics", dict)())
        write_status(self._status_path, RolloutStatus(
            version=mgr.version, groups_written=c["groups_written"], groups_filtered=c["filtered_groups"],
            state_path=self._state_answered, error=mgr.error,
            metrics={**{f"rollout/{k}": float(v) for k, v in c.items()},
                     "rollout/engine_busy_s": mgr.pool.busy_s(),  # engine-seconds with requests in flight
                     # what a learner waiting for data names (trainer/publication.py, rollout_report)
                     "rollout/engines_up": float(mgr.pool.engines_up()),
                     "rollout/inflight_groups": float(mgr.inflight_groups),
                     **mgr.pool.prober.metrics,  # rollout/probe_*: figures of each engine's last check
                     **per_sample_metrics(c),  # with tools: turns, tool tokens, calls per finished sample
                     **extra},
        ))

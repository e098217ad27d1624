"""The rollout manager's groups in flight: admitted, run, then written, filtered, re-run or dropped.

What it is: `EpisodeRunner`, which draws a prompt only while the manager admits groups and the
staleness gate has room (re-runs first: checkpointed groups, failed scoring), runs each group
through the workflow as a task, and writes a finished group to the sink (the node's ring buffer).
A group whose scoring failed is re-run up to `max_attempts`, one that an engine refused (a 4xx)
is dropped at once. No prompt is lost or written twice: a drawn prompt is in flight (`active`,
`resume`, which the manager saves in its state), written, or filtered or dropped (both counted
in `RUNNER_COUNTERS`).
What it is not: the engines (`engine_pool.py`), the sampling and scoring of one group
(`workflow.py`), nor the manager's lifecycle, weight updates and state (`manager.py`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Callable

from megatron_darl.rollout.api import AdmissionGate, PromptProvider, TrajectorySink
from megatron_darl.rollout.engine_pool import EnginePool, RequestRefused, Signal
from megatron_darl.rollout.workflow import Episode, RolloutWorkflow, SampleClient
from megatron_darl.types import Trajectory

log = logging.getLogger(__name__)

# what the runner counts; the manager reports them with its own as `rollout/<name>` and saves them
RUNNER_COUNTERS = (
    "prompts_drawn", "groups_written", "samples_written", "filtered_groups", "groups_dropped",
    "episode_retries", "reward_sum",
)


class EpisodeRunner:
    """Admits and runs groups until `stopping` is set; `aadmit_forever` is the admission loop."""

    def __init__(self, prompts: PromptProvider, workflow: RolloutWorkflow, sink: TrajectorySink,
                 gate: AdmissionGate | None, *, pool: EnginePool, signal: Signal, client: SampleClient,
                 max_inflight: int, max_attempts: int, fail: Callable[[str, BaseException], None]) -> None:
        """A runner with nothing in flight.

        Args:
            pool: the engines; no group is admitted while it is paused for a weight update.
            signal: the manager's wake-up signal, notified whenever a group ends or admission stops.
            client: what the workflow runs each sample through (the manager).
            max_inflight: the most groups admitted and running at once.
            max_attempts: failed runs of a group (scoring errors) before it is dropped (counted).
            fail: stops the manager with a message and the exception (a sink that cannot be written).
        """
        self._prompts, self._workflow, self._sink, self._gate = prompts, workflow, sink, gate
        self._pool, self._signal, self._client, self._fail = pool, signal, client, fail
        self._max_inflight, self._max_attempts = max_inflight, max_attempts
        self.active: dict[int, Episode] = {}  # admitted, running
        self.tasks: dict[int, asyncio.Task] = {}
        self.writing: set[int] = set()  # groups inside sink.aput_group: never cancelled
        self.resume: collections.deque[Episode] = collections.deque()  # re-run first
        self.stopping = self.exhausted = False
        self.counts: collections.Counter[str] = collections.Counter({k: 0 for k in RUNNER_COUNTERS})

    def load_counts(self, saved: dict[str, float]) -> None:
        """Restore the counters from a saved state (names the runner does not count are ignored)."""
        self.counts = collections.Counter({k: saved.get(k, 0) for k in RUNNER_COUNTERS})

    def finished(self) -> int:
        """Groups written, filtered or dropped."""
        c = self.counts
        return c["groups_written"] + c["filtered_groups"] + c["groups_dropped"]

    def done(self) -> bool:
        """No prompt left to draw and nothing in flight or waiting to re-run."""
        return self.exhausted and not self.active and not self.resume

    def cancel(self) -> list[asyncio.Task]:
        """Cancel every group's task but those being written (they finish their write); returns
        every task, to be awaited."""
        for uid, task in list(self.tasks.items()):
            if uid not in self.writing:
                task.cancel()
        return list(self.tasks.values())

    def _may_admit(self) -> bool:
        if self.stopping or self._pool.paused or len(self.active) >= self._max_inflight:
            return False
        if self.exhausted and not self.resume:
            return False
        # re-runs (checkpointed, failed scoring) go first, but through the gate like any group
        return self._gate is None or self._gate.capacity() > 0

    async def aadmit_forever(self) -> None:
        while True:
            await self._signal.wait_for(self._may_admit)
            if self.resume:
                episode = self.resume.popleft()
            else:
                drawn = self._prompts.next_batch(1)
                if not drawn:
                    self.exhausted = True  # re-runs of failed groups are still admitted
                    self._signal.notify()
                    continue
                episode = self._workflow.new_episode(drawn[0])
                self.counts["prompts_drawn"] += 1
            if episode.uid in self.active:
                raise ValueError(f"prompt uid {episode.uid} drawn twice while in flight")
            if self._gate is not None and not self._gate.try_acquire():
                raise RuntimeError("admission gate refused a group right after reporting capacity")
            self.active[episode.uid] = episode
            self.tasks[episode.uid] = asyncio.create_task(self._adrive(episode))

    def _retire(self, episode: Episode, accepted: bool) -> None:
        self.active.pop(episode.uid, None)
        self.tasks.pop(episode.uid, None)
        if self._gate is not None:
            self._gate.release(accepted)
        self._signal.notify()

    async def _adrive(self, episode: Episode) -> None:
        try:
            trajs = await self._workflow.arun_episode(self._client, episode)
        except asyncio.CancelledError:
            raise  # stays in `active`, hence in the manager's state
        except RequestRefused as exc:  # every engine would refuse it: no re-run
            self._retire(episode, accepted=False)
            log.error("prompt %d dropped: %s", episode.uid, exc)
            self.counts["groups_dropped"] += 1
            return
        except Exception as exc:
            self._failed(episode, exc)
            return
        if trajs is None:
            self.counts["filtered_groups"] += 1
            self._retire(episode, accepted=False)
            return
        await self._awrite(episode, trajs)

    def _failed(self, episode: Episode, exc: Exception) -> None:
        episode.attempts += 1
        self._retire(episode, accepted=False)
        if episode.attempts < self._max_attempts:
            log.warning("prompt %d failed (%r); re-running (attempt %d)", episode.uid, exc, episode.attempts)
            self.resume.append(episode)
            self.counts["episode_retries"] += 1
        else:
            log.error("prompt %d dropped after %d failures: %r", episode.uid, episode.attempts, exc)
            self.counts["groups_dropped"] += 1

    async def _awrite(self, episode: Episode, trajs: list[Trajectory]) -> None:
        self.writing.add(episode.uid)
        try:
            await self._sink.aput_group(trajs)
        except Exception as exc:  # the ring is gone or broken: nothing sensible to continue with
            self._fail(f"writing prompt {episode.uid} to the ring failed: {exc!r}", exc)
            return
        finally:
            self.writing.discard(episode.uid)
        self.counts["groups_written"] += 1
        self.counts["samples_written"] += len(trajs)
        self.counts["reward_sum"] += sum(t.reward for t in trajs)
        self._retire(episode, accepted=True)

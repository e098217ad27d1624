"""The rollout manager: one asyncio process per trainer node that keeps every engine busy.

What it is: `RolloutManager`, which admits groups while the staleness gate has room and runs them
(`episodes.EpisodeRunner`: the workflow sends each group's G samples to the engines of an
`EnginePool` and the finished group goes to the sink, the node's ring buffer), and on a new weight
version has the pool pause the engines, load the weights and resume them. Partial rollouts
survive the update: with `pause_mode=abort` an aborted request's tokens are kept with their
versions and the continuation is resubmitted (`partial_rollout`), or dropped and the sample
restarted. No prompt is lost or written twice: a drawn prompt is in flight (and in
`state_dict()`), written, or filtered or dropped (both counted). It reads the learner's notice
and writes its status through `notices.LearnerLink`; its process is `manager_process.py`.
What it is not: the engines' dispatch, failures, health and weight loading (`engine_pool.py`), an
engine client, a reward grader, the gate's formula or the ring buffer; it drives them through the
small protocols of `api.py` (`workflow.RewardPoolScorer` adapts the reward pool).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import asdict
from typing import Any, Callable

from megatron_darl.channel.weight_notice import weight_version_from_json
from megatron_darl.channel.weight_probe import WeightProbe
from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout.api import AdmissionGate, PromptProvider, RolloutEngine, TrajectorySink
from megatron_darl.rollout.engine_pool import POOL_COUNTERS, EnginePool, EngineRestarter, Signal
from megatron_darl.rollout.episodes import RUNNER_COUNTERS, EpisodeRunner
from megatron_darl.rollout.notices import LearnerLink
from megatron_darl.rollout.turns import per_sample_metrics
from megatron_darl.rollout.workflow import Episode, RolloutWorkflow, SampleState
from megatron_darl.types import SamplingParams, WeightVersion

log = logging.getLogger(__name__)

STATE_FORMAT = 1

# what the manager itself counts; reported with the runner's (RUNNER_COUNTERS) and the pool's
# (POOL_COUNTERS) as `rollout/<name>` and saved in the state as one set (a stable key set)
MANAGER_COUNTERS = ("weight_updates", "weight_update_s_total")


class RolloutManager:
    """Drives engines, workflow, gate and sink. Lifecycle: (`load_state_dict`) -> `astart` ->
    ... -> `astop`; or `arun()` until the notice says stop, the prompts run out, or `astop()`."""

    def __init__(self, config: RolloutConfig, engines: list[RolloutEngine], prompts: PromptProvider,
                 workflow: RolloutWorkflow, sink: TrajectorySink, gate: AdmissionGate | None = None, *,
                 restarter: EngineRestarter | None = None, notice_path: str | None = None,
                 status_path: str | None = None, initial_version: int = 0, poll_interval_s: float = 0.2,
                 health_interval_s: float = 1.0, restart_grace_s: float = 30.0,
                 max_inflight_groups: int | None = None, max_episode_attempts: int = 3,
                 clock: Callable[[], float] = time.monotonic, run_id: str | None = None) -> None:
        """A manager at `initial_version`, not started (see the lifecycle above).

        Args:
            config: the `rollout` section (group size, `pause_mode`, `partial_rollout`, per-engine concurrency).
            engines: the engine clients (at least one).
            prompts: where prompts are drawn from, resumably (a `PromptLoader`).
            workflow: runs one prompt's group of samples and scores it.
            sink: where finished groups are written (the node's ring buffer).
            gate: the staleness bound that admits each group; None admits every group.
            restarter: replaces a dead embedded engine; None: down engines are never restarted.
            notice_path: the learner's `WeightNotice` JSON, polled for weights, state requests and stop;
                None: no polling (weights only through `aupdate_weights`).
            status_path: where the manager writes its `RolloutStatus` JSON for the learner; None: not written.
            initial_version: the weight version the engines start with.
            poll_interval_s: seconds between two reads of the notice file.
            health_interval_s: seconds between the health loop's attempts to bring down engines back.
            restart_grace_s: seconds a restarted engine gets to turn healthy before it may be restarted again.
            max_inflight_groups: the most groups admitted and running at once; None: enough groups to fill
                every engine slot.
            max_episode_attempts: failed runs of a group (scoring errors) before it is dropped (counted).
            clock: the monotonic clock in seconds (tests pass a fake).
            run_id: begins the distributed weight groups' names, with a token of this start; None: the token.
        """
        if not engines:
            raise ValueError("RolloutManager: no engines (rollout.engine_urls / rollout.num_engines)")
        if not config.partial_rollout and config.pause_mode != "abort":
            raise ValueError(f"rollout.partial_rollout=false needs rollout.pause_mode=abort (got {config.pause_mode!r}"
                             "): retract/in_place continue requests on the engine under the new weights")
        self.config, self._prompts, self._gate, self._workflow = config, prompts, gate, workflow
        self._clock, self._signal = clock, Signal()
        self._count: collections.Counter[str] = collections.Counter({k: 0 for k in MANAGER_COUNTERS})
        self._pool = EnginePool(config, engines, signal=self._signal, restarter=restarter,
                                notice_path=notice_path, initial_version=initial_version, run_id=run_id, clock=clock,
                                health_interval_s=health_interval_s, restart_grace_s=restart_grace_s)
        slots = len(engines) * config.max_concurrent_per_engine
        self._runner = EpisodeRunner(prompts, workflow, sink, gate, pool=self._pool, signal=self._signal, client=self,
                                     max_inflight=max_inflight_groups or max(1, math.ceil(slots / config.group_size)),
                                     max_attempts=max_episode_attempts, fail=self._fail)
        self._link = LearnerLink(self, notice_path, status_path, poll_interval_s, clock, reporters=(gate, prompts))
        self._awaiting_weights = False  # restored at a version no engine serves yet: wait for its publication
        self._background: list[asyncio.Task] = []
        self._stop_requested = self._started = False
        self._fatal: BaseException | None = None
        self._error: str | None = None  # the fatal error as the learner reads it in the status
        self._weight_update_s = 0.0
        self._window = (clock(), 0.0, 0, 0, 0.0, 0)  # t, busy, samples, tokens, reward_sum, groups

    @property
    def version(self) -> int:
        return self._pool.version

    @property
    def inflight_groups(self) -> int:
        """Groups admitted and running."""
        return len(self._runner.active)

    @property
    def pool(self) -> EnginePool:
        """The engines (their slots, health and weights)."""
        return self._pool

    async def astart(self) -> None:
        """Start admission, notice polling and health checks (idempotent)."""
        if self._started:
            return
        self._started = True
        self._window = (self._clock(), self._pool.busy_s(), *self._window[2:])
        # a previous manager may have stopped in the middle of an update, leaving engines paused
        await self._pool.aresume_all()
        if self._awaiting_weights:
            log.info("restored at weight version %d: requests start once the learner publishes it",
                     self._pool.version)
        loops = [("admission", self._runner.aadmit_forever), ("health checks", self._pool.ahealth_loop)]
        if self._link.notice_path:
            loops.append(("notice polling", self._link.aloop))
        self._background = [asyncio.create_task(self._aguard(name, loop)) for name, loop in loops]

    async def agenerate_sample(self, sample: SampleState, sampling: SamplingParams) -> None:
        """The workflow's `SampleClient`: run one sample to its end (`EnginePool.agenerate_sample`)."""
        await self._pool.agenerate_sample(sample, sampling)

    async def arun(self) -> None:
        """Run until a stop notice, `request_stop()`, a fatal error, or no prompts left (noticed
        when admission draws nothing: a closed gate never draws, so use `await_groups` then
        `astop` to end a bounded run)."""
        await self.astart()
        try:
            await self._signal.wait_for(lambda: self._stop_requested or self._fatal is not None or self._runner.done())
        finally:
            await self.astop()
        if self._fatal is not None:
            raise self._fatal

    @property
    def error(self) -> str | None:
        """Why the manager stopped, when a background task failed (also in its status file)."""
        return self._error

    def request_stop(self) -> None:
        self._stop_requested = True
        self._signal.notify()

    async def await_groups(self, n: int) -> None:
        """Wait until `n` groups are finished (written, filtered or dropped) in total."""
        await self._signal.wait_for(lambda: self._runner.finished() >= n or self._fatal is not None)
        if self._fatal is not None:
            raise self._fatal

    async def astop(self, drain: bool = False) -> None:
        """Stop admitting; with `drain`, let admitted groups finish first; then cancel the rest
        (they stay in `state_dict()`), leaving groups being written to finish their write."""
        self._runner.stopping = True
        self._signal.notify()
        if drain:
            await self._signal.wait_for(lambda: not self._runner.active or self._fatal is not None)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, *self._runner.cancel(), return_exceptions=True)
        self._background = []
        self._link.write_status()

    async def aupdate_weights(self, weights: WeightVersion, consumed: int | None = None,
                              new_groups: int | None = None, probe: WeightProbe | None = None) -> None:
        """Pause every live engine (`pause_mode`), load `weights`, resume. Older versions are ignored;
        the current version is loaded again only from a new location, or when a restored manager
        waits for it (a resumed run publishes the checkpoint's version afresh at launch).
        `consumed`, `new_groups`: what the learner used up and its next step takes, for the gate.
        `probe`: the learner's log-probs of the weight probe under `weights` (`probe.py`)."""
        pool = self._pool
        async with pool.update_lock:
            same = pool.weights is None or weights.location == pool.weights.location
            # a restored manager takes the learner's first publication whatever its version: it
            # is what the resumed policy is (waiting for a higher one could wait for ever)
            if not self._awaiting_weights and (weights.version < pool.version or
                                               (weights.version == pool.version and same)):
                return
            t0 = self._clock()
            async with pool.apaused() as live:  # no dispatch, no admission until every engine resumed
                pool.version, pool.weights = weights.version, weights
                pool.prober.probe = probe if probe is not None and probe.version == weights.version else None
                self._awaiting_weights = False  # engines that miss it now get it when they come back
                if self._gate is not None:
                    self._gate.on_version(weights.version, consumed, new_groups)  # the learner's counts, if sent
                await pool.apush(weights, live)  # nothing stays paused (`EnginePool.apush`)
            self._weight_update_s = self._clock() - t0
            self._count["weight_updates"] += 1
            self._count["weight_update_s_total"] += self._weight_update_s
        self._link.write_status()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs: loader position, prompts in flight with partial responses.
        Take it when no group is being written (after `astop`, or `aclean_state`): then the first
        `counters["groups_written"]` groups in the ring and the state's episodes partition every
        prompt drawn."""
        episodes = [*self._runner.active.values(), *self._runner.resume]
        return {
            "format": STATE_FORMAT,
            "version": self._pool.version,
            "weights": asdict(self._pool.weights) if self._pool.weights is not None else None,
            "loader": self._prompts.state_dict(),
            "episodes": [e.to_json() for e in episodes],
            "counters": self.counters(),
            "gate": self._gate.state_dict() if hasattr(self._gate, "state_dict") else None,
        }

    async def aclean_state(self) -> dict[str, Any]:
        """`state_dict()` at a clean cut: once no group is being written, every group is either
        whole in the ring or in the state (what the learner's checkpoint request gets)."""
        await self._signal.wait_for(lambda: not self._runner.writing)
        return self.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore before `astart()`: in-flight prompts are re-run first, partial tokens kept.
        The saved weight location belongs to the dead run (its /dev/shm folder is gone, a disk
        folder may be rewritten): engines get the restored version from the learner's
        publication of it (it publishes its start version at launch); until then, no requests."""
        if self._started:
            raise RuntimeError("RolloutManager.load_state_dict must be called before astart()")
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"rollout state format {state.get('format')!r}; this version reads {STATE_FORMAT}")
        self._prompts.load_state_dict(state["loader"])
        self._runner.resume = collections.deque(Episode.from_json(e) for e in state["episodes"])
        self._pool.version = int(state["version"])
        w = state.get("weights")
        if w:
            weight_version_from_json(w, "rollout state 'weights'")  # validated, not pushed (see above)
        self._pool.weights = None
        self._awaiting_weights = self._pool.version != self._pool.initial_version
        saved = state.get("counters", {})
        self._pool.load_counts(saved)
        self._runner.load_counts(saved)
        workflow_counts = getattr(self._workflow, "counts", None)
        if workflow_counts is not None:
            self._workflow.load_counts(saved)  # type: ignore[attr-defined]
        theirs = (*POOL_COUNTERS, *RUNNER_COUNTERS, *(workflow_counts or ()))
        mine = {k: v for k, v in saved.items() if k not in theirs}  # unknown names too
        self._count = collections.Counter({k: 0 for k in MANAGER_COUNTERS}, **mine)
        if self._gate is not None:
            if state.get("gate") is not None and hasattr(self._gate, "load_state_dict"):
                self._gate.load_state_dict(state["gate"])
            self._gate.on_version(self._pool.version)

    def counters(self) -> dict[str, float]:
        """The manager's counters, its runner's and its pool's, by name (`rollout/<name>`)."""
        workflow = getattr(self._workflow, "counts", {})  # samples, turns, tool calls (workflow.py)
        return dict(sorted({**self._count, **self._runner.counts, **self._pool.counts, **workflow}.items()))

    def metrics(self) -> dict[str, float]:
        """Counters since the start (`rollout/...`) and rates since the last call (`perf/...`)."""
        now, busy = self._clock(), self._pool.busy_s()
        t0, busy0, samples0, tokens0, reward0, groups0 = self._window
        c = self.counters()
        dt = max(now - t0, 1e-9)
        out = {f"rollout/{k}": float(v) for k, v in c.items()}
        out.update({
            "rollout/version": float(self._pool.version),
            "rollout/engines_up": float(self._pool.engines_up()),
            "rollout/inflight_groups": float(self.inflight_groups),
            "rollout/inflight_requests": float(self._pool.inflight_requests()),
            "rollout/reward_mean": (c["reward_sum"] - reward0) / max(c["samples_written"] - samples0, 1),
            "perf/samples_per_s": (c["samples_written"] - samples0) / dt,
            "perf/groups_per_s": (c["groups_written"] - groups0) / dt,
            "perf/gen_tokens_per_s": (c["tokens_generated"] - tokens0) / dt,
            "perf/engine_idle_frac": max(0.0, 1.0 - (busy - busy0) / (dt * len(self._pool.slots))),
            "perf/weight_update_s": self._weight_update_s,
            **self._pool.prober.metrics,  # rollout/probe_*: the latest check of each engine
        })
        out.update(per_sample_metrics(c))  # with tools: turns, tool tokens and calls per finished sample
        self._window = (now, busy, c["samples_written"], c["tokens_generated"], c["reward_sum"], c["groups_written"])
        return out

    # ---- background loops and failure ---------------------------------------------------

    async def _aguard(self, what: str, loop: Callable[[], Any]) -> None:
        """Run a background loop; if it fails, the manager stops with that error, logged with its
        traceback and written to the status file for the learner (a background task never
        swallows an exception: a silently dead loop froze training before)."""
        try:
            await loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(f"{what} failed: {exc!r}", exc)

    def _fail(self, message: str, exc: BaseException) -> None:
        log.error("rollout manager stopping: %s", message, exc_info=exc)
        if self._fatal is None:
            self._fatal, self._error = exc, message
        self._signal.notify()
        try:
            self._link.write_status()
        except Exception as status_exc:  # the status folder is broken too: the log still says it
            log.error("could not write the rollout status with the error: %r", status_exc)

"""The rollout manager: one asyncio process per trainer node that keeps every engine busy.

What it is: `RolloutManager`, which draws prompts (only while the staleness gate admits them),
runs each through the workflow (G samples spread over the engines, least-loaded first, at most
`max_concurrent_per_engine` requests per engine), writes finished groups to the sink (the
node's ring buffer), and on a new weight version pauses every engine, pushes the weights and
resumes. Partial rollouts survive the update: with `pause_mode=abort` an aborted request's
tokens are kept with their versions and the continuation is resubmitted (`partial_rollout`),
or dropped and the sample restarted. A failed or hung request marks its engine down, cancels
everything in flight on it and requeues those samples on other engines; a health loop brings
engines back (restarting embedded ones through the restarter) with the current weights. An
engine whose distributed transfer failed may hold part of a version (SGLang loads each bucket as
it arrives): it is left paused, gets no requests, and the health loop has it load a whole
version before it resumes (`_arevive`). No prompt is lost or written
twice: a drawn prompt is in flight (and in `state_dict()`), written, or filtered or dropped
(both counted).
The process entry (`python -m megatron_darl.rollout ...`) and the adapters to the real
ring buffer and engines are in `manager_process.py`.
What it is not: an engine client, a reward grader, the gate's formula or the ring buffer;
it drives them through the small protocols below (`workflow.RewardPoolScorer` adapts the
reward pool).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Protocol

from megatron_darl.channel.json_files import write_json_atomic
from megatron_darl.channel.weight_transfer import group_tag
from megatron_darl.channel.weight_notice import NoticePoller, RolloutStatus, weight_version_from_json, write_status
from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout.api import RolloutEngine
from megatron_darl.rollout.workflow import Episode, RolloutWorkflow, SampleState
from megatron_darl.types import GenerateRequest, GenerateResponse, SamplingParams, Trajectory, WeightVersion

log = logging.getLogger(__name__)

STATE_FORMAT = 1

# counters reported as `rollout/<name>` (a stable key set: zero until something happens)
COUNTERS = (
    "prompts_drawn", "groups_written", "samples_written", "filtered_groups", "groups_dropped",
    "episode_retries", "requests", "requeued_requests", "aborted_requests", "restarted_samples",
    "tokens_generated", "reward_sum", "engine_failures", "engine_restarts", "engine_recoveries",
    "weight_updates", "weight_update_s_total", "weight_sync_fallbacks", "requests_refused",
)
# answers that refuse the request, not the engine (SGLang and darl-engine: a field out of range, a
# prompt past the context, a body or batch past a bound): the group is dropped, the engine stays up
REFUSED_STATUSES = (400, 413, 422)


class RequestRefused(RuntimeError):
    """An engine refused a generation request with a 4xx naming what is wrong with it: no engine
    would serve it, so its group is dropped at once (counted and logged), not re-run."""


class TrajectorySink(Protocol):
    """Where finished groups go (the ring buffer); a group is written whole or raises."""

    async def aput_group(self, trajectories: list[Trajectory]) -> None: ...


class PromptProvider(Protocol):
    """`data.api.PromptLoader` has this shape: draws in a resumable order."""

    def next_batch(self, n: int) -> list[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class AdmissionGate(Protocol):
    """AReaL's staleness bound counted in groups (`rollout/staleness.py`, `StalenessGate`, has this
    shape): `try_acquire` starts one group if allowed, `release` ends it (kept or not)."""

    def capacity(self) -> int: ...

    def try_acquire(self) -> bool: ...

    def release(self, accepted: bool) -> None: ...

    def on_version(self, version: int, consumed: int | None = None, batch_size: int | None = None) -> None: ...


class EngineRestarter(Protocol):
    """Replaces a dead engine (embedded engines: a new process); returns its new client."""

    async def arestart(self, index: int, engine: RolloutEngine) -> RolloutEngine: ...


class _Signal:
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


async def _await_within(awaitable: Any, timeout_s: float) -> Any:
    """`await` with a time limit (TimeoutError), cancellation-safe on Python 3.11 (see _Signal)."""
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


@dataclass(eq=False)  # slots compare by identity
class _Slot:
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


class RolloutManager:
    """Drives engines, workflow, gate and sink. Lifecycle: (`load_state_dict`) -> `astart` ->
    ... -> `astop`; or `arun()` until the notice says stop, the prompts run out, or `astop()`."""

    def __init__(
        self,
        config: RolloutConfig,
        engines: list[RolloutEngine],
        prompts: PromptProvider,
        workflow: RolloutWorkflow,
        sink: TrajectorySink,
        gate: AdmissionGate | None = None,
        *,
        restarter: EngineRestarter | None = None,
        notice_path: str | None = None,  # learner -> manager: WeightNotice JSON, polled
        status_path: str | None = None,  # manager -> learner: RolloutStatus JSON
        initial_version: int = 0,  # the version the engines start with
        poll_interval_s: float = 0.2,
        health_interval_s: float = 1.0,
        restart_grace_s: float = 30.0,  # a restarted engine gets this long to turn healthy
        max_inflight_groups: int | None = None,  # None: enough groups to fill every engine slot
        max_episode_attempts: int = 3,  # scoring failures before a group is dropped (counted)
        clock: Callable[[], float] = time.monotonic,
        run_id: str | None = None,  # begins the weight groups' names, with a token of this start
    ) -> None:
        if not engines:
            raise ValueError("RolloutManager: no engines (rollout.engine_urls / rollout.num_engines)")
        if not config.partial_rollout and config.pause_mode != "abort":
            raise ValueError(
                f"rollout.partial_rollout=false needs rollout.pause_mode=abort (got {config.pause_mode!r}): "
                "retract/in_place continue requests on the engine under the new weights"
            )
        self.config = config
        self._prompts, self._workflow, self._sink, self._gate = prompts, workflow, sink, gate
        self._restarter = restarter
        self._notice_path, self._status_path = notice_path, status_path
        self._slots = [_Slot(i, e, initial_version) for i, e in enumerate(engines)]
        self._initial_version = initial_version  # what engines serve before any push (and after a restart)
        self._version = initial_version
        self._weights: WeightVersion | None = None  # what every engine must serve; None: the initial weights
        self._awaiting_weights = False  # restored at a version no engine serves yet: wait for its publication
        self._poll_s, self._health_s, self._restart_grace_s = poll_interval_s, health_interval_s, restart_grace_s
        slots = len(engines) * config.max_concurrent_per_engine
        self._max_inflight = max_inflight_groups or max(1, math.ceil(slots / config.group_size))
        self._max_attempts = max_episode_attempts
        self._clock = clock
        self._signal = _Signal()
        self._update_lock = asyncio.Lock()
        self._group_tag = group_tag(run_id)  # weight_sync=distributed: new names at every manager start
        self._active: dict[int, Episode] = {}  # admitted, running
        self._tasks: dict[int, asyncio.Task] = {}
        self._writing: set[int] = set()  # groups inside sink.aput_group: never cancelled
        self._resume: collections.deque[Episode] = collections.deque()  # re-run first
        self._background: list[asyncio.Task] = []
        self._paused = self._stopping = self._stop_requested = self._exhausted = False
        self._started = False
        self._fatal: BaseException | None = None
        self._error: str | None = None  # the fatal error as the learner reads it in the status
        self._state_answered: str | None = None
        self._rid_seq = 0
        self._count: collections.Counter[str] = collections.Counter({k: 0 for k in COUNTERS})
        self._weight_update_s = 0.0
        self._window = (clock(), 0.0, 0, 0, 0.0, 0)  # t, busy, samples, tokens, reward_sum, groups

    # ---- public API -------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    async def astart(self) -> None:
        """Start admission, notice polling and health checks (idempotent)."""
        if self._started:
            return
        self._started = True
        self._window = (self._clock(), self._busy(), *self._window[2:])
        # a previous manager may have stopped in the middle of an update, leaving engines paused
        await asyncio.gather(*(self._aop(s, "resume", s.engine.aresume) for s in self._slots))
        if self._awaiting_weights:
            log.info("restored at weight version %d: requests start once the learner publishes it",
                     self._version)
        loops = [("admission", self._aadmit_forever), ("health checks", self._ahealth_loop)]
        if self._notice_path:
            loops.append(("notice polling", self._anotice_loop))
        self._background = [asyncio.create_task(self._aguard(name, loop)) for name, loop in loops]

    async def arun(self) -> None:
        """Run until a stop notice, `request_stop()`, a fatal error, or no prompts left (noticed
        when admission draws nothing: a closed gate never draws, so use `await_groups` then
        `astop` to end a bounded run)."""
        await self.astart()
        try:
            await self._signal.wait_for(lambda: self._stop_requested or self._fatal is not None or (
                self._exhausted and not self._active and not self._resume))
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
        await self._signal.wait_for(lambda: self._finished() >= n or self._fatal is not None)
        if self._fatal is not None:
            raise self._fatal

    async def astop(self, drain: bool = False) -> None:
        """Stop admitting; with `drain`, let admitted groups finish first; then cancel the rest
        (they stay in `state_dict()`), leaving groups being written to finish their write."""
        self._stopping = True
        self._signal.notify()
        if drain:
            await self._signal.wait_for(lambda: not self._active or self._fatal is not None)
        for task in self._background:
            task.cancel()
        for uid, task in list(self._tasks.items()):
            if uid not in self._writing:
                task.cancel()
        await asyncio.gather(*self._background, *self._tasks.values(), return_exceptions=True)
        self._background = []
        self._write_status()

    async def aupdate_weights(self, weights: WeightVersion, consumed: int | None = None,
                              new_groups: int | None = None) -> None:
        """Pause every live engine (`pause_mode`), load `weights`, resume. Older versions are ignored;
        the current version is loaded again only from a new location, or when a restored manager
        waits for it (a resumed run publishes the checkpoint's version afresh at launch).
        `consumed`, `new_groups`: what the learner used up and its next step takes, for the gate."""
        async with self._update_lock:
            same = self._weights is None or weights.location == self._weights.location
            # a restored manager takes the learner's first publication whatever its version: it
            # is what the resumed policy is (waiting for a higher one could wait for ever)
            if not self._awaiting_weights and (weights.version < self._version or
                                               (weights.version == self._version and same)):
                return
            t0 = self._clock()
            self._paused = True
            try:
                live = [s for s in self._slots if s.up]
                mode = self.config.pause_mode
                await asyncio.gather(*(self._aop(s, "pause", lambda s=s: s.engine.apause(mode)) for s in live))
                self._version, self._weights = weights.version, weights
                self._awaiting_weights = False  # engines that miss it now get it when they come back
                if self._gate is not None:
                    self._gate.on_version(weights.version, consumed, new_groups)  # the learner's counts, if sent
                await self._apush(weights, [s for s in live if s.up])
                # nothing stays paused: an engine whose pause or update failed is down, but resumed,
                # unless it may hold part of a version (it resumes once it has loaded a whole one)
                await asyncio.gather(*(self._aresume_quietly(s) for s in live if not s.up and not s.partial))
            finally:
                self._paused = False
                self._signal.notify()
            self._weight_update_s = self._clock() - t0
            self._count["weight_updates"] += 1
            self._count["weight_update_s_total"] += self._weight_update_s
        self._write_status()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs: loader position, prompts in flight with partial responses.
        Take it when no group is being written (after `astop`, or as the notice loop does):
        then the first `counters["groups_written"]` groups in the ring and the state's episodes
        partition every prompt drawn."""
        episodes = [*self._active.values(), *self._resume]
        return {
            "format": STATE_FORMAT,
            "version": self._version,
            "weights": asdict(self._weights) if self._weights is not None else None,
            "loader": self._prompts.state_dict(),
            "episodes": [e.to_json() for e in episodes],
            "counters": {k: v for k, v in self._count.items()},
            "gate": self._gate.state_dict() if hasattr(self._gate, "state_dict") else None,
        }

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
        self._resume = collections.deque(Episode.from_json(e) for e in state["episodes"])
        self._version = int(state["version"])
        w = state.get("weights")
        if w:
            weight_version_from_json(w, "rollout state 'weights'")  # validated, not pushed (see above)
        self._weights = None
        self._awaiting_weights = self._version != self._initial_version
        self._count = collections.Counter({k: 0 for k in COUNTERS}, **state.get("counters", {}))
        if self._gate is not None:
            if state.get("gate") is not None and hasattr(self._gate, "load_state_dict"):
                self._gate.load_state_dict(state["gate"])
            self._gate.on_version(self._version)

    def metrics(self) -> dict[str, float]:
        """Counters since the start (`rollout/...`) and rates since the last call (`perf/...`)."""
        now, busy = self._clock(), self._busy()
        t0, busy0, samples0, tokens0, reward0, groups0 = self._window
        c = self._count
        dt = max(now - t0, 1e-9)
        groups = c["groups_written"] - groups0
        out = {f"rollout/{k}": float(v) for k, v in sorted(c.items())}
        out.update({
            "rollout/version": float(self._version),
            "rollout/engines_up": float(sum(s.up for s in self._slots)),
            "rollout/inflight_groups": float(len(self._active)),
            "rollout/inflight_requests": float(sum(len(s.inflight) for s in self._slots)),
            "rollout/reward_mean": (c["reward_sum"] - reward0) / max(c["samples_written"] - samples0, 1),
            "perf/samples_per_s": (c["samples_written"] - samples0) / dt,
            "perf/groups_per_s": groups / dt,
            "perf/gen_tokens_per_s": (c["tokens_generated"] - tokens0) / dt,
            "perf/engine_idle_frac": max(0.0, 1.0 - (busy - busy0) / (dt * len(self._slots))),
            "perf/weight_update_s": self._weight_update_s,
        })
        self._window = (now, busy, c["samples_written"], c["tokens_generated"], c["reward_sum"], c["groups_written"])
        return out

    # ---- SampleClient: what the workflow calls -----------------------------------------

    async def agenerate_sample(self, sample: SampleState, sampling: SamplingParams) -> None:
        """Run one sample to its end: continue after aborts, move to another engine on failure."""
        while not sample.done:
            slot = await self._aacquire()
            self._rid_seq += 1
            req = GenerateRequest(
                input_ids=sample.next_input_ids(),
                sampling=replace(sampling, max_new_tokens=sample.remaining, seed=sample.next_seed()),
                rid=f"darl-{self._rid_seq}",
            )
            resp = await self._acall(slot, req)
            if resp is None:
                self._count["requeued_requests"] += 1
                continue
            try:
                sample.absorb(resp, keep_partial=self.config.partial_rollout)
            except ValueError as exc:
                self._mark_down(slot, f"malformed response: {exc}")
                self._count["requeued_requests"] += 1
                continue
            self._count["requests"] += 1
            self._count["tokens_generated"] += len(resp.output_ids)
            if resp.finish_reason == "abort":
                self._count["aborted_requests"] += 1
                if not self.config.partial_rollout:
                    self._count["restarted_samples"] += 1

    # ---- dispatch ------------------------------------------------------------------------

    def _free_slot(self) -> _Slot | None:
        if self._paused:
            return None
        cap = self.config.max_concurrent_per_engine
        # only engines serving the current version (after a restore: none until it is published)
        ready = [s for s in self._slots if s.up and s.version == self._version and len(s.inflight) < cap]
        return min(ready, key=lambda s: (len(s.inflight), s.index)) if ready else None

    async def _aacquire(self) -> _Slot:
        await self._signal.wait_for(lambda: self._free_slot() is not None)
        slot = self._free_slot()
        assert slot is not None  # no await since the predicate held
        return slot

    async def _acall(self, slot: _Slot, req: GenerateRequest) -> GenerateResponse | None:
        """One request; None when it failed (the engine is then down) or was cancelled with it;
        `RequestRefused` when the engine refused the request itself (REFUSED_STATUSES)."""
        fut = asyncio.ensure_future(slot.engine.agenerate(req))
        slot.add(req.rid, fut, self._clock())
        try:
            done, _ = await asyncio.wait({fut}, timeout=self.config.request_timeout_s)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        finally:
            slot.remove(req.rid, self._clock())
            self._signal.notify()
        if not done:
            fut.cancel()
            self._mark_down(slot, f"request {req.rid} timed out after {self.config.request_timeout_s}s")
            return None
        if fut.cancelled():
            return None  # its engine was marked down by another request
        exc = fut.exception()
        if exc is not None:
            if getattr(exc, "status", None) in REFUSED_STATUSES:  # the request's fault, not the engine's
                self._count["requests_refused"] += 1
                raise RequestRefused(f"engine {slot.engine.url} refused request {req.rid}: {exc}") from exc
            self._mark_down(slot, f"request {req.rid} failed: {exc!r}")
            return None
        return fut.result()

    def _mark_down(self, slot: _Slot, reason: str) -> None:
        if not slot.up:
            return
        slot.up = False
        slot.version = -1  # unknown: it may come back restarted, with its initial weights
        slot.incarnation += 1
        self._count["engine_failures"] += 1
        log.warning("engine %d (%s) marked down: %s", slot.index, slot.engine.url, reason)
        for fut in list(slot.inflight.values()):
            fut.cancel()  # a dead engine answers none of them; requeue all now, not after timeouts
        self._signal.notify()

    async def _aop(self, slot: _Slot, what: str, make: Callable[[], Any]) -> bool:
        """A control call (pause/update/resume/health) bounded by the request timeout."""
        try:
            result = await _await_within(make(), self.config.request_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._mark_down(slot, f"{what} failed: {exc!r}")
            return False
        return result is not False

    async def _apush(self, weights: WeightVersion, slots: list[_Slot]) -> None:
        if weights.kind == "distributed":
            await self._apush_distributed(weights, slots)
        else:
            await asyncio.gather(*(self._aop(s, "update_weights", lambda s=s: s.engine.aupdate_weights(weights))
                                   for s in slots))
            for s in slots:
                s.version = weights.version if s.up else s.version
        await asyncio.gather(*(self._aop(s, "resume", s.engine.aresume) for s in slots if s.up))

    async def _apush_distributed(self, weights: WeightVersion, slots: list[_Slot]) -> None:
        """The learner broadcasts to the paused engines (`weight_transfer.py`)."""
        from megatron_darl.channel.weight_transfer import TransferClient
        from megatron_darl.rollout.weight_push import apush_distributed

        if self._notice_path is None:
            raise ValueError("weight_sync=distributed needs the notice path (the learner answers beside it)")
        client = TransferClient(self._notice_path, self.config.request_timeout_s)
        await apush_distributed(client, weights, slots, self._group_tag, self._aop, self._count, self._mark_down)

    # ---- health -------------------------------------------------------------------------

    async def _ahealth_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_s)
            await asyncio.gather(*(self._arevive(s) for s in self._slots if not s.up))

    async def _ahealthy(self, slot: _Slot) -> bool:
        try:
            return bool(await _await_within(slot.engine.ahealth(), self.config.request_timeout_s))
        except asyncio.CancelledError:
            raise
        except Exception:
            return False

    async def _aresume_quietly(self, slot: _Slot) -> None:
        """Best-effort /continue_generation to an engine that is down: one left paused after a
        failed update must not stay so (a paused SGLang server also answers its health route
        503, so it would never look healthy again). Failures mean it is really gone: ignored."""
        try:  # bounded: a dead engine must not hold up a weight update or the health loop long
            await _await_within(slot.engine.aresume(), min(self.config.request_timeout_s, 5.0))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("engine %d (%s): resume while down failed: %r", slot.index, slot.engine.url, exc)

    async def _arevive(self, slot: _Slot) -> None:
        if slot.partial:  # no resume and no probe (a paused engine fails it): a whole version first
            if await self._areload(slot) or self._restarter is None:
                return  # back, or tried again at the next round
            healthy = False  # it does not take a version: a restart gives it whole (initial) weights
        else:
            await self._aresume_quietly(slot)  # before the health check: paused is not dead
            healthy = await self._ahealthy(slot)
        now = self._clock()
        if not healthy and self._restarter is not None and now - slot.last_restart >= self._restart_grace_s:
            slot.last_restart = now
            self._count["engine_restarts"] += 1
            try:
                slot.engine = await self._restarter.arestart(slot.index, slot.engine)
            except Exception as exc:
                log.warning("engine %d: restart failed: %r", slot.index, exc)
                return
            slot.partial = False  # a new engine process, on its initial weights
            healthy = await self._ahealthy(slot)
        if healthy:
            await self._areload(slot)

    async def _areload(self, slot: _Slot) -> bool:
        """Load the current weights on a down engine and resume it; True once it is back up."""
        async with self._update_lock:  # an engine returns with the current weights, never between
            ok = True
            if self._weights is not None and self._weights.kind == "distributed":
                await self._apush_distributed(self._weights, [slot])  # a new group: new incarnation
                ok = slot.version >= self._weights.version
            elif self._weights is not None:
                weights = self._weights
                ok = await self._aop(slot, "update_weights", lambda: slot.engine.aupdate_weights(weights))
                slot.version = weights.version if ok else slot.version
                slot.partial = slot.partial and not ok
            else:  # nothing to push: it serves its initial weights (behind, after a restore)
                slot.version = self._initial_version
            # resume too: it may have gone down while paused (a no-op on a running engine)
            if ok and not slot.partial and await self._aop(slot, "resume", slot.engine.aresume):
                slot.up = True  # only now may requests reach it
                self._count["engine_recoveries"] += 1
                log.info("engine %d (%s) is back at version %d", slot.index, slot.engine.url, slot.version)
        self._signal.notify()
        return slot.up

    # ---- admission and episodes ----------------------------------------------------------

    def _finished(self) -> int:
        c = self._count
        return c["groups_written"] + c["filtered_groups"] + c["groups_dropped"]

    def _may_admit(self) -> bool:
        if self._stopping or self._paused or len(self._active) >= self._max_inflight:
            return False
        if self._exhausted and not self._resume:
            return False
        # re-runs (checkpointed, failed scoring) go first, but through the gate like any group
        return self._gate is None or self._gate.capacity() > 0

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
            self._write_status()
        except Exception as status_exc:  # the status folder is broken too: the log still says it
            log.error("could not write the rollout status with the error: %r", status_exc)

    async def _aadmit_forever(self) -> None:
        while True:
            await self._signal.wait_for(self._may_admit)
            if self._resume:
                episode = self._resume.popleft()
            else:
                drawn = self._prompts.next_batch(1)
                if not drawn:
                    self._exhausted = True  # re-runs of failed groups are still admitted
                    self._signal.notify()
                    continue
                episode = self._workflow.new_episode(drawn[0])
                self._count["prompts_drawn"] += 1
            if episode.uid in self._active:
                raise ValueError(f"prompt uid {episode.uid} drawn twice while in flight")
            if self._gate is not None and not self._gate.try_acquire():
                raise RuntimeError("admission gate refused a group right after reporting capacity")
            self._active[episode.uid] = episode
            self._tasks[episode.uid] = asyncio.create_task(self._adrive(episode))

    def _retire(self, episode: Episode, accepted: bool) -> None:
        self._active.pop(episode.uid, None)
        self._tasks.pop(episode.uid, None)
        if self._gate is not None:
            self._gate.release(accepted)
        self._signal.notify()

    async def _adrive(self, episode: Episode) -> None:
        try:
            trajs = await self._workflow.arun_episode(self, episode)
        except asyncio.CancelledError:
            raise  # stays in _active, hence in state_dict()
        except RequestRefused as exc:  # every engine would refuse it: no re-run
            self._retire(episode, accepted=False)
            log.error("prompt %d dropped: %s", episode.uid, exc)
            self._count["groups_dropped"] += 1
            return
        except Exception as exc:
            episode.attempts += 1
            self._retire(episode, accepted=False)
            if episode.attempts < self._max_attempts:
                log.warning("prompt %d failed (%r); re-running (attempt %d)", episode.uid, exc, episode.attempts)
                self._resume.append(episode)
                self._count["episode_retries"] += 1
            else:
                log.error("prompt %d dropped after %d failures: %r", episode.uid, episode.attempts, exc)
                self._count["groups_dropped"] += 1
            return
        if trajs is None:
            self._count["filtered_groups"] += 1
            self._retire(episode, accepted=False)
            return
        self._writing.add(episode.uid)
        try:
            await self._sink.aput_group(trajs)
        except Exception as exc:  # the ring is gone or broken: nothing sensible to continue with
            self._fail(f"writing prompt {episode.uid} to the ring failed: {exc!r}", exc)
            return
        finally:
            self._writing.discard(episode.uid)
        self._count["groups_written"] += 1
        self._count["samples_written"] += len(trajs)
        self._count["reward_sum"] += sum(t.reward for t in trajs)
        self._retire(episode, accepted=True)

    # ---- learner notices -----------------------------------------------------------------

    async def _anotice_loop(self) -> None:
        assert self._notice_path is not None
        poller = NoticePoller(self._notice_path)
        last_status = -math.inf
        while True:
            try:
                notice = poller.poll()
            except ValueError as exc:  # someone else wrote the file: say so, keep polling
                log.error("%s", exc)
                notice = None
            if notice is not None:
                if notice.weights is not None:
                    await self.aupdate_weights(notice.weights, consumed=notice.consumed, new_groups=notice.new_groups)
                if notice.state_request and notice.state_request != self._state_answered:
                    # a clean cut: every group is then either whole in the ring or in the state
                    await self._signal.wait_for(lambda: not self._writing)
                    try:
                        write_json_atomic(notice.state_request, self.state_dict())
                    except OSError as exc:
                        raise OSError(f"cannot write the rollout state to {notice.state_request}: {exc}") from exc
                    self._state_answered = notice.state_request
                    self._write_status()
                if notice.stop:
                    self.request_stop()
            if self._clock() - last_status >= 1.0:  # counters for the learner's logs, once a second
                self._write_status()
                last_status = self._clock()
            await asyncio.sleep(self._poll_s)

    def _write_status(self) -> None:
        if not self._status_path:
            return
        c = self._count
        write_status(self._status_path, RolloutStatus(
            version=self._version, groups_written=c["groups_written"], groups_filtered=c["filtered_groups"],
            state_path=self._state_answered, error=self._error,
            metrics={**{f"rollout/{k}": float(v) for k, v in c.items()},
                     "rollout/engine_busy_s": self._busy(),  # engine-seconds with requests in flight
                     # what a learner waiting for data names (trainer/publication.py, rollout_report)
                     "rollout/engines_up": float(sum(s.up for s in self._slots)),
                     "rollout/inflight_groups": float(len(self._active)),
                     **(self._gate.metrics() if hasattr(self._gate, "metrics") else {}),
                     **getattr(self._prompts, "metrics", dict)()},  # data rows dropped (rollout/prompts_rejected)
        ))

    def _busy(self) -> float:
        return sum(s.busy_total(self._clock()) for s in self._slots)

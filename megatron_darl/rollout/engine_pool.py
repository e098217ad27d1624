"""The rollout manager's engines: dispatch, failure, health, revival and weight loading.

What it is: `EnginePool`, one `EngineSlot` per engine. It hands a request to the least-loaded
engine that serves the current version (at most `max_concurrent_per_engine` in flight on each),
bounds every call by the request timeout, and marks an engine down when a request or a control
call fails or hangs: everything in flight on it is cancelled at once (the samples go to other
engines). A health loop brings down engines back (restarting embedded ones through the restarter)
with the current weights. It pauses the engines for a weight update and loads a version on them:
from a folder, or by the learner's broadcast (`weight_push.py`). An engine whose distributed
transfer failed may hold part of a version (SGLang loads each bucket as it arrives): it is left
paused, gets no requests, and the health loop has it load a whole version before it resumes.
It keeps its own counters (`POOL_COUNTERS`), which the manager reports and saves with its own.
An engine's state is its `EngineSlot` (`engine_slot.py`); `Signal`, the wake-up the pool and the
manager share, and the bounded await are `waits.py`.
What it is not: admission, episodes, notices or the rollout state (`manager.py`), nor an engine
client (`api.RolloutEngine`, `sglang_client.py`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, Protocol

from megatron_darl.channel.weight_transfer import TransferClient, group_tag
from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout.api import RolloutEngine
from megatron_darl.rollout.engine_slot import EngineSlot
from megatron_darl.rollout.probe import ProbeChecker, ProbeFailed
from megatron_darl.rollout.waits import Signal, await_within
from megatron_darl.rollout.weight_push import apush_distributed
from megatron_darl.rollout.workflow import SampleState
from megatron_darl.types import GenerateRequest, GenerateResponse, SamplingParams, WeightVersion

log = logging.getLogger(__name__)

# what the pool counts; the manager reports them with its own as `rollout/<name>` and saves them
# in its state (a stable key set: zero until something happens)
POOL_COUNTERS = (
    "requests", "requeued_requests", "aborted_requests", "restarted_samples", "tokens_generated",
    "requests_refused", "engine_failures", "engine_restarts", "engine_recoveries", "weight_sync_fallbacks",
    "probe_checks", "probe_failures", "probe_dropped_samples",  # the weight probe (`probe.py`)
)

# answers that refuse the request, not the engine (SGLang and darl-engine: a field out of range, a
# prompt past the context, a body or batch past a bound): the group is dropped, the engine stays up
REFUSED_STATUSES = (400, 413, 422)


class RequestRefused(RuntimeError):
    """An engine refused a generation request with a 4xx naming what is wrong with it: no engine
    would serve it, so its group is dropped at once (counted and logged), not re-run."""


class EngineRestarter(Protocol):
    """Replaces a dead engine (embedded engines: a new process); returns its new client."""

    async def arestart(self, index: int, engine: RolloutEngine) -> RolloutEngine: ...


class EnginePool:
    """The engines of one manager. `version` and `weights` are what every engine must serve
    (`weights` None: the initial weights); the manager sets them during a weight update, under
    `update_lock` and inside `apaused()`."""

    def __init__(
        self,
        config: RolloutConfig,
        engines: list[RolloutEngine],
        *,
        signal: Signal,
        restarter: EngineRestarter | None = None,
        notice_path: str | None = None,  # the learner answers transfer requests beside it
        initial_version: int = 0,
        health_interval_s: float = 1.0,
        restart_grace_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        run_id: str | None = None,
    ) -> None:
        """One slot per engine, every one up and serving `initial_version`.

        Args:
            config: the `rollout` section (`max_concurrent_per_engine`, `request_timeout_s`, `weight_sync`).
            engines: the engine clients, in index order.
            signal: the manager's wake-up signal, notified whenever a slot frees or an engine goes down.
            restarter: replaces a dead embedded engine with a new process; None: down engines are only
                probed and resumed, never restarted.
            notice_path: the learner's weight notice file, beside which it answers transfer requests;
                needed by `weight_sync=distributed`, None otherwise.
            initial_version: the version the engines serve before any push, and after a restart.
            health_interval_s: seconds between the health loop's attempts to bring down engines back.
            restart_grace_s: the least seconds between two restarts of the same engine.
            clock: the monotonic clock in seconds for busy times and restart spacing (tests pass a fake).
            run_id: begins the distributed-update group names (`group_tag`), so no other run's groups share
                a name; None: a random token alone.
        """
        self.config = config
        self.slots = [EngineSlot(i, e, initial_version) for i, e in enumerate(engines)]
        self.initial_version = initial_version  # what engines serve before any push (and after a restart)
        self.version = initial_version
        self.weights: WeightVersion | None = None
        self.paused = False  # a weight update is under way: no request is dispatched
        self.update_lock = asyncio.Lock()
        self._signal, self._clock = signal, clock
        self.counts: collections.Counter[str] = collections.Counter({k: 0 for k in POOL_COUNTERS})
        self._restarter, self._notice_path = restarter, notice_path
        self._health_s, self._restart_grace_s = health_interval_s, restart_grace_s
        self._group_tag = group_tag(run_id)  # weight_sync=distributed: new names at every manager start
        self._rid_seq = 0
        self.prober = ProbeChecker(*config.probe_thresholds(), config.request_timeout_s)  # `.probe` set with weights

    # ---- state, for metrics and shutdown --------------------------------------------------

    @property
    def engines(self) -> list[RolloutEngine]:
        """Every engine's client now (restarted ones included): what to close at the end."""
        return [s.engine for s in self.slots]

    def engines_up(self) -> int:
        return sum(s.up for s in self.slots)

    def inflight_requests(self) -> int:
        return sum(len(s.inflight) for s in self.slots)

    def busy_s(self) -> float:
        """Engine-seconds with requests in flight, since the start."""
        return sum(s.busy_total(self._clock()) for s in self.slots)

    def count(self, name: str, n: float = 1) -> None:
        """Add `n` to one of POOL_COUNTERS (the key set is stable: an unknown name is a bug)."""
        if name not in self.counts:
            raise KeyError(f"EnginePool.count: {name!r} is not one of POOL_COUNTERS")
        self.counts[name] += n

    def load_counts(self, saved: dict[str, float]) -> None:
        """Restore the counters from a saved state (names the pool does not count are ignored)."""
        self.counts = collections.Counter({k: saved.get(k, 0) for k in POOL_COUNTERS})

    # ---- dispatch ------------------------------------------------------------------------

    def _free_slot(self) -> EngineSlot | None:
        if self.paused:
            return None
        cap = self.config.max_concurrent_per_engine
        # only engines serving the current version (after a restore: none until it is published)
        ready = [s for s in self.slots if s.up and s.version == self.version and len(s.inflight) < cap]
        return min(ready, key=lambda s: (len(s.inflight), s.index)) if ready else None

    async def aacquire(self) -> EngineSlot:
        """The least-loaded engine with room that serves the current version (waits for one)."""
        await self._signal.wait_for(lambda: self._free_slot() is not None)
        slot = self._free_slot()
        assert slot is not None  # no await since the predicate held
        return slot

    async def acall(self, slot: EngineSlot, req: GenerateRequest) -> GenerateResponse | None:
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
            self.mark_down(slot, f"request {req.rid} timed out after {self.config.request_timeout_s}s")
            return None
        if fut.cancelled():
            return None  # its engine was marked down by another request
        exc = fut.exception()
        if exc is not None:
            if getattr(exc, "status", None) in REFUSED_STATUSES:  # the request's fault, not the engine's
                self.count("requests_refused")
                raise RequestRefused(f"engine {slot.engine.url} refused request {req.rid}: {exc}") from exc
            self.mark_down(slot, f"request {req.rid} failed: {exc!r}")
            return None
        return fut.result()

    def mark_down(self, slot: EngineSlot, reason: str) -> None:
        """Take an engine out of service and cancel everything in flight on it (requeued now)."""
        if not slot.up:
            return
        slot.up = False
        slot.version = -1  # unknown: it may come back restarted, with its initial weights
        slot.incarnation += 1
        self.count("engine_failures")
        log.warning("engine %d (%s) marked down: %s", slot.index, slot.engine.url, reason)
        for fut in list(slot.inflight.values()):
            fut.cancel()  # a dead engine answers none of them; requeue all now, not after timeouts
        self._signal.notify()

    async def acontrol(self, slot: EngineSlot, what: str, make: Callable[[], Any]) -> bool:
        """A control call (pause/update/resume/health) bounded by the request timeout; False
        (the engine marked down) when it failed or hung."""
        try:
            result = await await_within(make(), self.config.request_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.mark_down(slot, f"{what} failed: {exc!r}")
            return False
        return result is not False

    async def agenerate_sample(self, sample: SampleState, sampling: SamplingParams) -> None:
        """Run one sample to its end (the workflow's `SampleClient`, through the manager): continue
        after aborts, move to another engine on failure."""
        while not sample.done:
            slot = await self.aacquire()
            self._rid_seq += 1
            req = GenerateRequest(
                input_ids=sample.next_input_ids(),
                sampling=replace(sampling, max_new_tokens=sample.remaining, seed=sample.next_seed()),
                rid=f"darl-{self._rid_seq}",
            )
            resp = await self.acall(slot, req)
            if resp is None:
                self.count("requeued_requests")
                continue
            try:
                sample.absorb(resp, keep_partial=self.config.partial_rollout)
            except ValueError as exc:
                self.mark_down(slot, f"malformed response: {exc}")
                self.count("requeued_requests")
                continue
            self.count("requests")
            self.count("tokens_generated", len(resp.output_ids))
            if resp.finish_reason == "abort":
                self.count("aborted_requests")
                if not self.config.partial_rollout:
                    self.count("restarted_samples")

    # ---- weight updates ------------------------------------------------------------------

    async def aresume_all(self) -> None:
        """Resume every engine (a previous manager may have stopped mid-update, leaving them paused)."""
        await asyncio.gather(*(self.acontrol(s, "resume", s.engine.aresume) for s in self.slots))

    @contextlib.asynccontextmanager
    async def apaused(self) -> AsyncIterator[list[EngineSlot]]:
        """Stop dispatch and pause the live engines (`pause_mode`); yields them. On exit dispatch
        goes on (the engines resume in `apush`)."""
        self.paused = True
        try:
            live = [s for s in self.slots if s.up]
            mode = self.config.pause_mode
            await asyncio.gather(*(self.acontrol(s, "pause", lambda s=s: s.engine.apause(mode)) for s in live))
            yield live
        finally:
            self.paused = False
            self._signal.notify()

    async def apush(self, weights: WeightVersion, live: list[EngineSlot]) -> None:
        """Load `weights` on the paused engines of `live` still up and resume them. Nothing stays
        paused: an engine whose pause or update failed is down, but resumed, unless it may hold
        part of a version (it resumes once it has loaded a whole one)."""
        slots = [s for s in live if s.up]
        if weights.weight_sync == "distributed":
            await self.apush_distributed(weights, slots)
        else:
            await asyncio.gather(*(self.acontrol(s, "update_weights", lambda s=s: s.engine.aupdate_weights(weights))
                                   for s in slots))
            for s in slots:
                s.version = weights.version if s.up else s.version
        await asyncio.gather(*(self.acontrol(s, "resume", s.engine.aresume) for s in slots if s.up))
        await asyncio.gather(*(self.aprobe(s) for s in slots if s.up))  # dispatch is still held (`apaused`)
        await asyncio.gather(*(self._aresume_quietly(s) for s in live if not s.up and not s.partial))

    async def apush_distributed(self, weights: WeightVersion, slots: list[EngineSlot]) -> None:
        """The learner broadcasts to the paused engines (`weight_transfer.py`)."""
        if self._notice_path is None:
            raise ValueError("weight_sync=distributed needs the notice path (the learner answers beside it)")
        client = TransferClient(self._notice_path, self.config.request_timeout_s)
        await apush_distributed(client, weights, slots, self._group_tag, self)

    async def aprobe(self, slot: EngineSlot) -> bool:
        """Check `slot` against the current version's probe before it gets requests; False
        (the engine down, to be restarted) when it fails. `ProbeFailed` stops the run."""
        try:
            result = await self.prober.acheck(slot)
        except ProbeFailed:  # counted too: the status written as the run stops shows it
            self.count("probe_checks")
            self.count("probe_failures")
            raise
        except Exception as exc:  # the engine did not answer: down, as after any failed call
            if slot.up:
                self.mark_down(slot, f"weight probe request failed: {exc!r}")
            return False
        if result is None:
            return True
        self.count("probe_checks")
        if result["ok"]:
            return True
        self.count("probe_failures")
        self.count("probe_dropped_samples", len(slot.inflight))  # their tokens on it are discarded
        slot.restart_wanted = True
        reason = f"weight probe of version {self.prober.probe.version} failed: max |delta| {result['max_abs']:.3g}"
        if slot.up:
            self.mark_down(slot, reason)
        else:  # being revived: it stays down
            slot.version = -1
            log.warning("engine %d (%s) stays down: %s", slot.index, slot.engine.url, reason)
        return False

    # ---- health -------------------------------------------------------------------------

    async def ahealth_loop(self) -> None:
        """Forever: try to bring every down engine back, once per health interval."""
        while True:
            await asyncio.sleep(self._health_s)
            await asyncio.gather(*(self._arevive(s) for s in self.slots if not s.up))

    async def _ahealthy(self, slot: EngineSlot) -> bool:
        try:
            return bool(await await_within(slot.engine.ahealth(), self.config.request_timeout_s))
        except asyncio.CancelledError:
            raise
        except Exception:
            return False

    async def _aresume_quietly(self, slot: EngineSlot) -> None:
        """Best-effort /continue_generation to an engine that is down: one left paused after a
        failed update must not stay so (a paused SGLang server also answers its health route
        503, so it would never look healthy again). Failures mean it is really gone: ignored."""
        try:  # bounded: a dead engine must not hold up a weight update or the health loop long
            await await_within(slot.engine.aresume(), min(self.config.request_timeout_s, 5.0))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("engine %d (%s): resume while down failed: %r", slot.index, slot.engine.url, exc)

    async def _arevive(self, slot: EngineSlot) -> None:
        if slot.partial:  # no resume and no probe (a paused engine fails it): a whole version first
            if await self._areload(slot) or self._restarter is None:
                return  # back, or tried again at the next round
            healthy = False  # it does not take a version: a restart gives it whole (initial) weights
        elif slot.restart_wanted and self._restarter is not None:
            healthy = False  # wrong weights: a new process (without a restarter: a reload, below)
        else:
            await self._aresume_quietly(slot)  # before the health check: paused is not dead
            healthy = await self._ahealthy(slot)
        now = self._clock()
        if not healthy and self._restarter is not None and now - slot.last_restart >= self._restart_grace_s:
            slot.last_restart = now
            self.count("engine_restarts")
            try:
                slot.engine = await self._restarter.arestart(slot.index, slot.engine)
            except Exception as exc:
                log.warning("engine %d: restart failed: %r", slot.index, exc)
                return
            slot.partial = slot.restart_wanted = False  # a new engine process, on its initial weights
            healthy = await self._ahealthy(slot)
        if healthy:
            await self._areload(slot)

    async def _areload(self, slot: EngineSlot) -> bool:
        """Load the current weights on a down engine and resume it; True once it is back up."""
        async with self.update_lock:  # an engine returns with the current weights, never between
            ok = True
            if self.weights is not None and self.weights.weight_sync == "distributed":
                await self.apush_distributed(self.weights, [slot])  # a new group: new incarnation
                ok = slot.version >= self.weights.version
            elif self.weights is not None:
                weights = self.weights
                ok = await self.acontrol(slot, "update_weights", lambda: slot.engine.aupdate_weights(weights))
                slot.version = weights.version if ok else slot.version
                slot.partial = slot.partial and not ok
            else:  # nothing to push: it serves its initial weights (behind, after a restore)
                slot.version = self.initial_version
            # resume too: it may have gone down while paused (a no-op on a running engine)
            if (ok and not slot.partial and await self.acontrol(slot, "resume", slot.engine.aresume)
                    and await self.aprobe(slot)):
                slot.up = True  # only now may requests reach it
                self.count("engine_recoveries")
                log.info("engine %d (%s) is back at version %d", slot.index, slot.engine.url, slot.version)
        self._signal.notify()
        return slot.up

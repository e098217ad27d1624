"""darl-engine's decode loop: continuous batching over one Decoder, and the queues around it.

What it is: `Scheduler`, the base of the engine's server. Requests wait in `pending` with a
future each; one background task (`aloop`) decodes until cancelled: before each step it drops
the prompts of clients that hung up (`_sweep`, which reads the transports of the open requests,
so their rows serve that same step), joins waiting sequences into free rows, runs one step on
the single decode thread, and resolves the futures of finished sequences. The decoder is only
touched on that thread, and only under `step_lock`, so weight swaps, aborts and joins all happen
between decode steps. While paused, idle, or held on an incomplete version (`incomplete`: part of
a distributed version arrived, not all of it) the loop still sweeps every IDLE_SWEEP_S. Nothing a
request does ends the loop: a failure fails the requests it concerns (logged).
What it is not: the HTTP routes (`server.py`) or the forward pass (`decoder.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from megatron_darl.engine.decoder import Decoder, Sequence
from megatron_darl.engine.http_io import ClientGone, EngineFailure, client_gone

log = logging.getLogger("darl-engine")

IDLE_SWEEP_S = 0.25  # while paused or idle, how often the loop looks for clients that hung up


class Scheduler:
    """The decode loop and its queues around one Decoder (state shared with the routes)."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.pending: deque[Sequence] = deque()
        self.futures: dict[str, asyncio.Future] = {}
        self.clients: dict[int, tuple[web.BaseRequest, set[str]]] = {}  # open /generate requests -> their rids
        self.paused = False
        self.closing = False
        self.broken: str | None = None  # the model produced non-finite logits; cleared by a good probe or load
        # part of a distributed version arrived, not all of it (weight_group.py): decoding is held,
        # as if paused, until a whole version is loaded (SGLang would serve the mix)
        self.incomplete: str | None = None
        self.steps = 0  # decode steps completed (health: progress while busy)
        self.aborted_disconnected = 0  # prompts dropped because their client hung up
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="darl-decode")
        self.step_lock: asyncio.Lock | None = None  # made in the serving loop (`start_loop`)
        self.wake: asyncio.Event | None = None
        self.progress: asyncio.Condition | None = None
        self.loop_task: asyncio.Task | None = None

    def start_loop(self) -> None:
        """Start the decode loop on the running event loop."""
        self.step_lock, self.wake, self.progress = asyncio.Lock(), asyncio.Event(), asyncio.Condition()
        self.loop_task = asyncio.create_task(self.aloop())

    async def aloop(self) -> None:
        """Decode until cancelled. Nothing a request does can end this loop: a failure fails
        the requests it concerns (logged) and the loop goes on."""
        while True:
            if self.paused or self.incomplete or not (self.decoder.rows or self.pending):
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), IDLE_SWEEP_S)
                except asyncio.TimeoutError:
                    if self.clients:  # paused with requests waiting: drop those whose client left
                        async with self.step_lock:
                            self._sweep()
                continue
            try:
                await self._astep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug outside decode itself: fail what is running, keep serving
                log.exception("decode loop: unexpected failure; failing the running requests")
                async with self.step_lock:
                    self._fail(self.decoder.remove(None), f"engine error: {exc!r}")
            await asyncio.sleep(0)  # let HTTP handlers (pause, new requests) in between steps

    async def _astep(self) -> None:
        async with self.step_lock:
            if self.paused or self.incomplete:
                return
            self._sweep()
            while self.pending and self.decoder.free_slots > 0:
                seq = self.pending.popleft()
                try:
                    self.decoder.add(seq)
                except Exception as exc:  # validated at the door, so this is a bug: this request only
                    log.exception("request %s could not join the batch", seq.rid)
                    self._fail([seq], f"request could not start: {exc!r}")
            if not self.decoder.rows:
                return
            try:
                finished = await asyncio.get_running_loop().run_in_executor(self.executor, self.decoder.step)
            except Exception as exc:
                seqs = self.decoder.remove(None)
                log.exception("decode step failed; failing its %d request(s)", len(seqs))
                self._fail(seqs, f"decode step failed: {exc!r}")
                return
            self.steps += 1
        for seq in finished:
            if seq.error is not None:
                log.error("request %s failed: %s", seq.rid, seq.error)
                self.broken = seq.error
                self._fail([seq], seq.error)
            else:
                self._resolve(seq)
        async with self.progress:
            self.progress.notify_all()

    def _resolve(self, seq: Sequence) -> None:
        fut = self.futures.pop(seq.rid, None)
        if fut is not None and not fut.done():
            fut.set_result(seq)

    def _fail(self, seqs: list[Sequence], message: str, kind: type[Exception] = EngineFailure) -> None:
        for seq in seqs:
            fut = self.futures.pop(seq.rid, None)
            if fut is not None and not fut.done():
                fut.set_exception(kind(message))

    def _take(self, rids: set[str] | None) -> list[Sequence]:
        """Take running and waiting requests out (all when rids is None). Call only under step_lock."""
        seqs = self.decoder.remove(rids)
        keep: deque[Sequence] = deque()
        for s in self.pending:
            (seqs if rids is None or s.rid in rids else keep).append(s)
        self.pending = keep
        return seqs

    def _abort(self, rids: set[str] | None, message: str) -> int:
        """End running and waiting requests (all when rids is None) with finish_reason abort.
        Call only under step_lock."""
        seqs = self._take(rids)
        for s in seqs:
            s.finish = {"type": "abort", "message": message}
            self._resolve(s)
        return len(seqs)

    def _sweep(self) -> None:
        """Drop the prompts of clients that hung up (their handlers get ClientGone, which logs
        one line each). Call only under step_lock: the freed rows serve the next step."""
        gone = [key for key, (request, _) in self.clients.items() if client_gone(request)]
        if not gone:
            return
        owner = {rid: key for key in gone for rid in self.clients[key][1]}
        mine: dict[int, list[Sequence]] = {key: [] for key in gone}
        for seq in self._take(set(owner)):
            mine[owner[seq.rid]].append(seq)
        for key in gone:
            del self.clients[key]
            seqs = mine[key]
            self.aborted_disconnected += len(seqs)
            done = sum(len(s.output_ids) for s in seqs)
            self._fail(seqs, f"{len(seqs)} prompt(s) dropped after {done} decoded token(s)", ClientGone)

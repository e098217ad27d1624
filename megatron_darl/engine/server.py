"""`darl-engine`: the embedded rollout engine, serving SGLang's HTTP protocol over `Decoder`.

What it is: an aiohttp server over one background decode loop (`scheduler.py`). Concurrent
/generate requests decode together (continuous batching: they join between steps and leave
when finished); /pause_generation stops the loop between steps (abort: in-flight requests
return their partial output with finish_reason abort; retract/in_place: they stay and continue
after /continue_generation); /update_weights_from_disk swaps weights between steps and bumps the
version, and running sequences continue under the new weights with their KV recomputed.
Answers have SGLang 0.5.23's shape, per-token versions in `meta_info.weight_versions` spans
(`requests.py` validates requests and writes answers; docs/sglang_protocol.md lists
the routes and fields). The same weight route serves the shared-memory variant: a learner on
the node publishes its HF folder under /dev/shm and passes that path.
What it is not: a tokenizer (input_ids only), a streaming server, or a receiver of
`/update_weights_from_tensor` (answers 400).

Robustness: every request field is validated (400 naming it); a failure while decoding fails
the requests it concerns (500, logged), never the loop; decoding and weight loading run off the
event loop, so /health and control routes answer while 256 sequences decode; weights with
NaN/Inf are refused (400, old weights kept) and /health_generate checks that the model still
produces finite log-probs; SIGTERM ends in-flight requests (503) and stops at once.
Hostile and careless clients (`http_io.py`: bodies, limits, status codes): a request is bounded
(prompts, tokens, body size, body time: 413/408), large bodies and answers are decoded and
written off the event loop, so /health answers within milliseconds whatever one request holds;
a client that hangs up is noticed by the decode loop before its next step (every 0.25 s while
paused), its prompts are dropped, counted in /get_server_info `aborted_disconnected`, and logged
in one line. No handler is ever cancelled half-way through a weight load or a pause (the server
does not rely on aiohttp's handler cancellation). `weight_version` only moves forward.
The distributed update (`/init_weights_update_group`, `/begin_weight_update`,
`/update_weights_from_distributed`, `/end_weight_update`, `/destroy_weights_update_group`: gloo
on CPU, SGLang 0.5.23's session rules; part of a version holds decoding) is `weight_group.py`;
the command line (`engine_command`, the flags and their defaults) is `server_args.py`.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import math
import sys
import time
import uuid
from pathlib import Path

import torch
from aiohttp import web

from megatron_darl.engine.decoder import Decoder, Sequence, WeightLoadError
from megatron_darl.engine.http_io import (
    BodyReader,
    ClientGone,
    EngineFailure,
    Limits,
    ShuttingDown,
    client_gone,
    encode_strict,
    error_middleware,
)
from megatron_darl.engine.requests import (
    BadRequest,
    parse_generate,
    parse_logprob_starts,
    parse_weight_version,
    prompt_logprob_entries,
    response_json,
)
from megatron_darl.engine.scheduler import Scheduler

# engine_command is re-exported: tests and benches import it from here
from megatron_darl.engine.server_args import build_parser, engine_command, limits_from  # noqa: F401
from megatron_darl.engine.weight_group import WeightGroupRoutes
from megatron_darl.types import PAUSE_MODES, SamplingParams

log = logging.getLogger("darl-engine")

HEALTH_TIMEOUT_S = 20.0  # as SGLang's HEALTH_CHECK_TIMEOUT: no decode progress for this long is unhealthy
LISTEN_BACKLOG = 2048  # hundreds of clients connect at once when a run starts (the default is 128)
ENCODE_INLINE_TOKENS = 4096  # answers with more output tokens, or more answers than ENCODE_INLINE_ANSWERS,
ENCODE_INLINE_ANSWERS = 16  # are written on the worker thread


def _field(body: dict, name: str, kinds: type | tuple[type, ...], default=None):
    value = body.get(name, default)
    if value is None:
        return default
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    # bool is an int subclass: reject `true` where a number is wanted
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise BadRequest(f"field '{name}' must be {kinds}, got {type(value).__name__} {value!r}")
    return value


class EngineServer(Scheduler):
    """The HTTP routes over the decode loop (`Scheduler`) of one Decoder."""

    def __init__(self, decoder: Decoder, model_path: str, api_key: str | None = None, limits: Limits | None = None):
        super().__init__(decoder)
        self.model_path = model_path
        self.api_key = api_key
        self.http = BodyReader(limits or Limits())
        self.client_disconnects = 0  # requests whose client hung up (while sending, waiting or decoding)

    def _on_gone(self, request: web.Request, exc: ClientGone) -> None:
        self.client_disconnects += 1
        log.info("%s %s: client %s hung up: %s", request.method, request.path, request.remote, exc)

    # ---- routes ------------------------------------------------------------------------
    async def agenerate(self, request: web.Request) -> web.Response:
        if self.closing:
            raise ShuttingDown("the engine is shutting down")
        spec, limits = self.decoder.spec, self.http.limits
        def parse(body: dict):
            items, batched = parse_generate(body, spec.vocab_size, limits.max_prompts, limits.max_tokens,
                                            spec.max_positions)
            return items, batched, parse_logprob_starts(body, [ids for _, ids, _ in items])

        items, batched, starts = await self.http.aread(request, parse)
        if client_gone(request):
            raise ClientGone(f"{len(items)} prompt(s) dropped before they were queued")
        started = time.monotonic()
        rids = {rid for rid, _, _ in items}
        dup = [rid for rid, _, _ in items if rid in self.futures]
        if dup or len(rids) != len(items):
            raise BadRequest(f"field 'rid': request id {(dup or [items[0][0]])[0]!r} is already in flight")
        futs = []
        for (rid, ids, sp), start in zip(items, starts):
            futs.append(asyncio.get_running_loop().create_future())
            self.futures[rid] = futs[-1]
            self.pending.append(Sequence(rid=rid, tokens=ids, prompt_len=len(ids), sampling=sp, logprob_start=start))
        self.clients[id(request)] = (request, rids)
        self.wake.set()
        try:
            seqs = await asyncio.gather(*futs)
        except asyncio.CancelledError:  # under a runner that cancels handlers of closed connections
            async with self.step_lock:
                dropped = self._abort(rids, "client disconnected")
            self.aborted_disconnected += dropped
            self._on_gone(request, ClientGone(f"{dropped} prompt(s) dropped (handler cancelled)"))
            raise
        except (EngineFailure, ShuttingDown):
            async with self.step_lock:  # the other prompts of a batched request end too
                self._abort(rids, "another prompt of the same request failed")
            raise
        finally:
            self.clients.pop(id(request), None)
        return await self._aanswer(seqs, batched, time.monotonic() - started)

    async def _aanswer(self, seqs: list[Sequence], batched: bool, latency: float) -> web.Response:
        """SGLang's answer for finished sequences, strict JSON, written off the loop when long."""
        version = self.decoder.version

        def write() -> bytes:
            out = [response_json(s.rid, s.output_ids, s.logprobs, s.versions, s.finish, s.prompt_len, latency, version,
                                 prompt_logprob_entries(s.tokens[: s.prompt_len], s.logprob_start, s.prompt_logprobs))
                   for s in seqs]
            return encode_strict(out if batched else out[0])

        try:
            heavy = len(seqs) > ENCODE_INLINE_ANSWERS or sum(len(s.output_ids) for s in seqs) > ENCODE_INLINE_TOKENS
            body = await self.http.arun(write, heavy)
        except ValueError as exc:  # NaN or Infinity: the decoder fails such rows, so this is a bug
            raise EngineFailure(f"the answer holds a value JSON cannot carry: {exc}") from None
        return web.Response(body=body, content_type="application/json")

    async def apause(self, request: web.Request) -> web.Response:
        body = await self.http.aread(request, allow_empty=True)
        # retract and in_place both keep requests and their KV here (nothing else competes
        # for the memory); the KV is recomputed only if the weights change before continue
        mode = _field(body, "mode", str, "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"field 'mode' must be one of {PAUSE_MODES}, got {mode!r}")
        self.paused = True
        async with self.step_lock:  # returns only once the step in progress has finished
            if mode == "abort":
                self._abort(None, "generation paused with mode abort")
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def acontinue(self, request: web.Request) -> web.Response:
        await self.http.aread(request, allow_empty=True)
        self.paused = False
        self.wake.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def aabort_request(self, request: web.Request) -> web.Response:
        body = await self.http.aread(request, allow_empty=True)
        rid = _field(body, "rid", str, None)
        abort_all = _field(body, "abort_all", bool, False)
        if not rid and not abort_all:
            raise BadRequest("field 'rid' is required unless 'abort_all' is true")
        async with self.step_lock:
            self._abort(None if abort_all else {rid}, "aborted by /abort_request")
        return web.Response(status=200)

    async def aupdate_from_disk(self, request: web.Request) -> web.Response:
        body = await self.http.aread(request)
        path = _field(body, "model_path", str)
        if not path:
            raise BadRequest("field 'model_path' is required: an HF folder (config.json + *.safetensors)")
        raw_version = body.get("weight_version")
        parse_weight_version(raw_version, self.decoder.version)  # refused before waiting for the step
        abort_all = _field(body, "abort_all_requests", bool, False)
        async with self.step_lock:
            version = parse_weight_version(raw_version, self.decoder.version)  # another update may have landed
            if abort_all:
                self._abort(None, "aborted for a weight update")
            try:  # off the event loop: health and control routes answer during a long load
                await asyncio.get_running_loop().run_in_executor(self.executor, self.decoder.load_weights, path)
            except (WeightLoadError, OSError) as exc:
                msg = f"weights at {path} not loaded, version stays {self.decoder.version}: {exc}"
                log.error("%s", msg)
                return web.json_response({"success": False, "message": msg, "num_paused_requests": 0}, status=400)
            self.decoder.version = version
            self.model_path = path
            self.broken = self.incomplete = None  # a whole version
            waiting = len(self.decoder.rows) + len(self.pending)
        log.info("loaded weights from %s as version %d", path, version)
        return web.json_response({
            "success": True,
            "message": f"Loaded weights from {path} as version {version}.",
            "num_paused_requests": waiting if self.paused else 0,
        })

    async def aunsupported(self, request: web.Request) -> web.Response:
        msg = (f"{request.path} is not supported on the embedded engine; publish an HF folder and "
               "use /update_weights_from_disk (a /dev/shm path for a learner on the same node)")
        return web.json_response({"success": False, "message": msg}, status=400)

    async def ahealth(self, request: web.Request) -> web.Response:
        """Liveness: the decode loop runs (it never ends by itself; this catches a bug)."""
        if self.loop_task is not None and self.loop_task.done():
            return web.json_response({"error": "decode loop stopped"}, status=503)
        if self.closing:
            return web.json_response({"error": "shutting down"}, status=503)
        return web.Response(status=200)

    async def ahealth_generate(self, request: web.Request) -> web.Response:
        """Readiness, as SGLang decides it: a paused engine answers 503 (SGLang's probe waits
        behind the pause and times out); a busy one is healthy when a decode step completes
        within HEALTH_TIMEOUT_S (its probe never waits behind a full batch) and the model
        gives finite logits; an idle one decodes one greedy token and checks its log-prob."""
        bad = await self.ahealth(request)
        if bad.status != 200:
            return bad
        if self.paused or self.incomplete:
            why = "generation is paused (/continue_generation resumes it)" if self.paused else self.incomplete
            return web.json_response({"error": why}, status=503)
        if self.decoder.rows or self.pending:
            start = self.steps
            async with self.progress:
                try:
                    await asyncio.wait_for(self.progress.wait_for(lambda: self.steps > start), HEALTH_TIMEOUT_S)
                except asyncio.TimeoutError:
                    return web.json_response({"error": f"no decode step in {HEALTH_TIMEOUT_S:.0f} s"}, status=503)
            if self.broken is None:
                return web.Response(status=200)
        return await self._aprobe()

    async def _aprobe(self) -> web.Response:
        rid = f"health-{uuid.uuid4().hex}"
        fut = asyncio.get_running_loop().create_future()
        self.futures[rid] = fut
        probe = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
        self.pending.append(Sequence(rid=rid, tokens=[0], prompt_len=1, sampling=probe))
        self.wake.set()
        try:
            seq = await asyncio.wait_for(asyncio.shield(fut), timeout=HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineFailure, ShuttingDown) as exc:
            async with self.step_lock:  # do not leave the probe behind in the batch
                self._abort({rid}, "health probe ended")
            return web.json_response({"error": f"health generation failed: {exc}"}, status=503)
        if not all(math.isfinite(lp) for lp in seq.logprobs):
            return web.json_response({"error": f"the model gives non-finite log-probs {seq.logprobs}"}, status=503)
        self.broken = None
        return web.Response(status=200)

    async def amodel_info(self, request: web.Request) -> web.Response:
        s = self.decoder.spec
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "weight_version": str(self.decoder.version),
            "architectures": [s.arch],
            "vocab_size": s.vocab_size,
            "max_positions": s.max_positions,
        })

    async def aserver_info(self, request: web.Request) -> web.Response:
        """Scheduler state (SGLang has /get_server_info): what is running and how far along,
        what was dropped for clients that hung up, and the bounds on one request."""
        limits = self.http.limits
        return web.json_response({
            "weight_version": str(self.decoder.version),
            "paused": self.paused,
            "weights_incomplete": self.incomplete,  # why decoding is held (part of a broadcast version), or null
            "max_batch": self.decoder.max_batch,
            "dtype": self.decoder.dtype_name,  # the --dtype setting, as SGLang's server_args `dtype`
            "num_waiting": len(self.pending),
            "running": [{"rid": s.rid, "generated": len(s.output_ids)} for s in self.decoder.rows],
            "tokens_generated": self.decoder.tokens_generated,
            "aborted_disconnected": self.aborted_disconnected,  # prompts dropped: their client hung up
            "client_disconnects": self.client_disconnects,  # requests whose client hung up
            "limits": {"max_prompts_per_request": limits.max_prompts, "max_request_tokens": limits.max_tokens,
                       "max_body_bytes": limits.max_body_bytes, "body_timeout_s": limits.body_timeout_s},
        })

    async def aflush_cache(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed (the embedded engine keeps no prefix cache).")

    # ---- app ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._authorize, error_middleware(self._on_gone)],
                              client_max_size=self.http.limits.max_body_bytes)
        r = app.router
        r.add_post("/generate", self.agenerate)
        r.add_post("/pause_generation", self.apause)
        r.add_post("/continue_generation", self.acontinue)
        r.add_post("/abort_request", self.aabort_request)
        r.add_post("/update_weights_from_disk", self.aupdate_from_disk)
        r.add_post("/update_weights_from_tensor", self.aunsupported)
        WeightGroupRoutes(self).add_routes(r)  # the distributed update (weight_group.py)
        for route, handler in (("/health", self.ahealth), ("/health_generate", self.ahealth_generate),
                               ("/model_info", self.amodel_info), ("/get_model_info", self.amodel_info),
                               ("/server_info", self.aserver_info), ("/get_server_info", self.aserver_info),
                               ("/flush_cache", self.aflush_cache)):
            r.add_get(route, handler)
        r.add_post("/flush_cache", self.aflush_cache)
        app.on_startup.append(self._astart)
        app.on_shutdown.append(self._ashutdown)
        app.on_cleanup.append(self._astop)
        return app

    @web.middleware
    async def _authorize(self, request: web.Request, handler):
        if self.api_key is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return web.json_response({"error": "missing or wrong API key (send 'Authorization: Bearer KEY')"},
                                         status=401)
        return await handler(request)

    async def _astart(self, app: web.Application) -> None:
        self.start_loop()

    async def _ashutdown(self, app: web.Application) -> None:
        """SIGTERM: answer every open request now (503), so that no handler holds the exit."""
        self.closing = True
        if self.loop_task is not None:
            self.loop_task.cancel()
        waiting = len(self.futures)
        for fut in self.futures.values():
            if not fut.done():
                fut.set_exception(ShuttingDown("the engine is shutting down"))
        self.futures.clear()
        log.info("shutting down; %d open request(s) answered 503", waiting)

    async def _astop(self, app: web.Application) -> None:
        if self.loop_task is not None:
            self.loop_task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.http.close()


def main(argv: list[str] | None = None) -> None:
    """`darl-engine --model HF_DIR --host 127.0.0.1 --port P [--api-key K] [--threads N] [--max-batch N]
    [--dtype float32|bfloat16|float16] [--max-prompts-per-request N] [--max-request-tokens N]
    [--max-body-mb M] [--body-timeout-s S]` (the flags: `server_args.py`)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        decoder = Decoder(args.model, device=device, max_batch=args.max_batch, seed=args.seed, dtype=args.dtype)
    except (WeightLoadError, OSError) as exc:
        sys.exit(f"darl-engine: cannot load --model {args.model}: {exc}")
    limits = limits_from(args)
    gc.freeze()  # the model and the imports stay: a full collection (GIL held) walks only what requests make
    server = EngineServer(decoder, str(Path(args.model)), api_key=args.api_key, limits=limits)
    print(f"darl-engine: {decoder.spec.arch} from {args.model} on {device} ({args.dtype}), serving http://{args.host}:{args.port}",
          flush=True)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None,
                backlog=LISTEN_BACKLOG, shutdown_timeout=5.0)


if __name__ == "__main__":
    main()

"""`darl-engine`: the embedded rollout engine, serving SGLang's HTTP protocol over `Decoder`.

What it is: an aiohttp server with one background decode loop. Concurrent /generate requests
decode together (continuous batching: they join between steps and leave when finished);
/pause_generation stops the loop between steps (abort: in-flight requests return their
partial output with finish_reason abort; retract/in_place: they stay and continue after
/continue_generation); /update_weights_from_disk swaps weights between steps and bumps the
version, and running sequences continue under the new weights with their KV recomputed.
Every output token reports the version that sampled it in `meta_info.output_token_versions`
(an addition to SGLang's fields; SGLang clients ignore it). Routes and fields: see
shared/SGLANG_PROTOCOL.md. The same weight route serves the shared-memory variant: a learner
on the node publishes its HF folder under /dev/shm and passes that path.
What it is not: a tokenizer (input_ids only), a streaming server, or an NCCL weight receiver
(those routes answer 400).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import sys
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from aiohttp import web

from megatron_darl.rollout.api import PAUSE_MODES, SamplingParams
from megatron_darl.rollout.decoder import Decoder, Sequence, WeightLoadError


class BadRequest(ValueError):
    """A malformed request body; the message names the field."""


def _field(body: dict, name: str, kinds: type | tuple[type, ...], default=None, where: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    # bool is an int subclass: reject `true` where a number is wanted
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise BadRequest(f"field '{where}{name}' must be {kinds}, got {type(value).__name__} {value!r}")
    return value


def parse_sampling(raw: object, where: str = "sampling_params.") -> SamplingParams:
    """SGLang `sampling_params` dict -> SamplingParams, validating each field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"field 'sampling_params' must be an object, got {type(raw).__name__}")
    unsupported = sorted(k for k in ("stop", "n", "min_p", "regex", "json_schema") if raw.get(k) not in (None, 1, 0.0, [], ""))
    if unsupported:
        raise BadRequest(f"field '{where}{unsupported[0]}' is not supported by the embedded engine")
    num = (int, float)
    sp = SamplingParams(
        temperature=float(_field(raw, "temperature", num, 1.0, where)),
        top_p=float(_field(raw, "top_p", num, 1.0, where)),
        top_k=_field(raw, "top_k", int, -1, where),
        max_new_tokens=_field(raw, "max_new_tokens", int, 128, where),
        stop_token_ids=list(_field(raw, "stop_token_ids", list, [], where)),
        ignore_eos=_field(raw, "ignore_eos", bool, False, where),
        seed=_field(raw, "seed", int, None, where),
    )
    if sp.temperature < 0:
        raise BadRequest(f"field '{where}temperature' must be >= 0, got {sp.temperature}")
    if not 0 < sp.top_p <= 1:
        raise BadRequest(f"field '{where}top_p' must be in (0, 1], got {sp.top_p}")
    if sp.max_new_tokens < 1:
        raise BadRequest(f"field '{where}max_new_tokens' must be >= 1, got {sp.max_new_tokens}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in sp.stop_token_ids):
        raise BadRequest(f"field '{where}stop_token_ids' must be a list of integers")
    return sp


def parse_generate(body: dict, vocab_size: int) -> tuple[list[tuple[str, list[int], SamplingParams]], bool]:
    """A /generate body -> ([(rid, input_ids, sampling)], batched?)."""
    if body.get("text") is not None:
        raise BadRequest("field 'text' is not supported: the embedded engine has no tokenizer; send 'input_ids'")
    if body.get("stream"):
        raise BadRequest("field 'stream' must be false: the embedded engine does not stream")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("field 'input_ids' is required: a non-empty list of token ids (or a list of such lists)")
    batched = isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    for i, p in enumerate(prompts):
        ok = isinstance(p, list) and p and all(type(t) is int and 0 <= t < vocab_size for t in p)  # no bools
        if not ok:
            where = f"input_ids[{i}]" if batched else "input_ids"
            raise BadRequest(f"field '{where}' must be a non-empty list of token ids in [0, {vocab_size})")
    raw_sp = body.get("sampling_params")
    if isinstance(raw_sp, list):
        if len(raw_sp) != len(prompts):
            raise BadRequest(f"field 'sampling_params' has {len(raw_sp)} entries for {len(prompts)} prompts")
        sps = [parse_sampling(s, f"sampling_params[{i}].") for i, s in enumerate(raw_sp)]
    else:
        sps = [parse_sampling(raw_sp)] * len(prompts)
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in prompts]
    elif batched and isinstance(rid, list) and len(rid) == len(prompts) and all(isinstance(r, str) for r in rid):
        rids = rid
    elif not batched and isinstance(rid, str):
        rids = [rid]
    else:
        raise BadRequest("field 'rid' must be a string (a list of strings, one per prompt, for batched input_ids)")
    return list(zip(rids, [list(p) for p in prompts], sps)), batched


def response_json(seq: Sequence, started: float, version: int) -> dict:
    """SGLang's /generate answer for one finished sequence (plus output_token_versions)."""
    out = seq.output_ids
    return {
        "text": "",
        "output_ids": out,
        "meta_info": {
            "id": seq.rid,
            "finish_reason": seq.finish,
            "prompt_tokens": seq.prompt_len,
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "weight_version": str(seq.versions[-1] if seq.versions else version),
            "e2e_latency": time.monotonic() - started,
            "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(seq.logprobs, out)],
            "output_token_versions": list(seq.versions),
        },
    }


class EngineServer:
    """The HTTP routes and the decode loop around one Decoder. The decoder is only touched on
    the single worker thread, and only under `step_lock`, so weight swaps, aborts and joins
    all happen between decode steps."""

    def __init__(self, decoder: Decoder, model_path: str, api_key: str | None = None):
        self.decoder = decoder
        self.model_path = model_path
        self.api_key = api_key
        self.pending: deque[Sequence] = deque()
        self.futures: dict[str, asyncio.Future] = {}
        self.paused = False
        self.failure: str | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="darl-decode")
        self.step_lock: asyncio.Lock | None = None
        self.wake: asyncio.Event | None = None
        self.loop_task: asyncio.Task | None = None

    # ---- decode loop -------------------------------------------------------------------
    async def aloop(self) -> None:
        run = asyncio.get_running_loop().run_in_executor
        while True:
            if self.paused or not (self.decoder.rows or self.pending):
                self.wake.clear()
                await self.wake.wait()
                continue
            async with self.step_lock:
                if self.paused:
                    continue
                while self.pending and self.decoder.free_slots > 0:
                    self.decoder.add(self.pending.popleft())
                try:
                    finished = await run(self.executor, self.decoder.step)
                except Exception as exc:  # a broken step must fail requests loudly, not hang them
                    self.failure = f"decode step failed: {exc!r}"
                    for fut in self.futures.values():
                        if not fut.done():
                            fut.set_exception(RuntimeError(self.failure))
                    raise
            for seq in finished:
                self._resolve(seq)
            await asyncio.sleep(0)  # let HTTP handlers (pause, new requests) in between steps

    def _resolve(self, seq: Sequence) -> None:
        fut = self.futures.pop(seq.rid, None)
        if fut is not None and not fut.done():
            fut.set_result(seq)

    def _abort(self, rid: str | None, message: str) -> int:
        """End running and waiting requests (all when rid is None) with finish_reason abort.
        Call only under step_lock."""
        seqs = self.decoder.remove(rid)
        seqs += [s for s in self.pending if rid is None or s.rid == rid]
        self.pending = deque(s for s in self.pending if not (rid is None or s.rid == rid))
        for s in seqs:
            s.finish = {"type": "abort", "message": message}
            self._resolve(s)
        return len(seqs)

    # ---- routes ------------------------------------------------------------------------
    async def agenerate(self, request: web.Request) -> web.Response:
        items, batched = parse_generate(await _ajson(request), self.decoder.spec.vocab_size)
        started = time.monotonic()
        dup = [rid for rid, _, _ in items if rid in self.futures]
        if dup or len({rid for rid, _, _ in items}) != len(items):
            raise BadRequest(f"field 'rid': request id {(dup or [items[0][0]])[0]!r} is already in flight")
        limit = self.decoder.spec.max_positions
        for rid, ids, _ in items:
            if len(ids) >= limit:
                raise BadRequest(f"field 'input_ids': {len(ids)} tokens; the model allows at most {limit - 1}")
        futs = []
        for rid, ids, sp in items:
            futs.append(asyncio.get_running_loop().create_future())
            self.futures[rid] = futs[-1]
            self.pending.append(Sequence(rid=rid, tokens=ids, prompt_len=len(ids), sampling=sp))
        self.wake.set()
        try:
            seqs = await asyncio.gather(*futs)
        except asyncio.CancelledError:  # client went away: free its rows
            async with self.step_lock:
                for rid, _, _ in items:
                    self._abort(rid, "client disconnected")
            raise
        out = [response_json(s, started, self.decoder.version) for s in seqs]
        return web.json_response(out if batched else out[0])

    async def apause(self, request: web.Request) -> web.Response:
        body = await _ajson(request, allow_empty=True)
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
        await _ajson(request, allow_empty=True)
        self.paused = False
        self.wake.set()
        return web.json_response({"message": "Generation continued.", "status": "ok"})

    async def aabort_request(self, request: web.Request) -> web.Response:
        body = await _ajson(request, allow_empty=True)
        rid = _field(body, "rid", str, None)
        abort_all = _field(body, "abort_all", bool, False)
        if rid is None and not abort_all:
            raise BadRequest("field 'rid' is required unless 'abort_all' is true")
        async with self.step_lock:
            self._abort(None if abort_all else rid, "aborted by /abort_request")
        return web.Response(status=200)

    async def aupdate_from_disk(self, request: web.Request) -> web.Response:
        body = await _ajson(request)
        path = _field(body, "model_path", str)
        if not path:
            raise BadRequest("field 'model_path' is required: an HF folder (config.json + *.safetensors)")
        raw_version = _field(body, "weight_version", (str, int), None)
        try:
            version = self.decoder.version + 1 if raw_version is None else int(raw_version)
        except ValueError:
            raise BadRequest(f"field 'weight_version' must be an integer, got {raw_version!r}") from None
        abort_all = _field(body, "abort_all_requests", bool, False)
        async with self.step_lock:
            if abort_all:
                self._abort(None, "aborted for a weight update")
            try:
                await asyncio.get_running_loop().run_in_executor(self.executor, self.decoder.load_weights, path)
            except (WeightLoadError, OSError) as exc:
                msg = f"weights at {path} not loaded, version stays {self.decoder.version}: {exc}"
                return web.json_response({"success": False, "message": msg, "error": msg}, status=400)
            self.decoder.version = version
            self.model_path = path
            waiting = len(self.decoder.rows) + len(self.pending)
        return web.json_response({
            "success": True,
            "message": f"Loaded weights from {path} as version {version}.",
            "num_paused_requests": waiting if self.paused else 0,
        })

    async def aunsupported(self, request: web.Request) -> web.Response:
        msg = (f"{request.path} is not supported on the embedded engine; publish an HF folder and "
               "use /update_weights_from_disk (a /dev/shm path for a learner on the same node)")
        return web.json_response({"success": False, "message": msg, "error": msg}, status=400)

    async def ahealth(self, request: web.Request) -> web.Response:
        if self.failure or (self.loop_task is not None and self.loop_task.done()):
            return web.json_response({"error": self.failure or "decode loop stopped"}, status=503)
        return web.Response(status=200)

    async def ahealth_generate(self, request: web.Request) -> web.Response:
        """Generate one token, as SGLang does; a paused engine counts as healthy (its loop is
        alive, it is waiting for /continue_generation)."""
        bad = await self.ahealth(request)
        if bad.status != 200 or self.paused:
            return bad
        rid = f"health-{uuid.uuid4().hex}"
        fut = asyncio.get_running_loop().create_future()
        self.futures[rid] = fut
        self.pending.append(Sequence(rid=rid, tokens=[0], prompt_len=1, sampling=SamplingParams(temperature=0.0, max_new_tokens=1)))
        self.wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout=30.0)
        except (asyncio.TimeoutError, RuntimeError) as exc:
            async with self.step_lock:  # do not leave the probe behind in the batch
                self._abort(rid, "health probe timed out")
            return web.json_response({"error": f"health generation failed: {exc!r}"}, status=503)
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
        """Scheduler state (SGLang has /get_server_info): what is running and how far along."""
        return web.json_response({
            "weight_version": str(self.decoder.version),
            "paused": self.paused,
            "max_batch": self.decoder.max_batch,
            "num_waiting": len(self.pending),
            "running": [{"rid": s.rid, "generated": len(s.output_ids)} for s in self.decoder.rows],
            "tokens_generated": self.decoder.tokens_generated,
        })

    async def aflush_cache(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed (the embedded engine keeps no prefix cache).")

    # ---- app ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024**2)
        r = app.router
        r.add_post("/generate", self.agenerate)
        r.add_post("/pause_generation", self.apause)
        r.add_post("/continue_generation", self.acontinue)
        r.add_post("/abort_request", self.aabort_request)
        r.add_post("/update_weights_from_disk", self.aupdate_from_disk)
        for route in ("/init_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_tensor"):
            r.add_post(route, self.aunsupported)
        for route, handler in (("/health", self.ahealth), ("/health_generate", self.ahealth_generate),
                               ("/model_info", self.amodel_info), ("/get_model_info", self.amodel_info),
                               ("/server_info", self.aserver_info), ("/get_server_info", self.aserver_info),
                               ("/flush_cache", self.aflush_cache)):
            r.add_get(route, handler)
        r.add_post("/flush_cache", self.aflush_cache)
        app.on_startup.append(self._astart)
        app.on_cleanup.append(self._astop)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if self.api_key is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return web.json_response({"error": "missing or wrong API key (send 'Authorization: Bearer KEY')"}, status=401)
        try:
            return await handler(request)
        except BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)

    async def _astart(self, app: web.Application) -> None:
        self.step_lock, self.wake = asyncio.Lock(), asyncio.Event()
        self.loop_task = asyncio.create_task(self.aloop())

    async def _astop(self, app: web.Application) -> None:
        if self.loop_task is not None:
            self.loop_task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)


async def _ajson(request: web.Request, allow_empty: bool = False) -> dict:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def engine_command(model_dir: str, port: int, host: str = "127.0.0.1", api_key: str | None = None,
                   threads: int = 1, max_batch: int = 64, python: str = sys.executable) -> list[str]:
    """The argv that starts one engine (what `darl-engine` runs), for launchers and restarts."""
    cmd = [python, "-m", "megatron_darl.rollout.engine_server", "--model", str(model_dir), "--host", host,
           "--port", str(port), "--threads", str(threads), "--max-batch", str(max_batch)]
    return cmd + (["--api-key", api_key] if api_key else [])


def main(argv: list[str] | None = None) -> None:
    """`darl-engine --model HF_DIR --host 127.0.0.1 --port P [--api-key K] [--threads N] [--max-batch N]`."""
    ap = argparse.ArgumentParser(prog="darl-engine", description="Embedded rollout engine speaking SGLang's HTTP protocol.")
    ap.add_argument("--model", required=True, help="HF model folder (config.json + *.safetensors)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--api-key", default=os.environ.get("DARL_ENGINE_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on every request (default: $DARL_ENGINE_API_KEY)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 beats 2 on a shared small box)")
    ap.add_argument("--max-batch", type=int, default=64, help="sequences decoded together at most")
    ap.add_argument("--device", default="auto", help="cpu | cuda | auto (cuda when available)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampler for requests without a seed")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        decoder = Decoder(args.model, device=device, max_batch=args.max_batch, seed=args.seed)
    except (WeightLoadError, OSError) as exc:
        sys.exit(f"darl-engine: cannot load --model {args.model}: {exc}")
    server = EngineServer(decoder, str(Path(args.model)), api_key=args.api_key)
    print(f"darl-engine: {decoder.spec.arch} from {args.model} on {device}, serving http://{args.host}:{args.port}", flush=True)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()

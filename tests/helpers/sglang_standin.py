"""A stand-in for an SGLang 0.5.23 server on 127.0.0.1, for end-to-end tests without a GPU.

What it is: an aiohttp server whose request validation and replies are the pinned release's
own: /generate bodies go through the release's contract gate (`api_types.GenerateRequest`) and
its strict `SamplingParams(**...)`, `normalize`, `verify` (a failure is a 400 with its text);
control bodies must fit `io_struct.py`'s classes; answers carry `weight_versions` spans made by
the release's `record_weight_version_events` / `compute_weight_version_spans` /
`add_weight_versions_to_meta_info`, abort shapes as its tokenizer manager writes them (queued:
no tokens, no prompt_tokens; mid-decode: partial output), "default" as the version before any
update, and its pause semantics (new requests wait while paused; `/health_generate` is 503
while paused; a weight load while paused is immediate); the distributed update joins a gloo
group as the release's model runner does and receives one broadcast per tensor; the release's
weight-update session (`Release.session_rules`, read from its scheduler's source: which routes a
session must be open or closed for, and the refusal, 400 with its message); and, as the release,
each bucket loaded as it arrives, so a version stopped half-way leaves a mix that generation
would use: tokens decoded on it are counted (`mixed_tokens` of each /generate in the log,
`mixed` on /continue_generation and /end_weight_update, `mixed_steps` in /server_info) for the
tests to find. A weight update's `flush_cache` is refused, failing the update with the release's
message after the weights changed, while a request holds KV (`Release.flush_rules`: paused with
`in_place`, the running requests do; `retract` and `abort` leave none). Generation reuses the
project's `Decoder`. Every call is appended to `--calls` (JSON lines) for the test to inspect.
Run: `python sglang_standin.py --model DIR --port P --release-root ROOT --calls FILE`.
What it is not: SGLang (no scheduler, radix cache or tokenizer), or a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web

from megatron_darl.engine.decoder import Decoder, Sequence, WeightLoadError, load_hf_tensors
from megatron_darl.engine.requests import parse_logprob_starts, prompt_logprob_entries
from megatron_darl.types import SamplingParams
from tests.helpers.sglang_release import Release

CONTROL = {"/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput",
           "/abort_request": "AbortReq", "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
           "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
           "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
           "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
           "/begin_weight_update": "BeginWeightUpdateReqInput", "/end_weight_update": "EndWeightUpdateReqInput"}


class Req:
    """What the release's weight-version functions read of a scheduler request."""

    def __init__(self, seq: Sequence, started: float):
        self.seq, self.started = seq, started
        self.weight_version_events: list = []
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.running = False
        self.mixed_tokens = 0  # tokens decoded while the model held part of a version

    @property
    def output_ids(self) -> list[int]:
        return self.seq.output_ids


class StandIn:
    def __init__(self, release: Release, model: str, calls: str):
        self.rel, self.calls = release, open(calls, "a", encoding="utf-8")
        self.decoder = Decoder(model, max_batch=512)
        self.tensors = load_hf_tensors(model, self.decoder.spec)  # what the model holds, bucket by bucket
        self.session = False  # the release's weight-update session (/begin_weight_update)
        self.session_rules = release.session_rules  # read from the release's scheduler source
        self.mixed = False  # a bucket of a version is loaded, not its last one: the model serves a mix
        self.mixed_steps = 0
        self.model_path, self.version = model, "default"  # SGLang's weight_version before any update
        self.reqs: dict[str, Req] = {}
        self.paused = False
        self.pause_mode: str | None = None
        self.flush_rules = release.flush_rules  # read from the release's scheduler source
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()
        self.pool = ThreadPoolExecutor(1)
        self.groups: dict = {}  # group name -> process group (/init_weights_update_group)

    def log(self, route: str, status: int, body, **extra) -> None:
        self.calls.write(json.dumps({"route": route, "status": status, "body": body, **extra}) + "\n")
        self.calls.flush()

    # ---- replies as the release writes them ------------------------------------------------
    def reply(self, req: Req, finish: dict, queued_abort: bool = False) -> dict:
        wv, n = self.rel.weight_versions, len(req.output_ids)
        meta = {"id": req.seq.rid, "finish_reason": finish, "weight_version": self.version,
                "e2e_latency": time.monotonic() - req.started}
        if not queued_abort:
            meta.update(prompt_tokens=req.seq.prompt_len, num_retractions=0, reasoning_tokens=0, cached_tokens=0)
        spans = wv.compute_weight_version_spans(req.weight_version_events, current_version=self.version,
                                                num_output_tokens=n)
        wv.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=n)
        prompt = req.seq.tokens[: req.seq.prompt_len]
        meta.update(input_token_logprobs=prompt_logprob_entries(prompt, req.seq.logprob_start, req.seq.prompt_logprobs),
                    output_token_logprobs=[[lp, t, None] for lp, t in zip(req.seq.logprobs, req.output_ids)],
                    output_token_logprobs_length=n, completion_tokens=n)
        out = {"text": "", "output_ids": list(req.output_ids), "meta_info": meta}
        self.rel.api.GenerateResponse.from_json_value(out)
        return out

    def flush_refusal(self, body: dict) -> str | None:
        """The release's answer to an update's `flush_cache`: refused while a request holds KV
        (running, unless the pause retracted it; waiting, unless paused)."""
        rules = self.flush_rules
        if not body.get("flush_cache", True):
            return None
        retracted = self.paused and self.pause_mode not in rules.keep_running and rules.others_retract
        running = [r for r in self.reqs.values() if r.running and not retracted]
        waiting = [] if self.paused and rules.ignores_waiting_when_paused else \
            [r for r in self.reqs.values() if not r.running or retracted]
        return rules.refusal if running or waiting else None

    def finish(self, req: Req, finish: dict, queued_abort: bool = False) -> None:
        self.reqs.pop(req.seq.rid, None)
        if not req.future.done():
            req.future.set_result(self.reply(req, finish, queued_abort))

    # ---- decode loop ----------------------------------------------------------------------
    async def aloop(self) -> None:
        while True:
            await self.resumed.wait()
            if not self.reqs:
                self.wake.clear()
                await self.wake.wait()
                continue
            async with self.lock:
                if self.paused:
                    continue
                for req in list(self.reqs.values()):
                    if not req.running and self.decoder.free_slots > 0:
                        self.decoder.add(req.seq)
                        req.running = True
                done = await asyncio.get_running_loop().run_in_executor(self.pool, self.decoder.step)
                if self.mixed:
                    self.mixed_steps += 1
                    for req in self.reqs.values():
                        req.mixed_tokens += req.running
            for seq in done:
                if seq.rid in self.reqs:
                    self.finish(self.reqs[seq.rid], seq.finish)
            await asyncio.sleep(0)

    def abort_all(self, message: str) -> None:
        self.decoder.remove(None)
        for req in list(self.reqs.values()):
            finish = {"type": "abort", "message": message, "status_code": None, "err_type": None}
            self.finish(req, finish if req.running else {"type": "abort", "message": "Abort in waiting queue"},
                        queued_abort=not req.running)

    # ---- routes ---------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            self.rel.api.GenerateRequest.from_json_value(body)  # the release's contract gate
            sp = self.rel.SamplingParams(**(body.get("sampling_params") or {}))
            sp.normalize(None)
            sp.verify(self.decoder.spec.vocab_size)
            # prompt log-probs from logprob_start_len (the probe); past the prompt: the release's 400
            start = parse_logprob_starts(body, [body["input_ids"]])[0]
        except (ValueError, TypeError) as exc:
            self.log("/generate", 400, body, error=str(exc))
            return web.json_response({"error": str(exc)}, status=400)
        await self.resumed.wait()  # SGLang parks new requests while paused
        ours = SamplingParams(temperature=0.0 if sp.top_k == 1 else sp.temperature, top_p=sp.top_p,
                              top_k=-1 if sp.top_k >= 1 << 30 else sp.top_k, max_new_tokens=sp.max_new_tokens,
                              stop_token_ids=sorted(sp.stop_token_ids or []), ignore_eos=sp.ignore_eos,
                              seed=sp.sampling_seed)
        ids = body["input_ids"]
        rid = body.get("rid") or uuid.uuid4().hex  # the release fills a missing rid the same way
        seq = Sequence(rid=rid, tokens=list(ids), prompt_len=len(ids), sampling=ours, logprob_start=start)
        req = Req(seq, time.monotonic())
        self.reqs[rid] = req
        self.wake.set()
        out = await req.future
        self.log("/generate", 200, None, finish=out["meta_info"]["finish_reason"]["type"],
                 versions=out["meta_info"]["weight_versions"], n=len(out["output_ids"]), mixed_tokens=req.mixed_tokens,
                 input_ids=ids, output_ids=out["output_ids"], stop_token_ids=ours.stop_token_ids)
        return web.json_response(out)

    async def control(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw.strip() else {}
        try:
            self.rel.check_io_body(CONTROL[request.path], body)
        except AssertionError as exc:
            self.log(request.path, 400, body, error=str(exc))
            return web.json_response({"error": str(exc)}, status=400)
        name, rules = request.path.strip("/"), self.session_rules
        refusal = rules.refused_without.get(name) if not self.session else rules.refused_while_open.get(name)
        if refusal is not None:  # the scheduler answers before doing anything; the route says 400
            self.log(request.path, 400, body, error=refusal)
            return web.json_response({"success": False, "message": refusal}, status=400)
        return await getattr(self, name)(body)

    async def begin_weight_update(self, body: dict) -> web.Response:
        self.session = True
        self.log("/begin_weight_update", 200, body)
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, body: dict) -> web.Response:
        self.session = False
        self.log("/end_weight_update", 200, body, mixed=self.mixed)
        return web.json_response({"success": True, "message": "Success"})

    async def pause_generation(self, body: dict) -> web.Response:
        self.paused, self.pause_mode = True, body.get("mode", "abort")
        self.resumed.clear()
        async with self.lock:
            if body.get("mode", "abort") == "abort":
                self.abort_all("Aborted")
            else:  # retract / in_place: kept, continued after /continue_generation
                pass
        self.log("/pause_generation", 200, body)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, body: dict) -> web.Response:
        self.paused, self.pause_mode = False, None
        self.resumed.set()
        self.wake.set()
        self.log("/continue_generation", 200, body, mixed=self.mixed)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, body: dict) -> web.Response:
        async with self.lock:
            if body.get("abort_all"):
                self.abort_all("Aborted")
        self.log("/abort_request", 200, body)
        return web.Response(status=200)

    async def update_weights_from_disk(self, body: dict) -> web.Response:
        async with self.lock:  # paused: at once (SGLang); running: between steps
            try:
                tensors = await asyncio.get_running_loop().run_in_executor(
                    self.pool, load_hf_tensors, body["model_path"], self.decoder.spec)
                self.decoder.use_tensors(tensors)
                self.tensors, self.mixed = tensors, False
            except (WeightLoadError, OSError) as exc:
                self.log("/update_weights_from_disk", 400, body, error=str(exc))
                return web.json_response({"success": False, "message": str(exc), "num_paused_requests": 0}, status=400)
            if body.get("weight_version") is not None and body["weight_version"] != self.version:
                self.rel.weight_versions.record_weight_version_events(list(self.reqs.values()),
                                                                      old_version=self.version)
                self.version = body["weight_version"]
            self.model_path = body["model_path"]
            refusal = self.flush_refusal(body)
        if refusal is not None:  # the weights changed, the call fails (the release's update_weights_from_disk)
            self.log("/update_weights_from_disk", 400, body, error=refusal)
            return web.json_response({"success": False, "message": refusal, "num_paused_requests": 0}, status=400)
        self.log("/update_weights_from_disk", 200, body)
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": len(self.reqs) if self.paused else 0})

    # ---- the distributed update: the release's model runner, on gloo (one TP rank) -------------
    async def init_weights_update_group(self, body: dict) -> web.Response:
        from megatron_darl.channel.process_group import init_custom_group

        name = body.get("group_name", "weight_update_group")

        def join():  # as the release: rank = rank_offset + tp_rank, its custom group, never the default
            return init_custom_group(body["master_address"], body["master_port"], body["world_size"], name,
                                     body["rank_offset"], body.get("backend", "nccl"), 60.0)

        return await self._weights_op("/init_weights_update_group", body, join,
                                      "Succeeded to initialize custom process group.",
                                      lambda g: self.groups.__setitem__(name, g))

    async def update_weights_from_distributed(self, body: dict) -> web.Response:
        import torch
        import torch.distributed as dist

        from megatron_darl.engine.weight_group import check_received

        group = self.groups.get(body.get("group_name", "weight_update_group"))

        def receive():  # one broadcast per tensor from rank 0, in the order of names, all of them first
            assert group is not None, "Please call `init_weights_update_group` first."
            received = {}
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                dist.broadcast(t, src=0, group=group)
                received[name] = t
            # then loaded at once, as the release's runner does: until the last bucket, a mix
            tensors = check_received({**self.tensors, **received}, self.decoder.spec)
            self.decoder.use_tensors(tensors)
            self.tensors, self.mixed = tensors, body.get("weight_version") is None

        def loaded(_):
            if body.get("weight_version") is not None and body["weight_version"] != self.version:
                self.rel.weight_versions.record_weight_version_events(list(self.reqs.values()),
                                                                      old_version=self.version)
                self.version = body["weight_version"]

        return await self._weights_op("/update_weights_from_distributed", body, receive,
                                      "Succeeded to update parameter online.", loaded)

    async def destroy_weights_update_group(self, body: dict) -> web.Response:
        import torch.distributed as dist

        group = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            self.log("/destroy_weights_update_group", 400, body)
            return web.json_response({"success": False, "message": "The group to be destroyed does not exist."},
                                     status=400)
        dist.destroy_process_group(group)
        self.log("/destroy_weights_update_group", 200, body)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def _weights_op(self, route: str, body: dict, work, ok: str, then) -> web.Response:
        async with self.lock:
            try:
                result = await asyncio.get_running_loop().run_in_executor(self.pool, work)
            except Exception as exc:  # the release answers 400 {"success": false, "message"}
                self.log(route, 400, body, error=str(exc))
                return web.json_response({"success": False, "message": str(exc)}, status=400)
            then(result)
            refusal = self.flush_refusal(body) if route == "/update_weights_from_distributed" else None
        brief = {k: v for k, v in body.items() if k not in ("names", "dtypes", "shapes")}
        if refusal is not None:  # loaded, then the flush refused: the release fails the call
            self.log(route, 400, brief, error=refusal)
            return web.json_response({"success": False, "message": refusal}, status=400)
        self.log(route, 200, brief)
        return web.json_response({"success": True, "message": ok})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1, "weight_version": self.version, "version": self.rel.version,
                                  "mixed": self.mixed, "mixed_steps": self.mixed_steps})

    async def health_generate(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.paused else 200)  # SGLang's probe times out behind a pause

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tokenizer_path": None, "is_generation": True,
                                  "weight_version": self.version, "architectures": [self.decoder.spec.arch]})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("POST", "/generate", self.generate)
        app.router.add_route("PUT", "/generate", self.generate)
        for route in CONTROL:
            app.router.add_post(route, self.control)
        app.router.add_get("/health_generate", self.health_generate)
        app.router.add_get("/health", self.health_generate)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/server_info", self.server_info)

        async def start(_app):
            self.task = asyncio.create_task(self.aloop())

        app.on_startup.append(start)
        return app


def served_calls(path: Path) -> list[dict]:
    """A stand-in's call log (whole lines only: it may be writing the last one)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--release-root", required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--calls", required=True)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)

    async def serve():
        standin = StandIn(Release(args.version, args.release_root), args.model, args.calls)
        runner = web.AppRunner(standin.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port, backlog=2048).start()
        print(f"sglang stand-in ({args.version}) on 127.0.0.1:{args.port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()

"""darl-engine's side of SGLang's distributed weight update: its routes, as 0.5.23 has them.

What it is: `WeightGroupRoutes`, added to the engine's app. `/init_weights_update_group`
(master_address, master_port, rank_offset, world_size, group_name, backend) joins a process
group as rank `rank_offset` (the engine is one TP rank; the learner is rank 0 and hosts the
rendezvous), built as SGLang's `init_custom_process_group` builds it, never the default group
(the engine has none); gloo on CPU, nccl when the engine runs on a GPU.
What it is not: the folder route (`/update_weights_from_disk`, server.py) or the sender.

The weight-update session, as the release's scheduler holds it: `/begin_weight_update`
(selector) opens it and is refused while one is open, `/end_weight_update` closes it and is
refused when none is, `/update_weights_from_distributed` is refused outside one, before
receiving anything; each refusal is the release's message, 400 (`channel/weight_session.py`
holds the messages; the conformance tests compare them with the wheel). Begin, end and a
receive run one at a time, as in SGLang's scheduler; the session never times out (as there).
`/update_weights_from_distributed` (names, dtypes, shapes, group_name, flush_cache,
abort_all_requests, weight_version, load_format) receives one broadcast per tensor from rank 0,
in the order of `names`, as SGLang does without a load_format; the tensors of a version may come
in several calls (buckets): they are kept until a call carries `weight_version`, then checked
(every tensor of the model, the expected shapes, finite) and swapped in between decode steps,
the version set from `weight_version` (an int64 never below the current version, else 400 and
the old weights stay). `/destroy_weights_update_group` leaves a group.
A version that stops half-way is never served: from its first bucket until a whole version is
loaded (by the last bucket or by /update_weights_from_disk) the engine keeps its old weights and
holds decoding (`Scheduler.incomplete`, /get_server_info `weights_incomplete`; /health_generate
answers 503). Failures answer 400 with {"success": false, "message"}, as SGLang's routes do.
Every receive fails after the group's timeout (RECEIVE_TIMEOUT_S).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from aiohttp import web

from megatron_darl.channel import weight_session as rq
from megatron_darl.engine.decoder import IGNORED_SUFFIXES, WeightLoadError
from megatron_darl.engine.requests import BadRequest, parse_weight_version

log = logging.getLogger(__name__)
RECEIVE_TIMEOUT_S = 300.0  # a join or a broadcast the learner never completes fails after this


def _fail(message: str) -> web.Response:
    log.error("%s", message)
    return web.json_response({"success": False, "message": message}, status=400)


def _list_of(body: dict, name: str, check) -> list:
    value = body.get(name)
    if not isinstance(value, list) or not all(check(v) for v in value):
        raise BadRequest(f"field '{name}' must be a list ({name} of each tensor, in broadcast order)")
    return value


def check_received(tensors: dict[str, torch.Tensor], spec) -> dict[str, torch.Tensor]:
    """The model's tensors (fp32) out of a received version; WeightLoadError naming the first
    unexpected, missing, misshapen or non-finite one."""
    expected = spec.expected_shapes()
    out = {}
    for name, t in tensors.items():
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and spec.tie_word_embeddings):
            continue
        if name not in expected:
            raise WeightLoadError(f"unexpected tensor {name!r} for {spec.arch} ({spec.num_layers} layers)")
        if tuple(t.shape) != expected[name]:
            raise WeightLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, "
                                  f"the running model expects {expected[name]}")
        t = t.to(torch.float32)
        if not bool(torch.isfinite(t).all()):
            raise WeightLoadError(f"tensor {name!r} has {int((~torch.isfinite(t)).sum())} non-finite value(s)")
        out[name] = t
    missing = sorted(set(expected) - set(out))
    if missing:
        raise WeightLoadError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    return out


class WeightGroupRoutes:
    def __init__(self, server):
        self.server = server  # engine_server.EngineServer
        self.groups: dict[str, object] = {}
        self.received: dict[str, torch.Tensor] = {}  # this version's tensors so far
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="darl-weight-recv")
        self.session_open = False  # SGLang's weight-update session (/begin_weight_update)
        self.session_lock = asyncio.Lock()  # begin, end and a receive one at a time, as SGLang's scheduler

    def add_routes(self, router) -> None:
        router.add_post("/init_weights_update_group", self.ainit)
        router.add_post("/begin_weight_update", self.abegin)
        router.add_post("/update_weights_from_distributed", self.aupdate)
        router.add_post("/end_weight_update", self.aend)
        router.add_post("/destroy_weights_update_group", self.adestroy)

    async def _abody(self, request: web.Request) -> dict:
        return await self.server.http.aread(request)

    async def ainit(self, request: web.Request) -> web.Response:
        from megatron_darl.channel.process_group import init_custom_group

        body = await self._abody(request)
        address, port = body.get("master_address"), body.get("master_port")
        offset, world = body.get("rank_offset"), body.get("world_size")
        if not isinstance(address, str) or not all(type(v) is int for v in (port, offset, world)):
            raise BadRequest("needs master_address (str), master_port, rank_offset, world_size (int)")
        name, backend = body.get("group_name", "weight_update_group"), body.get("backend", "nccl")
        if not name:
            raise BadRequest("group_name cannot be empty")
        if backend == "nccl" and self.server.decoder.device.type != "cuda":
            return _fail("backend nccl needs the engine on a GPU; this engine runs on CPU: use backend gloo")
        if name in self.groups:
            return _fail(f"group {name!r} exists already; destroy it first")
        loop = asyncio.get_running_loop()
        try:  # blocks until every rank joined: off the event loop
            self.groups[name] = await loop.run_in_executor(
                self.pool, lambda: init_custom_group(address, port, world, name, offset, backend, RECEIVE_TIMEOUT_S))
        except Exception as exc:
            return _fail(f"Failed to initialize custom process group: {exc}.")
        log.info("joined weight group %s as rank %d of %d (%s, %s:%d)", name, offset, world, backend, address, port)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def abegin(self, request: web.Request) -> web.Response:
        body = await self._abody(request)
        if body.get("selector", "all") not in rq.SESSION_SELECTORS:
            raise BadRequest(f"field 'selector' must be one of {rq.SESSION_SELECTORS}, got {body['selector']!r}")
        async with self.session_lock:
            if self.session_open:
                return _fail(rq.SESSION_ALREADY_OPEN)
            self.session_open = True
            self.received = {}  # a version a dead learner left half-sent never mixes into this one
        return web.json_response({"success": True, "message": "Success"})

    async def aend(self, request: web.Request) -> web.Response:
        await self.server.http.aread(request, allow_empty=True)
        async with self.session_lock:
            if not self.session_open:
                return _fail(rq.NO_SESSION_OPEN)
            self.session_open = False
            if self.received:  # the version's last bucket never came: generation stays held
                log.warning("weight-update session ended with %d tensors of an unfinished version; "
                            "generation is held until a whole version is loaded", len(self.received))
                self.received = {}
        return web.json_response({"success": True, "message": "Success"})

    async def aupdate(self, request: web.Request) -> web.Response:
        body = await self._abody(request)
        names = _list_of(body, "names", lambda v: isinstance(v, str))
        dtypes = _list_of(body, "dtypes",
                          lambda v: isinstance(v, str) and isinstance(getattr(torch, v, None), torch.dtype))
        shapes = _list_of(body, "shapes", lambda v: isinstance(v, list) and all(type(d) is int and d >= 0 for d in v))
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
        if body.get("load_format") is not None:
            return _fail(f"load_format {body['load_format']!r}: this engine receives one broadcast per tensor only")
        async with self.session_lock:
            if not self.session_open:  # SGLang 0.5.23 refuses before receiving anything
                return _fail(rq.session_required(request.path))
            return await self._areceive(body, names, dtypes, shapes)

    async def _areceive(self, body: dict, names: list, dtypes: list, shapes: list) -> web.Response:
        group = self.groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            return _fail(f"Group {body.get('group_name')!r} not in {sorted(self.groups)}. "
                         "Please call `init_weights_update_group` first.")
        version = body.get("weight_version")

        def receive() -> list[tuple[str, torch.Tensor]]:
            out = []
            for name, dtype, shape in zip(names, dtypes, shapes):
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.server.decoder.device)
                dist.broadcast(t, group=group, group_src=0)
                out.append((name, t))
            return out

        try:
            self.received.update(await asyncio.get_running_loop().run_in_executor(self.pool, receive))
        except Exception as exc:
            self.received.clear()
            return _fail(f"Failed to receive weights over {body.get('group_name')!r}: {exc}")
        if version is None:
            # SGLang has loaded this bucket now, and serves a mix of versions until the last one:
            # this engine holds generation instead, until a whole version is in
            self.server.incomplete = (f"{len(self.received)} tensors of a version received, not its last bucket; "
                                      "load a whole version (/update_weights_from_disk or a whole broadcast)")
            return web.json_response({"success": True, "message": f"Received {len(names)} tensors."})
        return await self._aswap(version, bool(body.get("abort_all_requests", False)))

    async def _aswap(self, raw_version: object, abort_all: bool) -> web.Response:
        srv, received = self.server, self.received
        self.received = {}
        try:
            tensors = check_received(received, srv.decoder.spec)
        except WeightLoadError as exc:
            return _fail(f"weights not loaded, version stays {srv.decoder.version}: {exc}")
        async with srv.step_lock:  # between decode steps
            try:  # an int64 that never goes back, as /update_weights_from_disk
                version = parse_weight_version(raw_version, srv.decoder.version)
            except BadRequest as exc:
                return _fail(f"weights not loaded, version stays {srv.decoder.version}: {exc}")
            if abort_all:
                srv._abort(None, "aborted for a weight update")
            srv.decoder.use_tensors(tensors)
            srv.decoder.version = version
            srv.model_path = f"(broadcast version {version})"
            srv.broken = srv.incomplete = None
        log.info("loaded %d broadcast tensors as version %d", len(tensors), version)
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def adestroy(self, request: web.Request) -> web.Response:
        body = await self._abody(request)
        name = body.get("group_name", "weight_update_group")
        group = self.groups.pop(name, None)
        if group is None:
            return _fail("The group to be destroyed does not exist.")
        try:
            dist.destroy_process_group(group)
        except Exception as exc:
            return _fail(f"Failed to destroy custom process group: {exc}.")
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

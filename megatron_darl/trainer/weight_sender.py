"""The learner's side of `rollout.weight_sync=distributed`: broadcasting a version to engines.

What it is: `WeightSender`, held by the main learner rank. `stage(version, buckets)` keeps the
newest version's HF-named tensors on CPU (checked finite by the publisher; one device-to-host
copy per version, so that a restarted or late engine can get the current version at any time
and a transfer overlaps the next train step); a thread answers the rollout manager's transfer
requests (`channel/weight_transfer.py`) with it.
What it is not: the gathering of TP/PP shards (`weights.iter_hf_buckets`) or the pause and
resume around a transfer (the manager's).

Each engine of a request has its own process group, made through SGLang 0.5.23's
`/init_weights_update_group` (the learner is rank 0 and hosts the rendezvous at
master_address:<free port>, the engine's TP ranks are 1..tp); a new group name (the manager's,
after an engine came back or the manager restarted) replaces the engine's old group. A version
goes to each engine inside SGLang's weight-update session, which 0.5.23 requires:
`/begin_weight_update` (a session left open by a learner that stopped mid-version is ended
first), then per bucket `/update_weights_from_distributed` (names, dtypes, shapes, the group;
`weight_version` and `flush_cache` on the last bucket only, the flush only where the pause mode
leaves no request holding KV, `rq.flushes_cache`: 0.5.23 fails the update when a flush is
refused) while it broadcasts the bucket's tensors from rank 0, in that order, one broadcast
each, then `/end_weight_update`, on success and on every failure path. Engines are served
concurrently, bucket by bucket (a bucket goes to the device once for all of them). NCCL when
the learner runs on GPUs, gloo on CPU; every broadcast is issued asynchronously and waited for
with a deadline of `timeout_s`, after which the group is aborted; the groups are built without
NCCL's teardown on error, so an engine that stops or dies mid-broadcast costs the learner that
engine's version, never its life. An engine whose join, post or broadcast fails loses its group
(`/destroy_weights_update_group`, best effort) and gets a fallback HF folder of the version,
written once from the staged tensors: SGLang loads each bucket as it arrives, so an engine that
failed half-way must load a whole version before it generates (the manager's rule).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_darl.channel.json_files import read_json, write_json_atomic
from megatron_darl.channel.ports import free_port
from megatron_darl.channel.process_group import abort_group, init_custom_group
from megatron_darl.channel.weight_transfer import transfer_paths
from megatron_darl.learner.weights import describe, write_hf_folder

log = logging.getLogger(__name__)
Bucket = list[tuple[str, torch.Tensor]]



def _broadcast(group, bucket: Bucket, device: str, timeout_s: float = 120.0, poll_s: float = 0.005) -> None:
    """One broadcast per tensor from rank 0, in order (tensors already on `device`), all issued
    asynchronously, then waited for with one deadline: a broadcast not done after `timeout_s`
    (an engine stopped or gone mid-receive) aborts the group and raises TimeoutError, and a
    failed one (a peer that hung up) raises its error, so that the learner lives on and the
    engine falls back to a folder. The group, built without NCCL's teardown on error
    (`channel/process_group.py`), never takes the process down with it."""
    if device != "cpu":
        torch.cuda.current_stream().synchronize()  # the bucket's host-to-device copies are done
    works = [dist.broadcast(t, group=group, group_src=0, async_op=True) for _, t in bucket]
    deadline = time.monotonic() + timeout_s
    for work in works:
        while not work.is_completed():
            if time.monotonic() > deadline:
                abort_group(group)
                raise TimeoutError(f"weight broadcast not done after {timeout_s:.0f}s (rollout.weight_sync_timeout_s): "
                                   f"the engine stopped receiving; its group is aborted")
            time.sleep(poll_s)
        work.wait()  # raises the broadcast's error, if it failed
    if device != "cpu":
        torch.cuda.synchronize()


class WeightSender:
    def __init__(self, notice_path: str, master_address: str, fallback_root: str, folder_info: tuple[dict, list[str]],
                 backend: str = "gloo", timeout_s: float = 120.0, api_key: str | None = None, poll_s: float = 0.02,
                 flush_cache: bool = True):
        """A sender with nothing staged; its service thread starts at the first `stage`.

        Args:
            notice_path: the run's weight notice file; the transfer request and result files sit beside it.
            master_address: this learner's address, where each engine group's rendezvous is hosted (a free port).
            fallback_root: where fallback HF folders are written, one `v<version>` folder per failed version.
            folder_info: `(config.json dict, folders holding the tokenizer files)` for those folders
                (`hf_folder_info`).
            backend: the broadcast's backend: `nccl` (learner on GPUs; buckets copied to CUDA first) or `gloo`.
            timeout_s: seconds each step of a transfer may take (the join, an HTTP call, a bucket's broadcasts)
                before that engine falls back (`rollout.weight_sync_timeout_s`); also `drain`'s default wait.
            api_key: the engines' bearer token; None: no key.
            poll_s: seconds between two reads of the request file (and of `drain`'s checks).
            flush_cache: ask for a cache flush with the last bucket (`rq.flushes_cache(rollout.pause_mode)`).
        """
        self.request_path, self.result_path = transfer_paths(notice_path)
        self.master_address, self.fallback_root, self.folder_info = master_address, fallback_root, folder_info
        self.backend, self.timeout_s, self.api_key, self.poll_s = backend, timeout_s, api_key, poll_s
        self.flush_cache = flush_cache  # with the last bucket (`rq.flushes_cache(rollout.pause_mode)`)
        self.device = "cuda" if backend == "nccl" else "cpu"
        self._staged: tuple[int, list[Bucket]] | None = None
        self._groups: dict[str, tuple[str, Any]] = {}  # group name -> (engine URL, process group)
        self._fallbacks: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="darl-weight-sender", daemon=True)
        self.sent = self.failed = 0  # engine-versions delivered / fallen back (for the logs)
        self.served_version = -1  # the newest version a transfer request got
        self.last_send_s = 0.0
        # a request left by an earlier attempt of the run is not this run's manager asking
        self._seen_at_start = (self._read_request() or {}).get("id")

    def stage(self, version: int, buckets: list[Bucket]) -> None:
        """The version the next requests get (a reference swap: a transfer under way keeps its own)."""
        self._staged = (version, buckets)
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until the staged version went out (the manager asks for it after pausing the
        engines: a learner that stopped first would leave them paused); False after the timeout."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while self._staged is not None and self.served_version < self._staged[0] and self._thread.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(self.poll_s)
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s + 5)
        for name in list(self._groups):
            self._drop(name)

    # ---- the service ---------------------------------------------------------------------
    def _read_request(self) -> dict | None:
        try:
            req = read_json(self.request_path)
        except ValueError as exc:  # someone else wrote the file: say so, keep polling
            log.error("%s", exc)
            return None
        return req if isinstance(req, dict) else None

    def _serve(self) -> None:
        last = self._seen_at_start
        while not self._stop.is_set():
            req = self._read_request()
            if req is not None and req.get("id") != last and self._staged is not None:
                last = req.get("id")
                try:
                    result = self.serve(req)
                except Exception as exc:  # e.g. the fallback folder could not be written: answer anyway
                    log.exception("weight transfer %s failed", last)
                    result = {"id": last, "version": self._staged[0], "ok": [], "fallback": None,
                              "failed": {e["index"]: repr(exc)[:500] for e in req.get("engines") or []}}
                write_json_atomic(self.result_path, result)
            time.sleep(self.poll_s)

    def serve(self, req: dict) -> dict:
        """Send the staged version to the request's engines; the transfer result."""
        version, buckets = self._staged
        t0 = time.perf_counter()
        engines = req.get("engines") or []
        errors = asyncio.run(self._asend_all(engines, version, buckets))
        self.last_send_s = time.perf_counter() - t0
        self.served_version = max(self.served_version, version)
        failed = {e["index"]: err for e, err in zip(engines, errors) if err is not None}
        self.sent += len(engines) - len(failed)
        self.failed += len(failed)
        fallback = None
        if failed:
            log.warning("weight version %d: broadcast failed for engines %s; writing a fallback folder",
                        version, failed)
            fallback = self._fallback_folder(version, buckets)
        return {"id": req.get("id"), "version": version,
                "ok": [e["index"] for e in engines if e["index"] not in failed],
                "failed": failed, "fallback": fallback}

    def staged_folder(self, version: int) -> str | None:
        """An HF folder of `version` if it is the staged one (written once; the in-loop
        evaluation reads it), else None."""
        staged = self._staged
        return self._fallback_folder(*staged) if staged is not None and staged[0] == version else None

    def _fallback_folder(self, version: int, buckets: list[Bucket]) -> str:
        if version not in self._fallbacks:
            out = os.path.join(self.fallback_root, f"v{version}")
            write_hf_folder(buckets, out, *self.folder_info)
            self._fallbacks[version] = out
        return self._fallbacks[version]

    # ---- one transfer ----------------------------------------------------------------------
    async def _asend_all(self, engines: list[dict], version: int, buckets: list[Bucket]) -> list[str | None]:
        """Per engine: its group (joined if new), SGLang's weight-update session opened, the
        buckets, the session closed. Bucket by bucket (each copied to the device once, whatever
        the number of engines), to every engine still fine; an engine's error (join, session,
        post or broadcast) ends its part, and its session is closed on that path too."""
        from megatron_darl.rollout.sglang_client import SGLangClient

        clients = [SGLangClient(e["url"], api_key=self.api_key, timeout_s=self.timeout_s, max_retries=0)
                   for e in engines]
        try:
            joined = await asyncio.gather(*(self._aopen(c, e["group"]) for c, e in zip(clients, engines)),
                                          return_exceptions=True)
            errors: list[BaseException | None] = [g if isinstance(g, BaseException) else None for g in joined]
            await self._abuckets(clients, engines, joined, errors, version, buckets)
            live = [k for k, err in enumerate(errors) if err is None]
            ends = await asyncio.gather(*(clients[k].aend_weight_update() for k in live), return_exceptions=True)
            for k, r in zip(live, ends):
                errors[k] = r if isinstance(r, BaseException) else None
            await asyncio.gather(*(self._afailed(clients[k], engines[k], version, err)
                                   for k, err in enumerate(errors) if err is not None))
            return [None if err is None else f"{type(err).__name__}: {err}"[:500] for err in errors]
        except BaseException:  # a failure of our own (a device copy, a cancel): leave no session open
            await asyncio.gather(*(self._aend_quietly(c) for c in clients), return_exceptions=True)
            raise
        finally:
            for c in clients:
                await c.aclose()

    async def _abuckets(self, clients, engines, groups, errors, version: int, buckets: list[Bucket]) -> None:
        """Each bucket to the engines without an error yet; `errors` gets each engine's first."""
        for i, bucket in enumerate(buckets):
            live = [k for k, err in enumerate(errors) if err is None]
            if not live:
                return
            sent = [(n, t.to(self.device, non_blocking=True)) for n, t in bucket] if self.device != "cpu" else bucket
            last = i == len(buckets) - 1
            results = await asyncio.gather(*(self._abucket(clients[k], groups[k], engines[k]["group"], sent,
                                                           version if last else None) for k in live),
                                           return_exceptions=True)
            for k, r in zip(live, results):
                errors[k] = r if isinstance(r, BaseException) else None

    async def _aopen(self, client, name: str):
        """The engine's group, then its weight-update session (SGLang 0.5.23 refuses
        /update_weights_from_distributed outside one); a session left open by a learner that
        stopped mid-version is ended first."""
        group = await self._agroup(client, name)
        if await client.aopen_weight_update():
            log.warning("engine %s: ended a weight-update session left open (a learner that stopped "
                        "mid-version) before this one", client.url)
        return group

    async def _aend_quietly(self, client) -> None:
        """End the engine's session if one is open (best effort: the engine may be dead)."""
        try:
            await client.aend_stale_weight_update()
        except Exception as exc:
            log.info("engine %s: end_weight_update after a failure: %r", client.url, exc)

    async def _abucket(self, client, group, name: str, bucket: Bucket, version: int | None) -> None:
        """Post the bucket's description and broadcast its tensors, concurrently (the engine
        receives inside its handler); the first error of either."""
        post = client.aupdate_weights_from_distributed(**describe(bucket), version=version, group_name=name,
                                                       flush_cache=self.flush_cache and version is not None)
        results = await asyncio.gather(post, asyncio.to_thread(_broadcast, group, bucket, self.device, self.timeout_s),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def _afailed(self, client, engine: dict, version: int, err: BaseException) -> None:
        log.warning("engine %s: weight broadcast of version %d failed: %r", engine["url"], version, err)
        calls = [self._aend_quietly(client)]  # the session closed on this path too
        if engine["group"] in self._groups:  # our side first: a receive still waiting may fail sooner
            self._drop(engine["group"])
            calls.append(self._aforget(client, engine["group"]))
        # at once: both may wait behind a receive the engine is still in (each bounded by timeout_s)
        await asyncio.gather(*calls)

    async def _agroup(self, client, name: str):
        """The engine's group `name`, joined now if new (its older groups are dropped)."""
        if name in self._groups:
            return self._groups[name][1]
        for old in [n for n, (url, _) in self._groups.items() if url == client.url]:
            self._drop(old)  # the engine's previous life: its side of that group is gone or stale
            await self._aforget(client, old)
        info = await client.arequest("GET", "/server_info", retries=0)
        tp = int(info.get("tp_size", 1)) if isinstance(info, dict) else 1
        port = free_port(self.master_address)
        join = client.ainit_weights_update_group(self.master_address, port, 1, 1 + tp, name, self.backend)
        host = asyncio.to_thread(init_custom_group, self.master_address, port, 1 + tp, name, 0, self.backend,
                                 self.timeout_s)
        joined, group = await asyncio.gather(join, host, return_exceptions=True)
        if isinstance(group, BaseException) or isinstance(joined, BaseException):
            if not isinstance(group, BaseException):
                dist.destroy_process_group(group)
            raise joined if isinstance(joined, BaseException) else group
        self._groups[name] = (client.url, group)
        return group

    def _drop(self, name: str) -> None:
        _, group = self._groups.pop(name)
        try:
            dist.destroy_process_group(group)
        except Exception as exc:  # a group whose peer died may refuse a clean teardown
            log.info("destroying weight group %s: %r", name, exc)

    async def _aforget(self, client, name: str) -> None:
        try:
            await client.adestroy_weights_update_group(name)
        except Exception as exc:  # best effort: a dead or restarted engine has no such group
            log.info("engine %s: destroy_weights_update_group %s: %r", client.url, name, exc)

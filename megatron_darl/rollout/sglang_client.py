"""HTTP client for SGLang servers (and the embedded `darl-engine`, which speaks the same
protocol): the `RolloutEngine` the rollout manager drives, one per engine URL.

What it is: the aiohttp transport. Bodies and answers are built and parsed by
`sglang_requests.py`; this module adds timeouts, retries with exponential backoff on
connection failures and 502/503/504, the optional Bearer API key, and two clear errors:
`EngineUnreachableError` (no answer after the retries, or a timeout) and `EngineHTTPError`
(a 4xx/5xx answer), both naming URL, route and, for HTTP errors, status and body.
What it is not: a load balancer or failure detector (the manager marks engines down), nor
the learner side of a weight broadcast (`trainer/weight_sender.py`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout import sglang_requests as rq
from megatron_darl.types import GenerateRequest, GenerateResponse, WeightVersion

RETRY_STATUSES = (502, 503, 504)  # proxies and starting servers answer these; worth another try
# connections kept beside the generation ones, so that pause/update/resume/health calls never
# wait behind a full pool of /generate requests
CONTROL_CONNECTIONS = 8


class EngineError(RuntimeError):
    """Base of the transport errors; `url` and `route` say which call failed."""

    def __init__(self, url: str, route: str, message: str):
        super().__init__(message)
        self.url, self.route = url, route


class EngineUnreachableError(EngineError):
    """No HTTP answer: connection refused or reset, or no answer within the timeout."""

    def __init__(self, url: str, route: str, attempts: int, cause: BaseException | None):
        super().__init__(url, route, f"engine {url} unreachable on {route} after {attempts} attempt(s): {cause!r}")
        self.attempts, self.cause = attempts, cause


class EngineHTTPError(EngineError):
    """The engine answered with an HTTP error status."""

    def __init__(self, url: str, route: str, status: int, body: str):
        super().__init__(url, route, f"engine {url} answered {route} with HTTP {status}: {body[:500]}")
        self.status, self.body = status, body


def _refusal(exc: Exception) -> str:
    """The text of a weight route's refusal: a 400's body, or a 200 with success=false."""
    return exc.body if isinstance(exc, EngineHTTPError) else str(exc)


class SGLangClient:
    """`RolloutEngine` over HTTP. Create it anywhere; its aiohttp session opens lazily in the
    running event loop (and is reopened if a later call runs in another loop).

    A busy engine is not a dead one (hence `connect_timeout_s` and `max_connections` below):
    aiohttp's default, 100 connections with the pool wait counted in the connect timeout, made
    the 156 requests beyond the first 100 of a 256-wide engine time out after 5 s and the engine
    be marked down while it was working."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0,
                 connect_timeout_s: float = 5.0, max_retries: int = 3, backoff_s: float = 0.5,
                 initial_version: int = 0, max_connections: int | None = None, flush_cache: bool = True):
        """A client of the engine at `url`; no connection is made until the first call.

        Args:
            url: the engine's base URL, e.g. `http://127.0.0.1:30000` (a trailing `/` is dropped).
            api_key: sent as `Authorization: Bearer KEY` on every call; None or empty: no header.
            timeout_s: seconds a whole call may take, /generate included: a hung engine surfaces after it.
            connect_timeout_s: seconds for the TCP connect only (aiohttp's `sock_connect`), never the wait
                for a free pooled connection.
            max_retries: extra attempts after the first, on connection failures, 502/503/504 and timeouts.
            backoff_s: seconds before the first retry; the wait doubles with every retry.
            initial_version: the version SGLang's non-integer `weight_version` ("default", before any
                update) stands for.
            max_connections: the pool's generation connections, plus CONTROL_CONNECTIONS for control calls;
                None: no limit (the manager bounds requests per engine itself).
            flush_cache: ask for a cache flush with each folder load (see `sglang_requests.flushes_cache`).
        """
        self.url = url.rstrip("/")
        self.flush_cache = flush_cache  # ask for a cache flush with each folder load (`rq.flushes_cache`)
        self.api_key = api_key
        self.timeout_s = timeout_s  # whole call, /generate included: a hung engine surfaces after it
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries  # extra attempts after the first
        self.backoff_s = backoff_s  # first wait; doubles every retry
        self.initial_version = initial_version  # what SGLang's non-integer "default" version means
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_config(cls, url: str, cfg: RolloutConfig, initial_version: int = 0) -> "SGLangClient":
        """A client with the rollout config's key, timeout, retries, connection pool, and a cache
        flush with each load only where the pause mode leaves no request holding KV."""
        return cls(url, api_key=cfg.api_key, timeout_s=cfg.request_timeout_s, max_retries=cfg.max_retries,
                   initial_version=initial_version, max_connections=cfg.max_concurrent_per_engine,
                   flush_cache=rq.flushes_cache(cfg.pause_mode))

    # ---- RolloutEngine -----------------------------------------------------------------
    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        # a timed-out generation is not resent: the engine may still be running it
        data = await self.arequest("POST", "/generate", rq.generate_body(request), retry_timeouts=False)
        return rq.parse_generate(request.rid, data, self.initial_version)

    async def apause(self, mode: str = "abort") -> None:
        await self.arequest("POST", "/pause_generation", rq.pause_body(mode))

    async def aresume(self) -> None:
        await self.arequest("POST", "/continue_generation", {})

    async def aupdate_weights(self, weights: WeightVersion) -> None:
        """Load a published version. "disk" and "shm" are both HF folders (shm: under /dev/shm
        on this node) loaded through /update_weights_from_disk; "distributed" versions are pushed
        by the learner's broadcast (`trainer/weight_sender.py`), never through this call."""
        if weights.weight_sync not in ("disk", "shm"):
            raise ValueError(
                f"SGLangClient.aupdate_weights: weight_sync {weights.weight_sync!r} is not a folder; a 'distributed' "
                "version is sent by the learner: ainit_weights_update_group once, then "
                "abegin_weight_update, then aupdate_weights_from_distributed while the learner broadcasts, "
                "then aend_weight_update")
        route = "/update_weights_from_disk"
        body = rq.update_from_disk_body(weights.location, weights.version, flush_cache=self.flush_cache)
        rq.check_success(route, await self.arequest("POST", route, body))

    async def ahealth(self) -> bool:
        """One try of /health_generate with the connect timeout; any failure means unhealthy."""
        try:
            await self.arequest("GET", "/health_generate", timeout_s=max(self.connect_timeout_s, 30.0), retries=0)
        except EngineError:
            return False
        return True

    # ---- the rest of the protocol ------------------------------------------------------
    async def aabort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self.arequest("POST", "/abort_request", rq.abort_body(rid, abort_all))

    async def amodel_info(self) -> dict[str, Any]:
        return await self.arequest("GET", "/model_info")

    async def aprompt_logprobs(self, ids: list[int], timeout_s: float | None = None) -> list[float]:
        """log p(ids[t] | ids[:t]) for t >= 1, untempered, as SGLang 0.5.23 answers
        `logprob_start_len=0` (its first entry is null): the weight probe (`rollout/probe.py`)."""
        body = {"input_ids": list(ids), "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True, "logprob_start_len": 0, "stream": False}
        data = await self.arequest("POST", "/generate", body, timeout_s=timeout_s, retry_timeouts=False)
        try:
            entries = data["meta_info"]["input_token_logprobs"]
            lps = [float(e[0]) for e in entries[1:]]
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise ValueError(f"{self.url}/generate: no prompt log-probs in the answer ({exc!r})") from None
        if len(lps) != len(ids) - 1:
            raise ValueError(f"{self.url}/generate: {len(lps) + 1} prompt log-prob entries for {len(ids)} tokens")
        return lps

    async def aflush_cache(self) -> None:
        await self.arequest("POST", "/flush_cache")

    async def ainit_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                         world_size: int, group_name: str = "weight_update_group",
                                         backend: str = "nccl") -> None:
        route = "/init_weights_update_group"
        body = rq.init_group_body(master_address, master_port, rank_offset, world_size, group_name, backend)
        # not retried: the learner's side of the rendezvous is waiting for exactly one join
        rq.check_success(route, await self.arequest("POST", route, body, retries=0, retry_timeouts=False))

    async def abegin_weight_update(self) -> None:
        """Open SGLang's weight-update session: /update_weights_from_distributed is refused
        outside one. Not retried: a second begin after a lost answer would be refused."""
        route = "/begin_weight_update"
        rq.check_success(route, await self.arequest("POST", route, rq.begin_session_body(), retries=0,
                                                    retry_timeouts=False))

    async def aend_weight_update(self) -> None:
        """Close the session opened by `abegin_weight_update` (an error if none is open)."""
        route = "/end_weight_update"
        rq.check_success(route, await self.arequest("POST", route, rq.end_session_body(), retries=0,
                                                    retry_timeouts=False))

    async def aend_stale_weight_update(self) -> bool:
        """Close a session that may be open (left by a learner that died mid-version, or after a
        failed version): True if one was, False if the engine answered the release's "no
        weight-update session is open" refusal; any other failure raises."""
        try:
            await self.aend_weight_update()
        except (EngineHTTPError, rq.UpdateFailedError) as exc:
            if rq.NO_SESSION_OPEN in _refusal(exc):
                return False
            raise
        return True

    async def aopen_weight_update(self) -> bool:
        """`abegin_weight_update`, recovering an engine whose session was left open: on the
        release's "already open" refusal it ends that session and begins again. True if a
        stale session was closed."""
        try:
            await self.abegin_weight_update()
        except (EngineHTTPError, rq.UpdateFailedError) as exc:
            if rq.SESSION_ALREADY_OPEN not in _refusal(exc):
                raise
            await self.aend_stale_weight_update()
            await self.abegin_weight_update()
            return True
        return False

    async def aupdate_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                               version: int | None, group_name: str = "weight_update_group",
                                               flush_cache: bool = True, timeout_s: float | None = None) -> None:
        """Returns when the engine has received and loaded every tensor: call it concurrently
        with the learner's broadcast of the same tensors in the same order. Not retried: a
        second post would wait for a broadcast that will not come again."""
        route = "/update_weights_from_distributed"
        body = rq.update_distributed_body(names, dtypes, shapes, version, group_name, flush_cache)
        rq.check_success(route, await self.arequest("POST", route, body, timeout_s=timeout_s, retries=0,
                                                    retry_timeouts=False))

    async def adestroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        route = "/destroy_weights_update_group"
        rq.check_success(route, await self.arequest("POST", route, rq.destroy_group_body(group_name), retries=0))

    # ---- transport ---------------------------------------------------------------------
    async def arequest(self, method: str, route: str, body: dict | None = None, timeout_s: float | None = None,
                       retries: int | None = None, retry_timeouts: bool = True) -> Any:
        """One call with retries; returns the decoded JSON answer (text if not JSON, None if
        empty). Retries connection failures, 502/503/504 and timeouts, waiting
        `backoff_s * 2**attempt` between attempts; raises `EngineHTTPError` or `EngineUnreachableError`.

        Args:
            method: the HTTP method, `GET` or `POST`.
            route: the path after the base URL, e.g. `/generate`.
            body: the JSON body; None sends none.
            timeout_s: seconds the whole call may take; None: the client's `timeout_s`.
            retries: extra attempts after the first; None: the client's `max_retries`.
            retry_timeouts: also retry after a timeout; False raises at once on a read timeout (the
                engine may still be working on it), while a connect timeout is always retried.
        """
        retries = self.max_retries if retries is None else retries
        # sock_connect, not connect: waiting for a pooled connection is not a sign of a dead engine
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s, sock_connect=self.connect_timeout_s)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        last: BaseException | None = None
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._asession().request(method, self.url + route, json=body, headers=headers,
                                                    timeout=timeout) as resp:
                    text = await resp.text()
                    if resp.status in RETRY_STATUSES and attempt < retries:
                        last = EngineHTTPError(self.url, route, resp.status, text)
                        continue
                    if resp.status >= 400:
                        raise EngineHTTPError(self.url, route, resp.status, text)
                    if not text:
                        return None
                    return await resp.json(content_type=None) if resp.content_type == "application/json" else text
            except asyncio.TimeoutError as exc:  # aiohttp's timeouts are TimeoutError subclasses
                last = exc
                # a connect timeout never delivered the request, so resending it is always safe
                if not retry_timeouts and not isinstance(exc, aiohttp.ConnectionTimeoutError):
                    raise EngineUnreachableError(self.url, route, attempt + 1, exc) from exc
            except aiohttp.ClientConnectionError as exc:
                last = exc
        raise EngineUnreachableError(self.url, route, retries + 1, last) from last

    def _asession(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            limit = 0 if self.max_connections is None else self.max_connections + CONTROL_CONNECTIONS
            # trust_env=False (aiohttp's default, stated): engines are never reached through a proxy
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, limit_per_host=0),
                                                  trust_env=False)
            self._session_loop = loop
        return self._session

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

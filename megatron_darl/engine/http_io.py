"""darl-engine's HTTP plumbing: bodies read within bounds, JSON in and out without holding the
event loop, and the status code of each failure.

What it is: `Limits` (the bounds on one request, darl-engine flags); `BodyReader`, which reads a
body within `--max-body-mb` (413 otherwise, answered before reading when the Content-Length
says so) and `--body-timeout-s` (408 for a stalled body), then decodes it: a body of at most
INLINE_JSON_BYTES with the C parser on the event loop (its worst case, tens of thousands of
empty lists or floats, is a few tens of ms), a larger one on a worker thread with a scanner that
is Python all the way down (the C parser never gives up the GIL; this one does every few ms, so
/health answers meanwhile) and stops after `Limits.json_values` values (413). Nesting deeper
than the parser's recursion is a 400, as is anything that is not a JSON object. `encode_strict`
writes answers as strict JSON (no NaN or Infinity) in slices of ENCODE_SLICE items, so a long
answer written on the worker thread never holds the GIL for long either. `error_middleware`
answers each engine exception with its status, and logs one line (no traceback) for a client
that hung up (`ClientGone`) or stalled its body.
What it is not: the routes (`server.py`) or the fields of a /generate body (`requests.py`).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from json.decoder import WHITESPACE, JSONArray, JSONObject, scanstring
from json.scanner import NUMBER_RE
from typing import Any, Callable, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from megatron_darl.engine.requests import MAX_PROMPTS, MAX_REQUEST_TOKENS, BadRequest, TooLarge

log = logging.getLogger("darl-engine")
T = TypeVar("T")

INLINE_JSON_BYTES = 128 * 1024  # larger bodies are decoded on the worker thread
ENCODE_SLICE = 4096  # list items per json.dumps call
_LITERALS = (("null", None), ("true", True), ("false", False), ("NaN", math.nan), ("Infinity", math.inf),
             ("-Infinity", -math.inf))


class EngineFailure(RuntimeError):
    """Decoding failed for a request (answered with HTTP 500; the engine goes on)."""

    status = 500


class ShuttingDown(RuntimeError):
    """The server is stopping (answered with HTTP 503)."""

    status = 503


class BodyTimeout(BadRequest):
    """The body did not arrive within --body-timeout-s (HTTP 408, the connection is closed)."""

    status = 408


class ClientGone(Exception):
    """The client hung up; what it asked for is dropped and nothing is answered."""


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (darl-engine flags)."""

    max_prompts: int = MAX_PROMPTS  # --max-prompts-per-request
    max_tokens: int = MAX_REQUEST_TOKENS  # --max-request-tokens (prompt tokens, summed)
    max_body_bytes: int = 16 * 1024**2  # --max-body-mb
    body_timeout_s: float = 30.0  # --body-timeout-s

    @property
    def json_values(self) -> int:
        """The JSON values a large body may hold: its tokens, a few dozen per prompt (sampling
        parameters, rid), and some slack for the other fields."""
        return self.max_tokens + 64 * self.max_prompts + 4096


def _scanner(budget: int) -> Callable[[str, int], tuple[Any, int]]:
    """`json.scanner.py_make_scanner`'s scan_once with the default hooks, counting the values
    it reads: TooLarge after `budget` of them."""
    memo: dict = {}
    left = [budget]

    def scan(s: str, idx: int) -> tuple[Any, int]:
        left[0] -= 1
        if left[0] < 0:
            raise TooLarge(f"request body holds more than {budget} JSON values (the bounds are darl-engine "
                           "--max-prompts-per-request and --max-request-tokens)")
        if idx >= len(s):
            raise StopIteration(idx)
        c = s[idx]
        if c == '"':
            return scanstring(s, idx + 1, True)
        if c == "{":
            return JSONObject((s, idx + 1), True, scan, None, None, memo)
        if c == "[":
            return JSONArray((s, idx + 1), scan)
        for word, value in _LITERALS:
            if s.startswith(word, idx):
                return value, idx + len(word)
        m = NUMBER_RE.match(s, idx)
        if m is None:
            raise StopIteration(idx)
        integer, frac, exp = m.groups()
        return (float(integer + (frac or "") + (exp or "")) if frac or exp else int(integer)), m.end()

    return scan


def decode_json(raw: bytes, budget: int) -> Any:
    """`json.loads(raw)`; above INLINE_JSON_BYTES with the counting Python scanner."""
    if len(raw) <= INLINE_JSON_BYTES:
        return json.loads(raw)
    s = raw.decode(json.detect_encoding(raw), "surrogatepass")
    try:
        obj, end = _scanner(budget)(s, WHITESPACE.match(s, 0).end())
    except StopIteration as err:
        raise json.JSONDecodeError("Expecting value", s, err.value) from None
    end = WHITESPACE.match(s, end).end()
    if end != len(s):
        raise json.JSONDecodeError("Extra data", s, end)
    return obj


def parse_body(raw: bytes, budget: int, allow_empty: bool = False) -> dict:
    """The JSON object in `raw` (`BadRequest` naming what is wrong otherwise)."""
    if not raw or raw.isspace():
        if allow_empty:
            return {}
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = decode_json(raw, budget)
    except BadRequest:
        raise
    except RecursionError:
        raise BadRequest("request body is nested too deeply for the JSON parser "
                         "(this protocol needs 4 levels at most)") from None
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


_dumps = functools.partial(json.dumps, allow_nan=False, separators=(",", ":"))


def _encode(obj: Any, out: list[str]) -> None:
    if isinstance(obj, dict):
        out.append("{")
        for i, (key, value) in enumerate(obj.items()):
            out.append(("," if i else "") + _dumps(str(key)) + ":")
            _encode(value, out)
        out.append("}")
    elif isinstance(obj, list) and obj and isinstance(obj[0], dict):
        out.append("[")
        for i, value in enumerate(obj):
            out.append("," if i else "")
            _encode(value, out)
        out.append("]")
    elif isinstance(obj, list) and len(obj) > ENCODE_SLICE:
        out.append("[" + ",".join(_dumps(obj[i:i + ENCODE_SLICE])[1:-1]
                                  for i in range(0, len(obj), ENCODE_SLICE)) + "]")
    else:
        out.append(_dumps(obj))


def encode_strict(obj: Any) -> bytes:
    """Strict JSON (ValueError on NaN or Infinity), written in slices of ENCODE_SLICE items."""
    out: list[str] = []
    _encode(obj, out)
    return "".join(out).encode()


def _without_gc(work: Callable[[], T]) -> T:
    """`work()` with the cyclic collector paused (only this one worker thread pauses it): a
    large body makes hundreds of thousands of lists, and each full collection they trigger
    walks the whole heap holding the GIL, /health unanswered meanwhile. JSON
    makes no cycles; reference counting frees it all."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return work()
    finally:
        if enabled:
            gc.enable()


def client_gone(request: web.BaseRequest) -> bool:
    """Whether the connection of `request` is closed (aiohttp drops the transport when the
    client hangs up, whether or not the handler is cancelled)."""
    transport = request.transport
    return transport is None or transport.is_closing()


class BodyReader:
    """Reads and decodes request bodies within `limits`; heavy work goes to one worker thread."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="darl-json")

    async def arun(self, work: Callable[[], T], heavy: bool) -> T:
        """`work()` on the event loop when it is light, on the worker thread when it is not."""
        if not heavy:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self.pool, _without_gc, work)

    async def aread(self, request: web.BaseRequest, parse: Callable[[dict], T] | None = None,
                    allow_empty: bool = False) -> T | dict:
        """The body's JSON object, then `parse(body)` if given (both off the loop for a large body)."""
        raw = await self._abytes(request)

        def work():
            body = parse_body(raw, self.limits.json_values, allow_empty)
            return body if parse is None else parse(body)

        return await self.arun(work, heavy=len(raw) > INLINE_JSON_BYTES)

    async def _abytes(self, request: web.BaseRequest) -> bytes:
        limit = self.limits.max_body_bytes
        too_large = f"at most {limit} bytes per request body (darl-engine --max-body-mb)"
        if request.content_length is not None and request.content_length > limit:
            raise TooLarge(f"request body of {request.content_length} bytes; {too_large}")
        try:
            return await asyncio.wait_for(request.read(), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise BodyTimeout(f"request body not received within {self.limits.body_timeout_s:g} s "
                              "(darl-engine --body-timeout-s)") from None
        except web.HTTPRequestEntityTooLarge:
            raise TooLarge(f"request body too large; {too_large}") from None
        except (ConnectionError, HttpProcessingError) as exc:  # a hang-up, or a body aiohttp cannot frame
            if isinstance(exc, ConnectionError) or client_gone(request):
                raise ClientGone("while sending its body") from None
            raise BadRequest(f"request body could not be read: {exc}") from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def error_middleware(on_gone: Callable[[web.Request, ClientGone], None]):
    """Engine exceptions -> JSON answers with their status; a client that hung up -> `on_gone`
    (which logs one line) and no answer anyone reads."""

    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            return await handler(request)
        except ClientGone as exc:
            on_gone(request, exc)
            return web.Response(status=499)  # nginx's "client closed request": never delivered
        except (BadRequest, EngineFailure, ShuttingDown) as exc:
            resp = web.json_response({"error": str(exc)}, status=exc.status)
            if isinstance(exc, BodyTimeout):  # answer, then close at once: aiohttp would linger 10 s for the body
                log.info("%s %s from %s: %s; connection closed", request.method, request.path, request.remote, exc)
                resp.force_close()
                await resp.prepare(request)
                await resp.write_eof()
                request.protocol.force_close()
            return resp  # an unread body (413) is drained for at most aiohttp's lingering time, then closed

    return errors

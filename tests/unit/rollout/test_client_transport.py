"""The SGLang client's transport against a scripted in-process aiohttp server on 127.0.0.1:
retries with backoff then a clear error on an unreachable port, retries on 503, no retry on
4xx, a timed-out /generate is not resent, and the API key travels as a Bearer token."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from megatron_darl.channel.ports import free_port
from megatron_darl.rollout.sglang_client import EngineHTTPError, EngineUnreachableError, SGLangClient
from megatron_darl.types import GenerateRequest, SamplingParams

REQ = GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2), rid="t")
ANSWER = {"output_ids": [4, 5], "meta_info": {"finish_reason": {"type": "length", "length": 2}, "weight_version": "7",
                                              "output_token_logprobs": [[-0.1, 4, None], [-0.2, 5, None]]}}


async def _aserve(script):
    """Serve POST /generate from `script(n, request) -> web.Response` (n: call count)."""
    calls: list[web.Request] = []

    async def handler(request):
        calls.append(request)
        return await script(len(calls), request)

    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}", calls


def test_unreachable_port_retries_with_backoff_then_names_url_and_route():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def go():
        async with SGLangClient(url, max_retries=2, backoff_s=0.1, connect_timeout_s=1.0) as client:
            t0 = time.perf_counter()
            with pytest.raises(EngineUnreachableError) as err:
                await client.agenerate(REQ)
            return err.value, time.perf_counter() - t0

    err, elapsed = asyncio.run(go())
    assert err.attempts == 3 and err.url == url and err.route == "/generate"
    assert url in str(err) and "/generate" in str(err) and "3 attempt" in str(err)
    assert elapsed >= 0.1 + 0.2  # two backoff waits, doubling


def test_503_is_retried_then_answer_parsed_with_request_version():
    async def script(n, request):
        if n < 3:
            return web.json_response({"error": "starting"}, status=503)
        assert request.headers["Authorization"] == "Bearer k"
        assert (await request.json())["input_ids"] == [1, 2, 3]
        return web.json_response(ANSWER)

    async def go():
        runner, url, calls = await _aserve(script)
        try:
            async with SGLangClient(url, api_key="k", backoff_s=0.01) as client:
                return await client.agenerate(REQ), len(calls)
        finally:
            await runner.cleanup()

    resp, n = asyncio.run(go())
    assert n == 3 and resp.output_ids == [4, 5] and resp.output_versions == [7, 7]


def test_4xx_is_not_retried_and_error_carries_status_and_body():
    async def script(n, request):
        return web.json_response({"error": "field 'input_ids' is required"}, status=400)

    async def go():
        runner, url, calls = await _aserve(script)
        try:
            async with SGLangClient(url, backoff_s=0.01) as client:
                with pytest.raises(EngineHTTPError) as err:
                    await client.agenerate(REQ)
                return err.value, len(calls), url
        finally:
            await runner.cleanup()

    err, n, url = asyncio.run(go())
    assert n == 1 and err.status == 400 and "input_ids" in err.body
    assert url in str(err) and "/generate" in str(err) and "400" in str(err)


def test_timed_out_generate_is_not_resent():
    async def script(n, request):
        await asyncio.sleep(1.0)
        return web.json_response(ANSWER)

    async def go():
        runner, url, calls = await _aserve(script)
        try:
            async with SGLangClient(url, timeout_s=0.2, backoff_s=0.01) as client:
                with pytest.raises(EngineUnreachableError) as err:
                    await client.agenerate(REQ)
                return err.value, len(calls)
        finally:
            await runner.cleanup()

    err, n = asyncio.run(go())
    assert n == 1 and err.attempts == 1 and isinstance(err.cause, asyncio.TimeoutError)

"""`darl-engine` as a real subprocess on 127.0.0.1, driven by the SGLang client: behavior
log-probs equal transformers' teacher-forced ones, concurrent requests batch, pause + weight
update + continue gives per-token versions that score under the weights that produced them,
abort returns partial output, API key and malformed bodies are refused with the field named."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
import torch
import transformers  # noqa: F401  (a hard dependency: imported, never skipped)

from megatron_darl.rollout.sglang_client import EngineHTTPError, SGLangClient
from megatron_darl.types import GenerateRequest, SamplingParams, WeightVersion
from tests.helpers.engines import running_engines, save_wide, teacher_forced

KEY = "s3cret"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two engines on the same tiny Qwen3: a plain one and one with an API key (the latter
    also gets weight updates, so the plain one keeps version 0 throughout)."""
    root = tmp_path_factory.mktemp("engine")
    models = {"v0": save_wide(root / "v0", seed=0), "v1": save_wide(root / "v1", seed=1)}
    save_wide(root / "wide", seed=2, intermediate_size=128)
    with running_engines([(root / "v0", None), (root / "v0", KEY)], root) as started:
        (plain, _), (keyed, _) = started
        yield {"root": root, "models": models, "plain": plain, "keyed": keyed}


def request(rid: str, prompt: list[int], **sampling) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt, sampling=SamplingParams(**sampling), rid=rid)


def test_behavior_logprobs_equal_transformers(world):
    cases = [(0.7, 1.0, -1), (1.0, 1.0, -1), (1.5, 0.9, 20), (1.0, 0.5, 5)]

    async def go():
        async with SGLangClient(world["plain"]) as client:
            reqs = [request(f"lp{i}", [1 + i, 5, 9, 2 + i], temperature=t, top_p=p, top_k=k, max_new_tokens=24,
                            ignore_eos=True, seed=i) for i, (t, p, k) in enumerate(cases)]
            return reqs, await asyncio.gather(*(client.agenerate(r) for r in reqs))

    reqs, resps = asyncio.run(go())
    for req, resp in zip(reqs, resps):
        assert resp.finish_reason == "length" and len(resp.output_ids) == 24
        assert resp.output_versions == [0] * 24 and resp.weight_version == 0
        ref = teacher_forced(world["models"]["v0"], req.input_ids, resp.output_ids, req.sampling.temperature)
        assert (ref - torch.tensor(resp.output_logprobs)).abs().max().item() < 1e-4, req.rid


def test_concurrent_requests_batch_and_beat_sequential(world):
    reqs = [request(f"c{i}", [3, i + 1, 7], temperature=1.0, max_new_tokens=48, ignore_eos=True, seed=100 + i)
            for i in range(16)]

    async def go():
        async with SGLangClient(world["plain"]) as client:
            await client.agenerate(reqs[0])  # warm-up
            t0 = time.perf_counter()
            seq = [await client.agenerate(r) for r in reqs]
            t1 = time.perf_counter()
            conc = await asyncio.gather(*(client.agenerate(r) for r in reqs))
            return seq, conc, t1 - t0, time.perf_counter() - t1

    seq, conc, t_seq, t_conc = asyncio.run(go())
    print(f"16 requests x 48 tokens: one at a time {t_seq:.3f}s, concurrently {t_conc:.3f}s ({t_seq / t_conc:.1f}x)")
    assert t_conc < t_seq
    for a, b in zip(seq, conc):  # seeded requests do not depend on their batch neighbours
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-4


async def _await_progress(client: SGLangClient, mode: str, task: asyncio.Task) -> int:
    """Pause once the single running request has some but not all of its tokens; return how
    many it had when the pause took effect."""
    for _ in range(400):
        await asyncio.sleep(0.01)
        await client.apause(mode if mode != "abort" else "in_place")
        running = (await client.arequest("GET", "/server_info"))["running"]
        if running and running[0]["generated"] > 0:
            if mode == "abort":
                await client.apause("abort")
            return running[0]["generated"]
        assert not task.done(), "generation finished before it could be paused"
        await client.aresume()
    raise AssertionError("the request never started")


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_update_continue_gives_two_versions(world, mode):
    prompt, n = [4, 8, 15, 16, 23], 300

    async def go():
        async with SGLangClient(world["keyed"], api_key=KEY) as client:
            info = await client.amodel_info()  # whichever weights an earlier case left loaded
            old = Path(info["model_path"]).name
            new, version = ("v1" if old == "v0" else "v0"), int(info["weight_version"]) + 1
            task = asyncio.create_task(client.agenerate(request("upd", prompt,
                                                                max_new_tokens=n, ignore_eos=True, seed=5)))
            k = await _await_progress(client, mode, task)
            await client.aupdate_weights(WeightVersion(version, "disk", str(world["root"] / new)))
            after = await client.amodel_info()
            await client.aresume()
            return k, await task, old, new, version, after

    k, resp, old, new, version, after = asyncio.run(go())
    assert after["weight_version"] == str(version) and Path(after["model_path"]).name == new
    assert 0 < k < n and resp.output_versions == [version - 1] * k + [version] * (n - k)
    lp = torch.tensor(resp.output_logprobs)
    before = teacher_forced(world["models"][old], prompt, resp.output_ids, 1.0)
    after = teacher_forced(world["models"][new], prompt, resp.output_ids, 1.0)
    assert (before[:k] - lp[:k]).abs().max() < 1e-4
    assert (after[k:] - lp[k:]).abs().max() < 1e-4
    assert (before[k:] - lp[k:]).abs().max() > 1e-2  # the new weights really score differently


def test_pause_abort_returns_partial_output(world):
    async def go():
        async with SGLangClient(world["plain"]) as client:
            task = asyncio.create_task(client.agenerate(request("ab", [2, 3], max_new_tokens=600, ignore_eos=True)))
            await _await_progress(client, "abort", task)
            partial = await asyncio.wait_for(task, 10)
            queued = asyncio.create_task(client.agenerate(request("after", [2, 3], max_new_tokens=4, ignore_eos=True)))
            await asyncio.sleep(0.2)
            assert not queued.done()  # paused: nothing runs until continue
            await client.aresume()
            return partial, await queued

    partial, after = asyncio.run(go())
    assert partial.finish_reason == "abort" and 0 < len(partial.output_ids) < 600
    assert len(partial.output_logprobs) == len(partial.output_versions) == len(partial.output_ids)
    assert after.finish_reason == "length" and len(after.output_ids) == 4


def test_bad_weights_give_400_naming_tensor_and_keep_version(world):
    async def go():
        async with SGLangClient(world["keyed"], api_key=KEY) as client:
            before = (await client.amodel_info())["weight_version"]
            with pytest.raises(EngineHTTPError) as err:
                await client.aupdate_weights(WeightVersion(version=99, weight_sync="shm",
                                                           location=str(world["root"] / "wide")))
            resp = await client.agenerate(request("still", [1, 2], max_new_tokens=3, ignore_eos=True))
            return before, err.value, resp

    before, err, resp = asyncio.run(go())
    assert err.status == 400 and "mlp." in err.body and "/update_weights_from_disk" in str(err)
    assert resp.weight_version == int(before) and len(resp.output_ids) == 3


def test_api_key_required_on_every_route(world):
    async def go():
        async with aiohttp.ClientSession() as s:
            codes = {}
            for route, auth in (("/health", None), ("/model_info", "Bearer wrong"), ("/health", f"Bearer {KEY}")):
                async with s.get(world["keyed"] + route, headers={"Authorization": auth} if auth else {}) as r:
                    codes[(route, auth)] = r.status
        async with SGLangClient(world["keyed"]) as client:  # no key
            with pytest.raises(EngineHTTPError) as err:
                await client.agenerate(request("nokey", [1], max_new_tokens=1))
        return codes, err.value

    codes, err = asyncio.run(go())
    assert list(codes.values()) == [401, 401, 200]
    assert err.status == 401


@pytest.mark.parametrize("route,body,field", [
    ("/generate", {}, "input_ids"),
    ("/generate", {"input_ids": "hello"}, "input_ids"),
    ("/generate", {"input_ids": [1, 500]}, "input_ids"),
    ("/generate", {"text": "hi"}, "text"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/update_weights_from_disk", {"weight_version": "1"}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/x", "weight_version": "v2"}, "weight_version"),
    ("/abort_request", {}, "rid"),
    ("/update_weights_from_distributed", {"names": []}, "dtypes"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float99"], "shapes": [[1]]}, "dtypes"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "1"}, "master_port"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": []}, "not supported on the embedded engine"),
])
def test_malformed_bodies_get_400_naming_the_field(world, route, body, field):
    async def go():
        async with SGLangClient(world["plain"], max_retries=0) as client:
            with pytest.raises(EngineHTTPError) as err:
                await client.arequest("POST", route, body)
            return err.value

    err = asyncio.run(go())
    assert err.status == 400 and field in err.body, err.body


def test_batched_input_health_info_and_invalid_json(world):
    async def go():
        async with SGLangClient(world["plain"]) as client:
            batch = await client.arequest("POST", "/generate", {
                "input_ids": [[1, 2], [3]], "rid": ["b0", "b1"], "return_logprob": True,
                "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True},
                                    {"max_new_tokens": 3, "ignore_eos": True}]})
            healthy = await client.ahealth()
            info = await client.amodel_info()
            await client.aflush_cache()
            await client.aabort_request(rid="nobody")
        async with aiohttp.ClientSession() as s:
            async with s.post(world["plain"] + "/generate", data=b"{not json") as r:
                bad = (r.status, await r.json())
        return batch, healthy, info, bad

    batch, healthy, info, bad = asyncio.run(go())
    assert [len(b["output_ids"]) for b in batch] == [2, 3] and [b["meta_info"]["id"] for b in batch] == ["b0", "b1"]
    assert healthy and info["architectures"] == ["Qwen3ForCausalLM"] and info["is_generation"]
    assert bad[0] == 400 and "not valid JSON" in bad[1]["error"]

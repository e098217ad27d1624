"""The distributed weight update end to end over gloo on 127.0.0.1: the learner's `WeightSender`
(rank 0, hosting each group's rendezvous) and a real `darl-engine` subprocess joining through
SGLang's routes. Checked: a version sent in two buckets is what the engine then serves (greedy
tokens and log-probs equal transformers' under the sent weights, version from weight_version);
a new group name for the same engine (its next life) replaces the old group; an unreachable
engine fails and gets a fallback HF folder that loads; the engine refuses what SGLang refuses
(unknown group, nccl on CPU) and an incomplete or non-finite version (old weights kept)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_darl.channel.ports import free_port
from megatron_darl.channel.process_group import init_custom_group
from megatron_darl.rollout import sglang_requests as rq
from megatron_darl.rollout.sglang_client import EngineHTTPError, SGLangClient
from megatron_darl.trainer.weight_sender import WeightSender
from megatron_darl.types import GenerateRequest, SamplingParams, WeightVersion
from tests.helpers.engines import asend_first_bucket_only, asession_answers, running_engines, save_wide, teacher_forced


def hf_buckets(folder) -> list[list[tuple[str, torch.Tensor]]]:
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    return [[(n, tensors[n]) for n in names[:half]], [(n, tensors[n]) for n in names[half:]]]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("wgroup")
    save_wide(root / "a", seed=1)
    model_b = save_wide(root / "b", seed=2)
    with running_engines([(root / "a", None)], root) as started:
        yield root, model_b, started[0][0]


def sender(root, notice="notice.json") -> WeightSender:
    config = json.loads((root / "b" / "config.json").read_text())
    return WeightSender(str(root / notice), "127.0.0.1", str(root / "fallback"), (config, [str(root / "b")]),
                        backend="gloo", timeout_s=20.0)


async def greedy(url: str, prompt: list[int]):
    async with SGLangClient(url) as c:
        out = await c.agenerate(GenerateRequest(prompt,
                                                SamplingParams(temperature=1.0, top_k=1, max_new_tokens=5), "g"))
        info = await c.amodel_info()
    return out, info


def test_a_version_broadcast_in_buckets_is_served_then_a_new_group_replaces_the_old(world):
    root, model_b, url = world
    s = sender(root)
    s._staged = (7, hf_buckets(root / "b"))
    try:
        result = s.serve({"id": "1", "engines": [{"index": 0, "url": url, "group": "darl-w0-0"}]})
        assert result == {"id": "1", "version": 7, "ok": [0], "failed": {}, "fallback": None}
        out, info = asyncio.run(greedy(url, [3, 4, 5]))
        assert out.output_versions == [7] * 5 and info["weight_version"] == "7"
        want = teacher_forced(model_b, [3, 4, 5], out.output_ids, 1.0)
        assert torch.allclose(torch.tensor(out.output_logprobs), want, atol=1e-4)
        # the engine came back (a new incarnation): a new group, the old one dropped on both sides
        s._staged = (8, hf_buckets(root / "b"))
        result = s.serve({"id": "2", "engines": [{"index": 0, "url": url, "group": "darl-w0-1"}]})
        assert result["ok"] == [0] and list(s._groups) == ["darl-w0-1"]
        assert asyncio.run(greedy(url, [3]))[1]["weight_version"] == "8"
    finally:
        s.close()


def test_an_unreachable_engine_gets_a_fallback_folder_that_loads(world):
    root, _, url = world
    s = sender(root)
    s._staged = (9, hf_buckets(root / "b"))
    try:
        dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        result = s.serve({"id": "3", "engines": [{"index": 1, "url": dead, "group": "darl-w1-0"}]})
        assert result["ok"] == [] and "Unreachable" in result["failed"][1] and s.failed == 1
        assert result["fallback"] == str(root / "fallback" / "v9")
        assert s.staged_folder(9) == result["fallback"] and s.staged_folder(8) is None  # the in-loop eval's folder

        async def load():
            async with SGLangClient(url) as c:
                await c.aupdate_weights(WeightVersion(9, "disk", result["fallback"]))
                return await c.amodel_info()

        assert asyncio.run(load())["weight_version"] == "9"
    finally:
        s.close()


def test_the_engine_refuses_unknown_groups_nccl_on_cpu_and_incomplete_or_nonfinite_versions(world):
    root, _, url = world

    async def post(route, body):
        async with SGLangClient(url, max_retries=0) as c:
            return await c.arequest("POST", route, body)

    async def unknown_group():
        async with SGLangClient(url, max_retries=0) as c:
            await c.abegin_weight_update()
            try:
                await c.arequest("POST", "/update_weights_from_distributed", {
                    "names": [], "dtypes": [], "shapes": [], "group_name": "nope", "weight_version": "3"})
            finally:
                await c.aend_weight_update()

    with pytest.raises(EngineHTTPError, match="not in") as err:
        asyncio.run(unknown_group())
    assert err.value.status == 400 and json.loads(err.value.body)["success"] is False
    with pytest.raises(EngineHTTPError, match="nccl needs the engine on a GPU"):
        asyncio.run(post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                        "rank_offset": 1, "world_size": 2, "backend": "nccl"}))
    before = asyncio.run(greedy(url, [3]))[1]["weight_version"]
    half, other = hf_buckets(root / "b")
    bad = [(n, t.clone()) for n, t in half]
    bad[0][1].view(-1)[0] = float("nan")
    cases = [([half], f"missing tensor {other[0][0]!r}"),  # half a model: the first tensor it lacks
             ([bad, other], f"tensor {bad[0][0]!r} has 1 non-finite value(s)")]  # a whole one with a NaN
    for buckets, reason in cases:
        s = sender(root)
        s._staged = (11, buckets)
        try:
            result = s.serve({"id": "4", "engines": [{"index": 0, "url": url, "group": "darl-w0-x"}]})
        finally:
            s.close()
        assert result["ok"] == [] and reason in result["failed"][0], (reason, result)
        assert asyncio.run(info(url))["weight_version"] == before  # old weights kept
    # the two-bucket version stopped after its first bucket: decoding waits for a whole version
    assert "not its last bucket" in asyncio.run(info(url))["weights_incomplete"]
    assert asyncio.run(load_disk(url, root / "b", 12))["weights_incomplete"] is None
    assert asyncio.run(greedy(url, [3]))[1]["weight_version"] == "12"


async def acall(url: str, method: str, route: str, body: dict | None = None):
    async with SGLangClient(url, max_retries=0) as c:
        return await c.arequest(method, route, body)


def info(url: str):
    return acall(url, "GET", "/get_server_info")


async def load_disk(url: str, folder, version: int) -> dict:
    async with SGLangClient(url) as c:
        await c.aupdate_weights(WeightVersion(version, "disk", str(folder)))
    return await info(url)


def test_the_engine_holds_the_release_session_rules(world):
    """Refused outside a session (before receiving anything), begin refused while one is open,
    end refused when none is: 400 with the release's messages (`rq`'s constants, which the
    conformance tests read back from the wheel)."""
    _, _, url = world
    refusals = asyncio.run(asession_answers(url))
    assert refusals == [
        ("/update_weights_from_distributed", 400, rq.session_required("/update_weights_from_distributed")),
        ("/end_weight_update", 400, rq.NO_SESSION_OPEN), ("/begin_weight_update", 200, "Success"),
        ("/begin_weight_update", 400, rq.SESSION_ALREADY_OPEN), ("/end_weight_update", 200, "Success"),
        ("/end_weight_update", 400, rq.NO_SESSION_OPEN)]
    with pytest.raises(EngineHTTPError, match="field 'selector'"):
        asyncio.run(acall(url, "POST", "/begin_weight_update", {"selector": "both"}))


def test_a_version_stopped_half_way_is_never_served_until_a_whole_one_loads(world):
    """The learner sends the first of two buckets and stops (the session ended, the last bucket
    never comes): SGLang would now serve a mix of versions. darl-engine holds decoding: 503 from
    /health_generate, a request sent after /continue_generation waits; once a whole version is
    loaded from disk, that request is answered with tokens of that version only, whose log-probs
    are the whole model's."""
    root, model_b, url = world
    first = hf_buckets(root / "b")[0]
    asyncio.run(load_disk(url, root / "a", 20))

    async def half_version():
        await asend_first_bucket_only(url, first, "half")
        async with SGLangClient(url, max_retries=0) as c:
            await c.aresume()
            healthy = await c.ahealth()
            asked = asyncio.create_task(greedy(url, [3, 4, 5]))
            await asyncio.sleep(1.5)
            waited = not asked.done()
            await load_disk(url, root / "b", 21)
            return healthy, waited, await asked

    healthy, waited, (out, _) = asyncio.run(half_version())
    assert not healthy and waited
    assert out.output_versions == [21] * 5
    want = teacher_forced(model_b, [3, 4, 5], out.output_ids, 1.0)
    assert torch.allclose(torch.tensor(out.output_logprobs), want, atol=1e-4)


def test_init_custom_group_times_out_instead_of_hanging():
    """Nobody joins rank 1: the rendezvous gives up after about `timeout_s`, saying so."""
    import time

    from torch.distributed import DistStoreError

    port = free_port("127.0.0.1")
    t0 = time.monotonic()
    with pytest.raises(DistStoreError, match=r"Timed out after \d+ seconds waiting for clients\. 1/2 clients joined"):
        init_custom_group("127.0.0.1", port, 2, "alone", 0, "gloo", timeout_s=2.0)
    elapsed = time.monotonic() - t0
    assert 1.5 <= elapsed < 10.0, elapsed  # the 2 s asked for (rounded up to whole seconds), not a hang


def test_the_sender_ignores_a_request_left_by_an_earlier_attempt_and_answers_new_ones(tmp_path):
    import time

    from megatron_darl.channel.json_files import read_json, write_json_atomic
    from megatron_darl.channel.weight_transfer import transfer_paths

    req_path, res_path = transfer_paths(str(tmp_path / "notice.json"))
    write_json_atomic(req_path, {"id": "old", "version": 3,
                                 "engines": [{"index": 0, "url": "http://x:1", "group": "g"}]})
    s = WeightSender(str(tmp_path / "notice.json"), "127.0.0.1", str(tmp_path / "fb"), ({}, []), poll_s=0.01)
    try:
        s.stage(5, [])
        time.sleep(0.3)
        assert read_json(res_path) is None  # the dead manager's request was not served
        write_json_atomic(req_path, {"id": "new", "version": 5, "engines": []})
        deadline = time.monotonic() + 10
        while read_json(res_path) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert read_json(res_path) == {"id": "new", "version": 5, "ok": [], "failed": {}, "fallback": None}
        assert s.drain(timeout_s=1)
    finally:
        s.close()

"""The SGLang client and the embedded engine checked against the pinned release's own source.

The release (requirements-sglang.txt's pin) is downloaded by `tests/sglang_release.py` (pip download,
cached under ~/.cache/megatron_darl/test_assets/; offline these tests skip saying so, unless
DARL_REQUIRE_NETWORK=1; any other failed download fails them). Checked:
- every body the client sends passes the release's /generate contract gate
  (`api_types.GenerateRequest.from_json_value`), builds its strict `SamplingParams` struct and
  passes `verify`, and fits the fields and annotations of `io_struct.py`'s request classes;
- every route the client calls exists with that HTTP method in `http_server.py`;
- every reply shape the release produces (normal, aborted while queued, aborted mid-decode,
  spans across a weight update), built with its own `weight_versions` functions and decoded
  by its own response contract, is parsed with the right per-token versions;
- the embedded engine accepts only what SGLang accepts, and answers in the release's shapes.
"""

from __future__ import annotations

import asyncio
import math
import re

import pytest
import tomllib

from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.engine import requests as er
from megatron_darl.rollout import sglang_requests as rq
from megatron_darl.rollout.sglang_client import SGLangClient
from megatron_darl.rollout.workflow import GroupWorkflow
from megatron_darl.types import GenerateRequest, SamplingParams, WeightVersion
from tests.helpers import REPO
from tests.helpers.sglang_release import require_release

VOCAB = 151_936


@pytest.fixture(scope="session")
def release():
    return require_release()


def sglang_accepts(release, body: dict) -> str | None:
    """None if SGLang would admit this /generate body; else its error text. The order is the
    release's: the contract gate, then `SamplingParams(**params)`, `normalize`, `verify`."""
    try:
        release.api.GenerateRequest.from_json_value(body)
        sp = release.SamplingParams(**(body.get("sampling_params") or {}))
        sp.normalize(None)  # the engine runs with --skip-tokenizer-init: ids in, ids out
        sp.verify(VOCAB)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def client_bodies() -> list[dict]:
    """What the rollout workflow, a partial-rollout continuation and darl-eval send."""
    wf = GroupWorkflow(RolloutConfig(temperature=0.7, top_p=0.95, top_k=20, max_new_tokens=64), scorer=None, seed=5)
    seeded = SamplingParams(**{**vars(wf.sampling), "seed": 2**31 - 2})
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=[151645, 151643])
    return [rq.generate_body(GenerateRequest(input_ids=[1, 2, 3], sampling=sp, rid=f"darl-{i}"))
            for i, sp in enumerate([wf.sampling, seeded, greedy, SamplingParams(ignore_eos=True, seed=0)])]


def test_the_pinned_release_is_the_one_checked_here(release):
    pins = (REPO / "requirements-sglang.txt").read_text()
    assert f"\nsglang=={release.version}\n" in pins, "requirements-sglang.txt pins the release these tests read"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for v in project["optional-dependencies"].values() for r in v]
    # sglang requires torch==2.14.1, this package torch==2.13.0: an extra with it cannot install
    assert not [r for r in reqs if r.lower().startswith("sglang")], reqs
    readme = (REPO / "README.md").read_text()
    assert f"sglang=={release.version}" in readme.replace("`", ""), "README names the pinned release"


@pytest.mark.parametrize("i", range(4))
def test_every_generate_body_is_admitted_by_the_release(release, i):
    body = client_bodies()[i]
    assert sglang_accepts(release, body) is None
    release.check_io_body("GenerateReqInput", body)
    # the seed travels under SGLang's name, so the request's randomness is really fixed
    if body["sampling_params"].get("sampling_seed") is not None:
        assert (release.SamplingParams(**body["sampling_params"]).sampling_seed
                == body["sampling_params"]["sampling_seed"])


def test_the_old_seed_key_is_what_the_release_refuses(release):
    """The check can fail: `seed` (what the client sent before) is rejected twice over."""
    body = client_bodies()[1]
    body["sampling_params"]["seed"] = body["sampling_params"].pop("sampling_seed")
    assert "unknown field `seed`" in sglang_accepts(release, {**body, "sampling_params": dict(body["sampling_params"])})
    with pytest.raises(TypeError, match="seed"):
        release.SamplingParams(**body["sampling_params"])


def test_control_bodies_fit_the_release_request_classes(release):
    release.check_io_body("PauseGenerationReqInput", rq.pause_body("retract"))
    release.check_io_body("ContinueGenerationReqInput", {})
    release.check_io_body("AbortReq", rq.abort_body("darl-3", False))
    release.check_io_body("AbortReq", rq.abort_body(None, True))
    release.check_io_body("UpdateWeightFromDiskReqInput", rq.update_from_disk_body("/shared/w/v3", 3))
    release.check_io_body("InitWeightsUpdateGroupReqInput", rq.init_group_body("10.0.0.1", 29500, 1, 3))
    release.check_io_body("UpdateWeightsFromDistributedReqInput",
                          rq.update_distributed_body(["a.weight"], ["bfloat16"], [[2, 3]], 4))
    with pytest.raises(AssertionError, match="no field"):  # the check can fail
        release.check_io_body("UpdateWeightFromDiskReqInput", {"model_path": "/w", "version": 3})
    with pytest.raises(AssertionError, match="does not fit"):
        release.check_io_body("UpdateWeightFromDiskReqInput", {"model_path": "/w", "weight_version": 3})


def test_every_route_the_client_calls_exists_with_that_method(release):
    calls: list[tuple[str, str]] = []

    async def record(self, method, route, body=None, **kw):
        calls.append((method, route))
        if route == "/generate":
            return {"text": "", "output_ids": [], "meta_info": {"id": "x", "finish_reason": {"type": "abort"}}}
        return {"success": True, "message": ""}

    async def drive(client: SGLangClient):
        req = GenerateRequest([1], SamplingParams(), "x")
        await client.agenerate(req)
        await client.apause("abort")
        await client.aresume()
        await client.aupdate_weights(WeightVersion(1, "disk", "/w/1"))
        await client.ahealth()
        await client.aabort_request("x")
        await client.amodel_info()
        await client.aflush_cache()
        await client.ainit_weights_update_group("h", 1, 1, 2)
        await client.abegin_weight_update()
        await client.aupdate_weights_from_distributed(["a"], ["float32"], [[1]], 2)
        await client.aend_weight_update()
        await client.adestroy_weights_update_group("g")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SGLangClient, "arequest", record)
        asyncio.run(drive(SGLangClient("http://127.0.0.1:1")))
    routes = release.routes
    assert len(calls) == 13
    for method, route in calls:
        assert method in routes.get(route, set()), f"{method} {route} is not a route of sglang {release.version}"
    assert "GET" not in routes["/pause_generation"]  # the check can fail


# ---- reply shapes, built by the release's own code -----------------------------------------

def release_reply(release, ids, lps, finish, events=(), current="3", prompt_tokens=3, queued_abort=False):
    """A /generate answer as the release's tokenizer manager writes it (return_logprob, no
    tokenizer): `_handle_batch_output`, or `_handle_abort_req` for a request aborted while
    queued (no prompt_tokens then). Spans come from its `compute_weight_version_spans` and
    `add_weight_versions_to_meta_info`; the result must decode under its response contract."""
    wv = release.weight_versions
    meta = {"id": "darl-1", "finish_reason": finish, "weight_version": current, "e2e_latency": 0.1}
    if not queued_abort:
        meta.update(prompt_tokens=prompt_tokens, num_retractions=0, reasoning_tokens=0, cached_tokens=0)
    events = [wv.WeightVersionEvent(old_version=v, num_output_tokens=n) for v, n in events]
    spans = wv.compute_weight_version_spans(events, current_version=current, num_output_tokens=len(ids))
    wv.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=len(ids))
    meta["input_token_logprobs"] = []
    meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids)]
    meta["output_token_logprobs_length"] = len(ids)
    meta["completion_tokens"] = len(ids)
    reply = {"text": "", "output_ids": list(ids), "meta_info": meta}
    release.api.GenerateResponse.from_json_value(reply)  # a shape the release really produces
    return reply


def test_a_normal_answer(release):
    reply = release_reply(release, [7, 8, 9], [-0.1, -0.2, -0.3], {"type": "length", "length": 3})
    resp = rq.parse_generate("darl-1", reply, default_version=0)
    assert (resp.output_ids, resp.output_logprobs, resp.output_versions) == ([7, 8, 9], [-0.1, -0.2, -0.3], [3, 3, 3])
    assert resp.finish_reason == "length" and resp.weight_version == 3
    stop = rq.parse_generate("darl-1", release_reply(release, [4], [-1.0], {"type": "stop", "matched": 4}), 0)
    assert stop.finish_reason == "stop"


def test_a_request_aborted_while_queued(release):
    reply = release_reply(release, [], [], {"type": "abort", "message": "Abort in waiting queue"}, queued_abort=True)
    assert reply["meta_info"]["weight_versions"] == [{"version": "3", "start": 0, "end": 0}]
    resp = rq.parse_generate("darl-1", reply, default_version=0)
    assert resp.output_ids == [] and resp.output_logprobs == [] and resp.output_versions == []
    assert resp.finish_reason == "abort"


def test_a_request_aborted_mid_decode_keeps_its_partial_output(release):
    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    reply = release_reply(release, [5, 6], [-0.5, -0.25], finish)
    resp = rq.parse_generate("darl-1", reply, default_version=0)
    assert resp.output_ids == [5, 6] and resp.output_logprobs == [-0.5, -0.25] and resp.finish_reason == "abort"


def test_spans_give_per_token_versions_across_weight_updates(release):
    """retract / in_place: the request continued under new weights; the release records one
    event per update and writes one span per version."""
    ids = [11, 12, 13, 14, 15, 16]
    reply = release_reply(release, ids, [-0.1] * 6, {"type": "length", "length": 6},
                          events=[("3", 2), ("4", 5)], current="5")
    assert [s["version"] for s in reply["meta_info"]["weight_versions"]] == ["3", "4", "5"]
    resp = rq.parse_generate("darl-1", reply, default_version=0)
    assert resp.output_versions == [3, 3, 4, 4, 4, 5] and resp.weight_version == 5
    before_any = release_reply(release, [1, 2], [-0.1, -0.1], {"type": "length", "length": 2}, current="default")
    assert rq.parse_generate("darl-1", before_any, default_version=7).output_versions == [7, 7]


# ---- the embedded engine: accepts only what SGLang accepts, answers in its shapes -------------

def test_the_engine_knows_exactly_the_release_sampling_fields(release):
    assert set(er.SGLANG_SAMPLING_FIELDS) == set(release.api._FIELDS_SamplingParams)


HOSTILE = [
    {"sampling_seed": 2**64}, {"sampling_seed": -(2**63) - 1}, {"sampling_seed": 1.5}, {"sampling_seed": True},
    {"seed": 3}, {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": -1.0},
    {"temperature": "hot"}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": math.nan}, {"top_k": 0}, {"top_k": -2},
    {"top_k": 2.0}, {"max_new_tokens": -1}, {"max_new_tokens": True}, {"stop_token_ids": [1.5]},
    {"stop_token_ids": "x"}, {"ignore_eos": 1}, {"n": 2}, {"min_p": 0.5}, {"stop": ["</s>"]}, {"regex": "a+"},
    {"frequency_penalty": 1.0}, {"logit_bias": {"5": 1.0}}, {"no_such_field": 1},
]
FINE = [{}, {"temperature": 0.0}, {"temperature": 1.3, "top_p": 0.9, "top_k": 40}, {"sampling_seed": 2**63 - 1},
        {"sampling_seed": -(2**63)}, {"top_k": -1, "ignore_eos": True, "stop_token_ids": [0, 5]},
        {"n": 1, "min_p": 0.0, "skip_special_tokens": False, "stop": None}, {"max_new_tokens": 1}]


@pytest.mark.parametrize("params", HOSTILE + FINE, ids=lambda p: repr(p)[:40])
def test_the_engine_admits_nothing_sglang_refuses(release, params):
    """What the embedded engine accepts, SGLang accepts: no test can pass on ours and fail on
    SGLang. (It refuses more: fields it cannot honour, max_new_tokens=0.)"""
    body = {"input_ids": [1, 2], "sampling_params": params, "return_logprob": True, "rid": "r"}
    try:
        er.parse_generate(body, VOCAB)
    except er.BadRequest as exc:
        key = re.search(r"field '([^']*)'", str(exc))
        assert key is not None, f"the 400 names the field: {exc}"
        return
    assert sglang_accepts(release, body) is None, f"ours accepted {params}, sglang {release.version} refuses it"
    assert params in FINE, f"{params} was expected to be refused"


def test_engine_answers_have_the_release_shape_and_spans(release):
    wv = release.weight_versions
    versions = [3, 3, 4, 4, 4, 5]
    ours = er.response_json("r", [11, 12, 13, 14, 15, 16], [-0.1] * 6, versions, {"type": "length", "length": 6},
                            prompt_len=3, latency_s=0.2, current_version=5)
    release.api.GenerateResponse.from_json_value(ours)
    events = [wv.WeightVersionEvent(old_version="3", num_output_tokens=2),
              wv.WeightVersionEvent(old_version="4", num_output_tokens=5)]
    theirs: dict = {}
    wv.add_weight_versions_to_meta_info(theirs, wv.compute_weight_version_spans(events, "5", 6), 6)
    assert ours["meta_info"]["weight_versions"] == theirs["weight_versions"]
    assert ours["meta_info"]["weight_version"] == theirs["weight_version"]
    queued = er.response_json("r", [], [], [], {"type": "abort", "message": "paused"}, 3, 0.0, current_version=4)
    release.api.GenerateResponse.from_json_value(queued)
    empty: dict = {}
    wv.add_weight_versions_to_meta_info(empty, wv.compute_weight_version_spans([], "4", 0), 0)
    assert queued["meta_info"]["weight_versions"] == empty["weight_versions"]
    assert set(release.api.FinishAbort.__struct_fields__) <= set(queued["meta_info"]["finish_reason"])


# ---- the distributed weight update (rollout.weight_sync=distributed) ----------------------

def test_distributed_update_bodies_fit_the_release_request_classes(release):
    """Every body the learner's sender posts, as it posts them: the join, a bucket before the
    last (no version, no cache flush), the last bucket, the leave."""
    import torch

    from megatron_darl.learner.weights import describe

    bucket = [("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.zeros(3, 4, dtype=torch.bfloat16))]
    meta = describe(bucket)
    assert meta == {"names": ["model.norm.weight", "lm_head.weight"], "dtypes": ["float32", "bfloat16"],
                    "shapes": [[4], [3, 4]]}
    release.check_io_body("InitWeightsUpdateGroupReqInput",
                          rq.init_group_body("10.0.0.1", 29500, 1, 3, "darl-w0-0", "gloo"))
    first = rq.update_distributed_body(**meta, version=None, group_name="darl-w0-0", flush_cache=False)
    last = rq.update_distributed_body(**meta, version=7, group_name="darl-w0-0")
    for body in (first, last):
        release.check_io_body("UpdateWeightsFromDistributedReqInput", body)
    assert first["weight_version"] is None and last["weight_version"] == "7" and last["abort_all_requests"] is False
    release.check_io_body("DestroyWeightsUpdateGroupReqInput", rq.destroy_group_body("darl-w0-0"))
    for dtype in meta["dtypes"]:  # SGLang's receiver does getattr(torch, dtype)
        assert isinstance(getattr(torch, dtype), torch.dtype)
    with pytest.raises(AssertionError):  # the check can fail: world_size is required
        release.check_io_body("InitWeightsUpdateGroupReqInput", {"master_address": "h", "master_port": 1,
                                                                 "rank_offset": 1})


def test_the_distributed_routes_answer_as_the_release_does(release):
    """The three routes exist as POST in the release, and the release answers them with
    {"success", "message"}, 200 on success and 400 on failure: the shape darl-engine and the
    stand-in answer (test_weight_group.py checks darl-engine's bodies)."""
    routes = release.routes
    for route in ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"):
        assert "POST" in routes[route]
        src = release.source("sglang/srt/entrypoints/http_server.py")
        handler = src[src.index(f'@app.post("{route}")'):][:1200]
        assert '{"success": success, "message": message}' in handler and "BAD_REQUEST" in handler
    for name in ("InitWeightsUpdateGroupReqOutput", "UpdateWeightsFromDistributedReqOutput",
                 "DestroyWeightsUpdateGroupReqOutput"):
        assert set(release.io_fields(name)) - set(release.io_fields("BaseReq")) == {"success", "message"}

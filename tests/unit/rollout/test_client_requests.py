"""SGLang request bodies and response parsing, without a server: the bodies carry what SGLang's
routes read, answers are tagged token by token from their weight_versions spans (or their one
weight_version), and malformed answers fail naming the field. The same checks against the
pinned release's own classes are in test_sglang_conformance.py."""

from __future__ import annotations

import asyncio

import pytest

from megatron_darl.rollout import sglang_requests as rq
from megatron_darl.rollout.api import RolloutEngine
from megatron_darl.rollout.sglang_client import SGLangClient
from megatron_darl.types import GenerateRequest, SamplingParams, WeightVersion


def sglang_answer(ids, version="3", reason=None, **meta):
    """What SGLang 0.5's /generate returns with return_logprob and no tokenizer."""
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "id": "r",
            "finish_reason": reason or {"type": "length", "length": len(ids)},
            "prompt_tokens": 3,
            "completion_tokens": len(ids),
            "weight_version": version,
            "output_token_logprobs": [[-0.5 * (i + 1), t, None] for i, t in enumerate(ids)],
            **meta,
        },
    }


def test_generate_body_has_sglang_fields():
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=7, stop_token_ids=[2], ignore_eos=True,
                        seed=11)
    body = rq.generate_body(GenerateRequest(input_ids=[5, 6], sampling=sp, rid="x"))
    assert body["input_ids"] == [5, 6] and body["rid"] == "x" and body["return_logprob"] is True
    assert body["sampling_params"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7,
                                       "stop_token_ids": [2], "ignore_eos": True, "sampling_seed": 11}
    with pytest.raises(ValueError, match="input_ids is empty"):
        rq.generate_body(GenerateRequest(input_ids=[], sampling=sp, rid="e"))


def test_sglang_answer_tags_every_token_with_the_request_version():
    resp = rq.parse_generate("r", sglang_answer([7, 8, 9]), default_version=0)
    assert resp.output_ids == [7, 8, 9] and resp.output_logprobs == [-0.5, -1.0, -1.5]
    assert resp.output_versions == [3, 3, 3] and resp.weight_version == 3 and resp.finish_reason == "length"
    default = rq.parse_generate("r", sglang_answer([7], version="default"), default_version=4)
    assert default.output_versions == [4]  # SGLang's version before any update


def test_per_token_versions_and_finish_reasons():
    spans = [{"version": "0", "start": 0, "end": 1}, {"version": "1", "start": 1, "end": 3}]
    resp = rq.parse_generate("r", sglang_answer([1, 2, 5], weight_versions=spans,
                                                reason={"type": "abort", "message": "paused"}), 0)
    assert resp.output_versions == [0, 1, 1] and resp.finish_reason == "abort"
    stop = rq.parse_generate("r", sglang_answer([1], reason={"type": "stop", "matched": 1}), 0)
    assert stop.finish_reason == "stop"


@pytest.mark.parametrize("mutate,field", [
    (lambda a: a["meta_info"].pop("output_token_logprobs"), "output_token_logprobs"),
    (lambda a: a["meta_info"]["output_token_logprobs"].__setitem__(0, [-1.0, 99, None]), "output_token_logprobs"),
    (lambda a: a["meta_info"]["output_token_logprobs"].__setitem__(1, [float("nan"), 2, None]),
     "output_token_logprobs"),
    (lambda a: a["meta_info"].__setitem__("weight_versions", [{"version": "1", "start": 0, "end": 1}]),
     "weight_versions cover 1 tokens"),
    (lambda a: a["meta_info"].__setitem__("weight_versions", [{"version": "1", "start": 0, "end": 1},
                                                            {"version": "2", "start": 0, "end": 2}]),
     "weight_versions"),
    (lambda a: a["meta_info"].__setitem__("finish_reason", {"type": "weird"}), "finish_reason"),
    (lambda a: a.pop("output_ids"), "output_ids"),
])
def test_malformed_answers_name_the_field(mutate, field):
    answer = sglang_answer([1, 2])
    mutate(answer)
    with pytest.raises(rq.ResponseFormatError, match=field):
        rq.parse_generate("r", answer, 0)


def test_control_bodies():
    assert rq.pause_body("retract") == {"mode": "retract"}
    with pytest.raises(ValueError, match="sideways"):
        rq.pause_body("sideways")
    assert rq.abort_body(None, True) == {"rid": "", "abort_all": True}
    with pytest.raises(ValueError):
        rq.abort_body(None, False)
    assert rq.update_from_disk_body("/dev/shm/w", 5)["weight_version"] == "5"
    body = rq.update_distributed_body(["a", "b"], ["bfloat16", "float32"], [(2, 3), (4,)], 6)
    assert body["shapes"] == [[2, 3], [4]] and body["group_name"] == "weight_update_group"
    with pytest.raises(ValueError, match="2 names, 1 dtypes"):
        rq.update_distributed_body(["a", "b"], ["float32"], [[1], [2]], 1)
    assert rq.init_group_body("10.0.0.1", 29500, 1, 3)["backend"] == "nccl"
    assert rq.check_success("/x", {"success": True, "message": ""})["success"]
    with pytest.raises(rq.UpdateFailedError, match="bad shape"):
        rq.check_success("/x", {"success": False, "message": "bad shape"})


def test_client_is_a_rollout_engine_and_refuses_a_broadcast_version_through_the_folder_route():
    client = SGLangClient("http://127.0.0.1:1/")
    assert isinstance(client, RolloutEngine) and client.url == "http://127.0.0.1:1"
    with pytest.raises(ValueError, match="aupdate_weights_from_distributed"):
        asyncio.run(client.aupdate_weights(WeightVersion(1, "distributed", "127.0.0.1#v1")))


def test_client_from_rollout_config():
    from megatron_darl.config.rollout import RolloutConfig

    client = SGLangClient.from_config("http://h:1", RolloutConfig(api_key="k", request_timeout_s=9.0, max_retries=1))
    assert (client.api_key, client.timeout_s, client.max_retries) == ("k", 9.0, 1)

"""Workflow pieces: a sample's token bookkeeping across requests, the episode JSON round trip,
and GroupWorkflow's group assembly, seeds and DAPO filter."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import pytest

from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout.workflow import Episode, GroupWorkflow, SampleState
from megatron_darl.types import GenerateResponse, SamplingParams


def resp(ids, version, reason, rid="r"):
    return GenerateResponse(rid, list(ids), [-0.5] * len(ids), [version] * len(ids), reason, version)


def test_absorb_keeps_partial_tokens_with_their_versions():
    s = SampleState([1, 2], max_new_tokens=6, seed=11)
    s.absorb(resp([7, 8], 0, "abort"), keep_partial=True)
    assert not s.done and s.remaining == 4 and s.next_input_ids() == [1, 2, 7, 8]
    seed_after_first = s.next_seed()
    s.absorb(resp([9, 10, 11], 1, "stop"), keep_partial=True)
    assert s.done and s.finish_reason == "stop"
    assert s.output_ids == [7, 8, 9, 10, 11] and s.versions == [0, 0, 1, 1, 1] and s.segments == 2
    assert seed_after_first != 11, "a continuation must not replay the first segment's random stream"


def test_absorb_discards_partial_when_not_kept_and_length_at_budget():
    s = SampleState([1], max_new_tokens=3)
    s.absorb(resp([4, 5], 0, "abort"), keep_partial=False)
    assert s.output_ids == [] and s.restarts == 1 and not s.done
    s.absorb(resp([4, 5, 6], 1, "abort"), keep_partial=True)  # aborted exactly at the budget
    assert s.done and s.finish_reason == "length" and s.versions == [1, 1, 1]


def test_absorb_rejects_malformed_responses():
    s = SampleState([1], max_new_tokens=3)
    bad = GenerateResponse("r9", [1, 2], [-0.1], [0, 0], "stop", 0)
    with pytest.raises(ValueError, match="r9: 2 output_ids but 1 logprobs"):
        s.absorb(bad, keep_partial=True)
    with pytest.raises(ValueError, match="exceed"):
        s.absorb(resp([1, 2, 3, 4], 0, "length"), keep_partial=True)
    assert s.output_ids == []


def test_episode_json_round_trip():
    s = SampleState([1, 2], 5, seed=3, output_ids=[9], logprobs=[-0.25], versions=[2], segments=1)
    ep = Episode(42, [1, 2], "math", {"answer": "3"}, [s, SampleState([1, 2], 5)], question="1+2?",
                 metadata={"k": 1}, attempts=1)
    back = Episode.from_json(json.loads(json.dumps(ep.to_json())))
    assert back == ep
    with pytest.raises(ValueError, match="bad episode"):
        Episode.from_json({"uid": 1})


@dataclass
class P:
    uid: object
    input_ids: list
    task: str = "math"
    answer: dict = field(default_factory=lambda: {"answer": "1"})
    question: str = "q"


class ScriptedClient:
    """Finishes each sample with tokens derived from its seed; records the sampling used."""

    def __init__(self):
        self.sampling: list[SamplingParams] = []

    async def agenerate_sample(self, sample, sampling):
        self.sampling.append(sampling)
        sample.absorb(resp([sample.seed % 50 + 1] * sample.max_new_tokens, 3, "length"), keep_partial=True)


class ConstScorer:
    def __init__(self, values):
        self.values = values

    async def ascore(self, episode):
        return list(self.values)


def test_group_workflow_builds_one_group_per_prompt():
    cfg = RolloutConfig(group_size=3, max_new_tokens=4, temperature=0.7, top_p=0.9)
    wf = GroupWorkflow(cfg, ConstScorer([1.0, 0.0, 0.5]), seed=5)
    ep = wf.new_episode(P(17, [3, 4]))
    client = ScriptedClient()
    trajs = asyncio.run(wf.arun_episode(client, ep))
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.5]
    assert {t.group_id for t in trajs} == {17} and {t.prompt_id for t in trajs} == {17}
    assert len({s.seed for s in ep.samples}) == 3, "G samples of one prompt need distinct seeds"
    assert all(t.prompt_ids.tolist() == [3, 4] and len(t.response_ids) == 4 for t in trajs)
    assert all(t.behav_versions.tolist() == [3] * 4 and t.metadata["task"] == "math" for t in trajs)
    assert all(sp.temperature == 0.7 and sp.top_p == 0.9 for sp in client.sampling)
    assert wf.new_episode(P(17, [3, 4])).samples[1].seed == ep.samples[1].seed  # reproducible


def test_group_workflow_dapo_filter_and_scorer_shape():
    cfg = RolloutConfig(group_size=2, max_new_tokens=2, filter_equal_rewards=True)
    assert asyncio.run(GroupWorkflow(cfg, ConstScorer([1.0, 1.0])).arun_episode(
        ScriptedClient(), GroupWorkflow(cfg, None, seed=1).new_episode(P(1, [2])))) is None
    kept = asyncio.run(GroupWorkflow(cfg, ConstScorer([1.0, 0.0]), seed=1).arun_episode(
        ScriptedClient(), GroupWorkflow(cfg, None, seed=1).new_episode(P(1, [2]))))
    assert kept is not None and len(kept) == 2
    with pytest.raises(ValueError, match="scorer returned 1 rewards for 2 samples"):
        asyncio.run(GroupWorkflow(cfg, ConstScorer([1.0]), seed=1).arun_episode(
            ScriptedClient(), GroupWorkflow(cfg, None, seed=1).new_episode(P(1, [2]))))


def test_new_episode_rejects_bad_prompts():
    wf = GroupWorkflow(RolloutConfig(group_size=2), ConstScorer([0, 0]))
    with pytest.raises(ValueError, match="uid 'abc' is not an integer"):
        wf.new_episode(P("abc", [1]))
    with pytest.raises(ValueError, match="uid=3: empty input_ids"):
        wf.new_episode(P(3, []))

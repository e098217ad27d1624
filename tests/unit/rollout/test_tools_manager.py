"""Tool episodes through the rollout manager, against in-process fake engines and a slow fake
tool: calls run off the event loop (engines keep generating other episodes meanwhile), the
manager stops while calls are in flight, its state holds them pending with their turns, and a new
manager resumes them: every prompt written exactly once, each pending call run again and counted
(`tool_reruns`), the tool counters carried over."""

from __future__ import annotations

import asyncio
import json

import pytest

from megatron_darl.rollout.manager import RolloutManager
from megatron_darl.rollout.tools import ToolFormat, ToolResult
from megatron_darl.rollout.workflow import GroupWorkflow
from tests.helpers.rollout_fakes import ParityScorer, make

START, END, OPEN, CLOSE = 49, 50, 51, 52
TAG_IDS = {"<tool_call>": START, "</tool_call>": END, "<tool_response>": OPEN, "</tool_response>": CLOSE}


class IdTokenizer:
    """The four tags are single ids of the fake engines' vocabulary; other characters map to 60..89."""

    def encode(self, text, add_special_tokens=False):
        if text in TAG_IDS:
            return [TAG_IDS[text]]
        return [60 + ord(c) % 30 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(48 + t % 10) for t in ids)


class SlowTool:
    """ToolRunner's interface: every call takes `delay_s` of wall time and answers "7"."""

    def __init__(self, cfg, delay_s: float) -> None:
        self.format = ToolFormat(cfg, IdTokenizer())
        self.delay_s, self.counts, self.running = delay_s, {}, 0
        self.engine_busy_during: list[int] = []
        self.engines: list = []

    async def arun_turn(self, turn_ids):
        self.counts["tool_calls"] += 1
        self.running += 1
        try:
            await asyncio.sleep(self.delay_s / 2)
            self.engine_busy_during.append(sum(e.active for e in self.engines))
            await asyncio.sleep(self.delay_s / 2)
        finally:
            self.running -= 1
        return ToolResult("ok", "7", self.delay_s)


def tool_setup(n_prompts=10, delay_s=0.2):
    cfg, engines, prompts, sink, _ = make(n_prompts=n_prompts, max_new_tokens=60, tool="python", max_turns=3,
                                          step_s=0.002)
    tool = SlowTool(cfg, delay_s)
    tool.engines = engines
    return cfg, engines, prompts, sink, GroupWorkflow(cfg, ParityScorer(), seed=7, tools=tool), tool


@pytest.mark.timeout(60)
def test_slow_calls_leave_the_engines_to_other_episodes():
    cfg, engines, prompts, sink, wf, tool = tool_setup(n_prompts=12, delay_s=0.3)

    async def go():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink)
        await mgr.arun()
        return mgr.metrics()

    m = asyncio.run(go())
    assert sorted(sink.uids) == [p.uid for p in prompts.items]
    assert m["rollout/tool_calls"] > 0 and m["rollout/turns_per_sample"] > 1.0, m
    assert max(tool.engine_busy_during) > 0, "engines generated other episodes while calls ran"
    for g in sink.groups:
        for t in g:
            mask = t.policy_mask.tolist()
            for i, mk in enumerate(mask):  # an answer starts right after a call's closing token
                if mk == 0 and (i == 0 or mask[i - 1] == 1):
                    assert t.response_ids[i - 1] == END and t.response_ids[i] == OPEN


@pytest.mark.timeout(60)
def test_a_stop_during_calls_resumes_them_and_loses_no_prompt():
    cfg, engines, prompts, sink, wf, tool = tool_setup(delay_s=5.0)  # calls outlast the first manager

    async def first():
        mgr = RolloutManager(cfg, engines, prompts, wf, sink)
        await mgr.astart()
        for _ in range(500):
            await asyncio.sleep(0.01)
            if tool.running >= 2:
                break
        await mgr.astop()
        return json.loads(json.dumps(mgr.state_dict())), mgr.metrics()

    state, m1 = asyncio.run(first())
    pending = [s for e in state["episodes"] for s in e["samples"] if s["tool_pending"]]
    assert len(pending) >= 2 and all(s["tool_started"] == s["tool_calls"] + 1 for s in pending)
    assert all(s["output_ids"][-1] == END and s["policy_mask"][-1] == 1 for s in pending)
    assert state["counters"]["tool_calls"] == m1["rollout/tool_calls"] >= 2

    cfg2, engines2, prompts2, sink2, wf2, tool2 = tool_setup(delay_s=0.01)

    async def second():
        mgr = RolloutManager(cfg2, engines2, prompts2, wf2, sink2)
        mgr.load_state_dict(state)
        await asyncio.wait_for(mgr.arun(), 30)
        return mgr.metrics()

    m2 = asyncio.run(second())
    assert sorted(sink.uids + sink2.uids) == [p.uid for p in prompts.items]
    assert m2["rollout/tool_reruns"] == len(pending)
    assert m2["rollout/tool_calls"] >= m1["rollout/tool_calls"] + len(pending), "counters carry over"
    resumed = {e["uid"]: e for e in state["episodes"]}
    for g in sink2.groups:
        if g[0].group_id not in resumed:
            continue
        for t, saved in zip(g, resumed[g[0].group_id]["samples"]):
            n = len(saved["output_ids"])
            assert t.response_ids.tolist()[:n] == saved["output_ids"]  # turns kept, nothing re-generated
            assert t.policy_mask.tolist()[:n] == saved["policy_mask"]

"""Multi-turn rollouts with the real pieces: a `darl-engine` process on 127.0.0.1 (a tiny random
Qwen3), the real rollout manager, shared-memory ring and staleness gate, and the real code
sandbox answering the calls. A weight update lands while episodes are in flight. Every policy
token's behavior log-prob is recomputed by the Hugging Face model of its version on the ids the
trajectory holds (prompt, policy turns and tool tokens): equal, so the engine generated each turn
from exactly the ids the learner trains, tool tokens included, with no re-tokenization."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from megatron_darl.channel.shm_ring import ShmRing
from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout.manager import RolloutManager
from megatron_darl.rollout.manager_process import EmbeddedEngineRestarter, RingSink
from megatron_darl.rollout.staleness import StalenessGate
from megatron_darl.rollout.tools import ToolFormat, ToolRunner
from megatron_darl.rollout.workflow import Episode, GroupWorkflow
from megatron_darl.types import WeightVersion, group_trajectories
from tests.helpers.engines import save_tiny
from tests.helpers.rollout_fakes import ScriptedPrompts
from tests.helpers.sandbox import needs_sandbox

VOCAB = 128
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # ids 0..3
UNK, NEWLINE = 4, 5  # then printable ASCII 32..126 at 6..100


class SmallTokenizer:
    """Every text encodes (unknown characters to UNK), so any program output can be answered."""

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in TAGS if text.startswith(t, i)), None)
            if tag:
                ids.append(TAGS.index(tag))
                i += len(tag)
                continue
            c = text[i]
            ids.append(NEWLINE if c == "\n" else 6 + ord(c) - 32 if 32 <= ord(c) <= 126 else UNK)
            i += 1
        return ids

    def decode(self, ids, skip_special_tokens=False):
        out = []
        for t in ids:
            if t < 4:
                out.append("" if skip_special_tokens else TAGS[t])
            elif t == NEWLINE:
                out.append("\n")
            elif 6 <= t <= 100:
                out.append(chr(t - 6 + 32))
            else:
                out.append("?")
        return "".join(out)


class Parity:
    async def ascore(self, episode: Episode) -> list[float]:
        return [float(len(s.turn_ids()) % 2) for s in episode.samples]


def tool_segments(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate([*mask, 1]):
        if m == 0 and start is None:
            start = i
        elif m == 1 and start is not None:
            spans.append((start, i))
            start = None
    return spans


@needs_sandbox
@pytest.mark.timeout(280)
def test_tool_episodes_through_a_real_engine_train_exactly_the_ids_it_saw(tmp_path):
    models = [save_tiny(tmp_path / f"v{v}", v, vocab_size=VOCAB, eos_token_id=VOCAB - 1) for v in (0, 1)]
    cfg = RolloutConfig(group_size=4, max_new_tokens=200, max_concurrent_per_engine=16, request_timeout_s=30.0,
                        tool="python", max_turns=4, tool_max_output_tokens=12, tool_wall_s=5.0)
    runner = ToolRunner(cfg, ToolFormat(cfg, SmallTokenizer()))
    prompts = ScriptedPrompts(8, start=500, tokens=lambda i: [10 + i, 0, 20 + i, 30], task="custom")
    gate = StalenessGate(max_head_offpolicyness=1, batch_size=4)
    name = f"darl-test-{uuid.uuid4().hex[:8]}"
    ring = ShmRing.create(name, 1 << 21, directory=str(tmp_path))
    producer = ShmRing.attach(name, directory=str(tmp_path))
    restarter = EmbeddedEngineRestarter(str(tmp_path / "v0"), startup_timeout_s=90, request_timeout_s=30,
                                        log_dir=str(tmp_path))
    sink = RingSink(producer)

    async def main():
        engine = await restarter.astart_engine(0)
        mgr = RolloutManager(cfg, [engine], prompts, GroupWorkflow(cfg, Parity(), seed=5, tools=runner), sink, gate)
        try:
            await mgr.astart()
            for _ in range(1000):  # some calls answered before the update
                await asyncio.sleep(0.02)
                if runner.counts["tool_calls"] >= 2:
                    break
            await mgr.aupdate_weights(WeightVersion(1, "disk", str(tmp_path / "v1")))
            await asyncio.wait_for(mgr.await_groups(len(prompts.items)), 200)
            await mgr.astop()
            return mgr.metrics()
        finally:
            await engine.aclose()
            await restarter.aclose()
            runner.close()

    try:
        m = asyncio.run(main())
        sink.close()
        trajs = []
        while (t := ring.get_trajectory(timeout=0.0)) is not None:
            trajs.append(t)
    finally:
        producer.close()
        ring.unlink()
    assert sorted(group_trajectories(trajs)) == [p.uid for p in prompts.items]
    with_tools = [t for t in trajs if (t.policy_mask == 0).any()]
    assert with_tools, f"no sample called the tool: {m}"
    assert m["rollout/tool_calls"] >= len(with_tools) and m["rollout/turns_per_sample"] > 1.0
    spanning = [t for t in with_tools if set(t.behav_versions[t.policy_mask > 0].tolist()) == {0, 1}]
    assert spanning, f"no episode with a tool call continued under the new weights: {m}"
    for t in trajs:
        mask, ids = t.policy_mask.tolist(), t.response_ids.tolist()
        for a, b in tool_segments(mask):  # each answer follows a call's closing token, in the template
            assert ids[a - 1] == 1 and ids[a] == 2 and ids[b - 1] == 3
            assert (t.behav_logprobs[a:b] == 0).all() and (t.behav_versions[a:b] == -1).all()
        full = t.prompt_ids.tolist() + ids
        policy = [i for i, mk in enumerate(mask) if mk]
        for v, model in enumerate(models):
            at = [i for i in policy if t.behav_versions[i] == v]
            if not at:
                continue
            with torch.no_grad():
                logits = model(torch.tensor([full])).logits[0].double()
            logp = torch.log_softmax(logits[len(t.prompt_ids) - 1: -1], dim=-1)
            ref = logp[at, torch.tensor([ids[i] for i in at])].numpy()
            assert abs(ref - t.behav_logprobs[at]).max() < 1e-4, (t.prompt_id, v)

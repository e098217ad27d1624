"""The turns of one sample: generate, and where a turn ends on a tool call, answer it and go on.

What it is: `TurnLoop.arun(client, sample, sampling)`, shared by training rollouts
(`workflow.GroupWorkflow`) and evaluation (`eval/scoring.py`): without tools, one request per
sample (continued after aborts by the client); with a `ToolRunner` (rollout.tool), a turn that
stops on the call's closing token is answered with the tool's tokens (`SampleState.add_tool_output`:
policy_mask 0, log-prob 0.0, version -1) and the next turn continues from the ids the engine saw,
up to `rollout.max_turns` turns within the sample's one budget (`rollout.max_new_tokens`, tool
tokens included). A call pending when the manager stopped (`SampleState.tool_pending`, saved
in its state) runs again on resume, counted as `tool_reruns`. `counts` is what it counts
(`rollout/<name>`): samples, turns and tool tokens over finished samples, and the runner's counters.
What it is not: the call's syntax or its execution (`tools.py`), dispatch to engines (the client).
"""

from __future__ import annotations

import collections
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout.tools import TOOL_COUNTERS, ToolRunner
from megatron_darl.types import SamplingParams

if TYPE_CHECKING:
    from megatron_darl.rollout.workflow import SampleClient, SampleState

# counted over finished samples: samples, their turns (1 + tool calls) and tool-output tokens
SAMPLE_COUNTERS = ("samples_scored", "turns", "tool_tokens")


class TurnLoop:
    """Runs samples turn by turn; `tools` None: a sample is one response."""

    def __init__(self, config: RolloutConfig, tools: ToolRunner | None = None) -> None:
        self.max_turns = int(config.max_turns)
        self.tools = tools
        names = SAMPLE_COUNTERS + (TOOL_COUNTERS if tools is not None else ())
        self.counts: collections.Counter[str] = collections.Counter({k: 0 for k in names})
        if tools is not None:
            tools.counts = self.counts  # one set of counters, the runner's included

    def stop_token_ids(self) -> list[int]:
        """What a turn stops on besides the model's EOS: the call's closing token."""
        return [self.tools.format.end_id] if self.tools is not None else []

    def load_counts(self, saved: dict[str, float]) -> None:
        for k in self.counts:
            self.counts[k] = saved.get(k, 0)

    async def arun(self, client: SampleClient, s: SampleState, sampling: SamplingParams) -> None:
        """Generate turns until `s` is done, answering each tool call in between."""
        while True:
            if s.tool_pending:
                await self._aanswer(s)
                if s.done:
                    return
            await client.agenerate_sample(s, replace(sampling))
            if not self._calls_tool(s):
                return

    def _calls_tool(self, s: SampleState) -> bool:
        """Whether the turn just ended on a call to answer (then the sample is not done)."""
        tools = self.tools
        if tools is None or s.finish_reason != "stop" or not s.output_ids or s.policy_mask[-1] != 1 \
                or s.output_ids[-1] != tools.format.end_id:
            return False
        if s.tool_calls + 1 >= self.max_turns:
            self.counts["tool_over_max_turns"] += 1
            return False  # the last turn allowed: its call stays unanswered and the sample ends
        s.finish_reason, s.tool_pending = None, True
        return True

    async def _aanswer(self, s: SampleState) -> None:
        """Run the pending call and append its answer, or end the sample where it does not fit."""
        tools = self.tools
        if tools is None:
            raise RuntimeError("a sample holds a pending tool call but rollout.tool is none")
        if s.tool_started > s.tool_calls:  # started before a stop or a crash, never answered
            self.counts["tool_reruns"] += 1
        s.tool_started = s.tool_calls + 1
        result = await tools.arun_turn(s.turn_ids())
        ids, cut = tools.format.answer_ids(result.output)
        self.counts["tool_truncated"] += int(cut)
        if len(ids) >= s.remaining:  # no room for the answer and one token after it
            self.counts["tool_over_budget"] += 1
            s.tool_pending, s.finish_reason = False, "length"
            return
        s.add_tool_output(ids, failed=result.status != "ok")
        self.counts["tool_output_tokens"] += len(ids)

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()

    def count_finished(self, samples: list[SampleState]) -> None:
        self.counts["samples_scored"] += len(samples)
        self.counts["turns"] += sum(s.tool_calls + 1 for s in samples)
        self.counts["tool_tokens"] += sum(s.tool_tokens for s in samples)


def tool_turns(config: RolloutConfig, tokenizer: Any) -> TurnLoop | None:
    """The turn loop of `rollout.tool` over `tokenizer` (None for `tool: none`), for evaluation,
    which runs samples as training does; close it when done."""
    if config.tool == "none":
        return None
    from megatron_darl.rollout.tools import ToolFormat

    return TurnLoop(config, ToolRunner(config, ToolFormat(config, tokenizer)))

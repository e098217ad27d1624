"""The turns of one sample: generate, and where a turn ends on a tool call, answer it and go on.

What it is: `SampleState` (one response being generated, possibly over several requests when a
weight update interrupts it: its tokens keep the version that sampled each of them; with tools,
its tool-output tokens have `policy_mask` 0), the `SampleClient` protocol that runs one turn of
it on an engine, and `TurnLoop.arun(client, sample, sampling)`, shared by training rollouts
(`workflow.GroupWorkflow`) and evaluation (`eval/scoring.py`): without tools, one request per
sample (continued after aborts by the client); with a `ToolRunner` (rollout.tool), a turn that
stops on the call's closing token is answered with the tool's tokens (`SampleState.add_tool_output`:
policy_mask 0, log-prob 0.0, version -1) and the next turn continues from the ids the engine saw,
up to `rollout.max_turns` turns within the sample's one budget (`rollout.max_new_tokens`, tool
tokens included). A call pending when the manager stopped (`SampleState.tool_pending`, saved
in its state) runs again on resume, counted as `tool_reruns`. `counts` is what it counts
(`rollout/<name>`, with tools only): samples, turns and tool tokens over finished samples, and
the runner's counters.
What it is not: the call's syntax or its execution (`tools.py`), dispatch to engines (the client).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout.tools import TOOL_COUNTERS, ToolRunner
from megatron_darl.types import GenerateResponse, SamplingParams

SEED_MOD = 2**31 - 1  # SGLang seeds are int32-ranged


@dataclass
class SampleState:
    """One response of a group. `output_ids[t]` was sampled by weights `versions[t]` with
    behavior log-prob `logprobs[t]`; `finish_reason` is None until the response is complete."""

    prompt_ids: list[int]
    max_new_tokens: int
    seed: int | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    segments: int = 0  # requests that contributed tokens (>1: a partial rollout continued)
    restarts: int = 0  # times partial output was discarded (partial_rollout=False)
    # multi-turn (rollout.tool): 1 where the policy sampled the token, 0 for a tool's output (which
    # has log-prob 0.0 and version -1); `tool_pending`: the last turn ended on a call not yet
    # answered (a checkpoint may hold it: resume runs it); calls started and answered
    policy_mask: list[int] = field(default_factory=list)
    tool_pending: bool = False
    tool_started: int = 0
    tool_calls: int = 0
    tool_failures: int = 0

    def __post_init__(self) -> None:
        if not self.policy_mask and self.output_ids:  # a state saved before multi-turn existed
            self.policy_mask = [1] * len(self.output_ids)
        if len(self.policy_mask) != len(self.output_ids) or not set(self.policy_mask) <= {0, 1}:
            raise ValueError(f"sample state: policy_mask of {len(self.policy_mask)} values in "
                             f"{sorted(set(self.policy_mask))} for {len(self.output_ids)} output ids")

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    def next_input_ids(self) -> list[int]:
        """What the next request continues from: the prompt plus the partial response."""
        return self.prompt_ids + self.output_ids

    def next_seed(self) -> int | None:
        """A fresh seed per segment: reusing one would replay the same random stream."""
        if self.seed is None:
            return None
        return (self.seed + 1_000_003 * (self.segments + 7919 * self.restarts)) % SEED_MOD

    def absorb(self, resp: GenerateResponse, keep_partial: bool) -> None:
        """Add a response's tokens. An "abort" keeps them (to continue) or drops all output so
        far (restart under new weights); any other reason completes the sample."""
        n = len(resp.output_ids)
        if len(resp.output_logprobs) != n or len(resp.output_versions) != n:
            raise ValueError(
                f"response {resp.rid}: {n} output_ids but {len(resp.output_logprobs)} logprobs and "
                f"{len(resp.output_versions)} versions"
            )
        if n > self.remaining:
            raise ValueError(f"response {resp.rid}: {n} tokens exceed the {self.remaining} requested")
        if resp.finish_reason == "abort" and not keep_partial:  # the whole episode restarts, tool turns too
            self.output_ids, self.logprobs, self.versions, self.policy_mask = [], [], [], []
            self.segments, self.restarts = 0, self.restarts + 1
            self.tool_started = self.tool_calls = self.tool_failures = 0
            return
        self.output_ids += list(resp.output_ids)
        self.logprobs += [float(x) for x in resp.output_logprobs]
        self.versions += [int(v) for v in resp.output_versions]
        self.policy_mask += [1] * n
        self.segments += 1 if n else 0
        if resp.finish_reason != "abort":
            self.finish_reason = resp.finish_reason
        elif self.remaining == 0:
            self.finish_reason = "length"  # aborted exactly at the budget: nothing to continue

    def add_tool_output(self, ids: list[int], failed: bool) -> None:
        """Answer the pending call with the tool's tokens: conditioned on, never trained."""
        self.output_ids += [int(t) for t in ids]
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.policy_mask += [0] * len(ids)
        self.tool_pending = False
        self.tool_calls += 1
        self.tool_failures += int(failed)

    def turn_ids(self) -> list[int]:
        """The tokens the policy sampled since the last tool output (all of them without one): the
        current turn, and once the sample is done its final answer."""
        last_tool = max((i for i, m in enumerate(self.policy_mask) if m == 0), default=-1)
        return self.output_ids[last_tool + 1:]

    @property
    def tool_tokens(self) -> int:
        return self.policy_mask.count(0)

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_ids": self.prompt_ids, "max_new_tokens": self.max_new_tokens, "seed": self.seed,
            "output_ids": self.output_ids, "logprobs": self.logprobs, "versions": self.versions,
            "finish_reason": self.finish_reason, "segments": self.segments, "restarts": self.restarts,
            "policy_mask": self.policy_mask, "tool_pending": self.tool_pending,
            "tool_started": self.tool_started, "tool_calls": self.tool_calls, "tool_failures": self.tool_failures,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SampleState":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class SampleClient(Protocol):
    """Runs one sample to completion (dispatch, continuation after aborts, failover)."""

    async def agenerate_sample(self, sample: SampleState, sampling: SamplingParams) -> None: ...


# counted over finished samples: samples, their turns (1 + tool calls) and tool-output tokens
SAMPLE_COUNTERS = ("samples_scored", "turns", "tool_tokens")


def per_sample_metrics(counts: dict[str, float]) -> dict[str, float]:
    """Means per finished sample since the start, from the counters (empty without tools):
    turns, tool-output tokens, calls, and seconds per call (`rollout/<name>`)."""
    n = counts.get("samples_scored")
    if not n:
        return {}
    out = {"rollout/turns_per_sample": counts["turns"] / n, "rollout/tool_tokens_per_sample": counts["tool_tokens"] / n}
    if "tool_calls" in counts:
        out["rollout/tool_calls_per_sample"] = counts["tool_calls"] / n
        out["rollout/tool_s_per_call"] = counts["tool_time_s_total"] / max(counts["tool_calls"], 1)
    return out


class TurnLoop:
    """Runs samples turn by turn; `tools` None: a sample is one response."""

    def __init__(self, config: RolloutConfig, tools: ToolRunner | None = None) -> None:
        self.max_turns = int(config.max_turns)
        self.tools = tools
        names = SAMPLE_COUNTERS + TOOL_COUNTERS if tools is not None else ()  # without tools: none (1 turn each)
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
        if self.tools is None:
            return
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

"""One prompt -> G samples -> G scored `Trajectory`s: the rollout workflow (AReaL's shape).

What it is: `SampleState` (one response being generated, possibly over several requests when a
weight update interrupts it: its tokens keep the version that sampled each of them; with tools, an
episode of turns whose tool-output tokens have `policy_mask` 0, see `turns.py`), `Episode`
(one drawn prompt and its G samples; JSON round trip, so a checkpoint can hold the partial
responses of prompts in flight), the protocols a workflow needs (`SampleClient` to run one
sample to the end, `Scorer` to reward a finished group) and `GroupWorkflow`, whose
`arun_episode(client, episode) -> list[Trajectory] | None` runs the G samples concurrently,
scores them and returns the group, or None when the DAPO filter drops it.
What it is not: dispatch, retries, failure handling or weight updates (the manager's
`SampleClient` does those), nor reward computation (the scorer's process pool does).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout.tools import ToolRunner
from megatron_darl.rollout.turns import TurnLoop
from megatron_darl.types import GenerateResponse, SamplingParams, Trajectory

_SEED_MOD = 2**31 - 1  # SGLang seeds are int32-ranged


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
        return (self.seed + 1_000_003 * (self.segments + 7919 * self.restarts)) % _SEED_MOD

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


@dataclass
class Episode:
    """One prompt draw and its G samples. `uid` is the prompt draw id: it becomes both the
    `prompt_id` and the `group_id` of the G trajectories (a group is one draw, never split)."""

    uid: int
    prompt_ids: list[int]
    task: str
    answer: Any
    samples: list[SampleState]
    question: str = ""  # the prompt text, for graders that read it
    metadata: dict[str, Any] = field(default_factory=dict)  # the prompt's metadata (JSON-able)
    attempts: int = 0  # failed scoring/writing attempts (the manager retries a few)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid, "prompt_ids": self.prompt_ids, "task": self.task, "answer": self.answer,
            "samples": [s.to_json() for s in self.samples], "question": self.question,
            "metadata": self.metadata, "attempts": self.attempts,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Episode":
        try:
            return cls(
                uid=int(d["uid"]), prompt_ids=[int(x) for x in d["prompt_ids"]], task=str(d["task"]),
                answer=d.get("answer"), samples=[SampleState.from_json(s) for s in d["samples"]],
                question=str(d.get("question", "")), metadata=dict(d.get("metadata") or {}),
                attempts=int(d.get("attempts", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad episode in rollout state ({exc}): keys {sorted(d)}") from None


class SampleClient(Protocol):
    """Runs one sample to completion (dispatch, continuation after aborts, failover)."""

    async def agenerate_sample(self, sample: SampleState, sampling: SamplingParams) -> None: ...


class Scorer(Protocol):
    """Rewards a finished episode: one float per sample, in sample order."""

    async def ascore(self, episode: Episode) -> list[float]: ...


class RolloutWorkflow(Protocol):
    def new_episode(self, prompt: Any) -> Episode: ...

    async def arun_episode(self, client: SampleClient, episode: Episode) -> list[Trajectory] | None: ...


def prompt_uid(prompt: Any) -> int:
    uid = getattr(prompt, "uid", None)
    try:
        return int(uid)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"prompt uid {uid!r} is not an integer (Trajectory.prompt_id is int64)") from None


class GroupWorkflow:
    """G samples per prompt under the config's sampling, scored together, DAPO-filtered. With
    `tools` (rollout.tool), a sample is an episode of turns: a turn that ends on a tool call is
    answered with the tool's tokens and generation continues, up to `rollout.max_turns` turns
    within the one budget `rollout.max_new_tokens`."""

    def __init__(self, config: RolloutConfig, scorer: Scorer, seed: int | None = None,
                 tools: ToolRunner | None = None) -> None:
        self.config = config
        self.scorer = scorer
        self.seed = seed  # None: engines pick seeds; else sample i of prompt u gets a fixed seed
        self.tools = tools
        self.turns = TurnLoop(config, tools)  # one request per sample, or turns around tool calls
        self.sampling = SamplingParams(
            temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
            max_new_tokens=config.max_new_tokens, stop_token_ids=self.turns.stop_token_ids(),
        )
        self.counts = self.turns.counts  # rollout/<name>: samples, turns, tool calls (turns.py)

    def load_counts(self, saved: dict[str, float]) -> None:
        """Restore the counters from a saved state (names the workflow does not count are ignored)."""
        self.turns.load_counts(saved)

    def new_episode(self, prompt: Any) -> Episode:
        uid = prompt_uid(prompt)
        ids = [int(x) for x in prompt.input_ids]
        if not ids:
            raise ValueError(f"prompt uid={uid}: empty input_ids")
        g = self.config.group_size

        def seed(i: int) -> int | None:
            return None if self.seed is None else (self.seed * 7_368_787 + uid * g + i) % _SEED_MOD

        samples = [SampleState(list(ids), self.config.max_new_tokens, seed(i)) for i in range(g)]
        return Episode(
            uid, ids, str(getattr(prompt, "task", "")), getattr(prompt, "answer", None), samples,
            question=str(getattr(prompt, "question", "")), metadata=dict(getattr(prompt, "metadata", {}) or {}),
        )

    async def arun_episode(self, client: SampleClient, episode: Episode) -> list[Trajectory] | None:
        tasks = [asyncio.ensure_future(self.turns.arun(client, s, self.sampling))
                 for s in episode.samples if not s.done]
        try:
            await asyncio.gather(*tasks)
        except BaseException:  # one sample failed (or we are cancelled): its siblings stop too, so
            for t in tasks:  # none keeps an engine slot or writes into a group that is re-run
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        rewards = await self.scorer.ascore(episode)
        if len(rewards) != len(episode.samples):
            raise ValueError(f"scorer returned {len(rewards)} rewards for {len(episode.samples)} samples "
                             f"(prompt uid={episode.uid})")
        self.turns.count_finished(episode.samples)
        if self.config.filter_equal_rewards and len(rewards) > 1 and len(set(rewards)) == 1:
            return None  # DAPO: an all-equal group has zero advantage everywhere
        return [
            Trajectory(
                prompt_ids=episode.prompt_ids, response_ids=s.output_ids, behav_logprobs=s.logprobs,
                behav_versions=s.versions, reward=float(r), prompt_id=episode.uid, group_id=episode.uid,
                finish_reason=s.finish_reason or "abort", policy_mask=s.policy_mask,
                metadata={"task": episode.task, "segments": s.segments, "restarts": s.restarts,
                          **({"tool_calls": s.tool_calls, "tool_failures": s.tool_failures,
                              "tool_tokens": s.tool_tokens} if self.tools is not None else {})},
            )
            for s, r in zip(episode.samples, rewards)
        ]


class RewardPoolScorer:
    """`Scorer` over `rewards.pool.RewardPool`: decodes each response to text and grades it
    with the prompt's task kind and answer payload; a grader timeout or error scores 0."""

    def __init__(self, pool: Any, decode: Callable[[list[int]], str]) -> None:
        self.pool = pool
        self.decode = decode

    async def ascore(self, episode: Episode) -> list[float]:
        from megatron_darl.rewards.api import RewardInput

        answer = episode.answer if isinstance(episode.answer, dict) else {"answer": episode.answer}
        items = [  # the final answer: a tool's output before it is not the policy's answer
            RewardInput(prompt=episode.question, response=self.decode(s.turn_ids()), kind=episode.task,
                        answer=answer, metadata=dict(episode.metadata))
            for s in episode.samples
        ]
        return [float(r.score) for r in await self.pool.ascore(items)]

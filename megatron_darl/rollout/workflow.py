"""One prompt -> G samples -> G scored `Trajectory`s: the rollout workflow (AReaL's shape).

What it is: `Episode` (one drawn prompt and its G samples, `turns.SampleState`s; JSON round trip,
so a checkpoint can hold the partial responses of prompts in flight), the protocols a workflow
needs (`turns.SampleClient` to run one sample's turn, `Scorer` to reward a finished group) and
`GroupWorkflow`, whose
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
from megatron_darl.rollout.turns import SEED_MOD, SampleClient, SampleState, TurnLoop
from megatron_darl.types import SamplingParams, Trajectory


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
            return None if self.seed is None else (self.seed * 7_368_787 + uid * g + i) % SEED_MOD

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

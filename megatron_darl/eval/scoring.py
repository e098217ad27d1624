"""Benchmark evaluation through rollout engines: avg@k, pass@k and confidence intervals.

What it is: `aevaluate(engines, prompts, ...)`, which samples k responses per problem from any
`RolloutEngine` (embedded engine or SGLang server; greedy when temperature is 0), grades them
with the reward pool (math-verify, procedural verifiers, code sandbox) and returns per-problem
scores with avg@k / pass@k and a 95% interval; and `paired_difference(before, after)`, the
interval of an accuracy change measured on the same problems.
What it is not: the graders (`rewards/`) or an engine (`engine/server.py`).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from megatron_darl.eval.api import EvalResult
from megatron_darl.rewards.api import RewardInput
from megatron_darl.rollout.api import RolloutEngine
from megatron_darl.rollout.turns import TurnLoop
from megatron_darl.rollout.workflow import SampleState
from megatron_darl.types import GenerateRequest, SamplingParams

Z95 = 1.959964  # two-sided 95% normal quantile


@dataclass
class ProblemScores:
    """Scores of the k samples of each problem, in problem order: `scores[i, j]`."""

    uids: list[int]
    scores: np.ndarray  # float [N, k]
    tool_calls: np.ndarray | None = None  # int [N, k]: calls each sample made (evaluated with tools)

    def tool_call_rate(self) -> float | None:
        """The fraction of samples that called a tool at least once; None without tools."""
        return None if self.tool_calls is None or not self.tool_calls.size else float((self.tool_calls > 0).mean())

    def result(self, name: str) -> EvalResult:
        n, k = self.scores.shape
        per_problem = self.scores.mean(axis=1)
        avg = float(per_problem.mean()) if n else 0.0
        passed = float((self.scores >= 1.0).any(axis=1).mean()) if n else 0.0
        half = Z95 * float(per_problem.std(ddof=1)) / math.sqrt(n) if n > 1 else 0.0
        return EvalResult(name=name, num_problems=n, avg_at_k=avg, pass_at_k=passed, k=k,
                          ci95=(avg - half, avg + half))


def paired_difference(before: ProblemScores, after: ProblemScores) -> tuple[float, float, float]:
    """Mean of after - before over the same problems, with its 95% interval (paired, normal)."""
    if before.uids != after.uids:
        raise ValueError("paired_difference: the two evaluations must cover the same problems in order")
    d = after.scores.mean(axis=1) - before.scores.mean(axis=1)
    n = len(d)
    mean = float(d.mean())
    half = Z95 * float(d.std(ddof=1)) / math.sqrt(n) if n > 1 else float("inf")
    return mean, mean - half, mean + half


def task_kind(task: str) -> str:
    """Prompt task name -> grader kind (the reward pool's `RewardInput.kind`)."""
    return {"math": "math", "procedural": "procedural", "code": "code"}.get(task, "custom")


async def aevaluate(engines: Sequence[RolloutEngine], prompts: Sequence[Any], tokenizer: Any, scorer: Any, *,
                    k: int = 1, temperature: float = 0.0, max_new_tokens: int = 256,
                    stop_token_ids: list[int] | None = None, max_concurrency: int = 256,
                    seed: int = 0, turns: TurnLoop | None = None) -> ProblemScores:
    """Generate k samples per prompt (spread round-robin over `engines`) and grade them.

    A sample scores 1 only at full marks (partial credit counts 0).

    Args:
        engines: the rollout engines to generate with (at least one).
        prompts: the problems (`Prompt`s: `uid`, `input_ids`, `question`, `task`, `answer`, `metadata`).
        tokenizer: decodes the responses, special tokens skipped.
        scorer: has `async ascore(list[RewardInput]) -> list[RewardResult]` (the reward pool).
        k: samples per problem, the k of avg@k and pass@k.
        temperature: the sampling temperature; 0 is greedy.
        max_new_tokens: the most tokens each response may generate.
        stop_token_ids: token ids that end a response, besides the model's EOS; None: no others.
        max_concurrency: the most requests in flight at once, over all engines.
        seed: the evaluation seed; each (problem, sample) gets its own seed from it, so a re-run
            reproduces the same responses.
        turns: with a tool runner (rollout.tool), each sample runs turn by turn as in training
            (`rollout/turns.py`) and is graded on its final answer; None: one request a sample.
    """
    if not engines:
        raise ValueError("aevaluate: no engine to generate with")
    sem = asyncio.Semaphore(max_concurrency)
    stops = sorted(set(stop_token_ids or []) | set(turns.stop_token_ids() if turns is not None else []))

    async def one(i: int, j: int) -> SampleState:
        p = prompts[i]
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=stops)
        sample = SampleState(list(p.input_ids), max_new_tokens, seed=seed * 1_000_003 + p.uid * 97 + j)
        client = _EngineTurns(engines[(i * k + j) % len(engines)], f"eval-{p.uid}-{j}")
        async with sem:
            if turns is None:
                await client.agenerate_sample(sample, params)
            else:
                await turns.arun(client, sample, params)
        return sample

    samples = await asyncio.gather(*(one(i, j) for i in range(len(prompts)) for j in range(k)))
    texts = [tokenizer.decode(s.turn_ids(), skip_special_tokens=True) for s in samples]
    items = [RewardInput(prompt=prompts[i].question, response=texts[i * k + j], kind=task_kind(prompts[i].task),
                         answer=prompts[i].answer, metadata=dict(prompts[i].metadata))
             for i in range(len(prompts)) for j in range(k)]
    results = await scorer.ascore(items)
    # accuracy counts full marks only: some verifiers give partial credit (reasoning-gym's
    # chain_sum scores "-566" for "-56" at 0.75), which is a reward shape, not a correct answer
    scores = np.array([r.score >= 1.0 for r in results], dtype=np.float64).reshape(len(prompts), k)
    calls = np.array([s.tool_calls for s in samples], dtype=np.int64).reshape(len(prompts), k) if turns else None
    return ProblemScores(uids=[p.uid for p in prompts], scores=scores, tool_calls=calls)


class _EngineTurns:
    """One evaluation sample's `SampleClient` over one engine: a request per turn, with a fresh
    seed per turn; a response interrupted by a weight update ends the sample (as it did before
    multi-turn evaluation: nothing continues it)."""

    def __init__(self, engine: RolloutEngine, rid: str) -> None:
        self.engine, self.rid, self.n = engine, rid, 0

    async def agenerate_sample(self, sample: SampleState, sampling: SamplingParams) -> None:
        rid = self.rid if self.n == 0 else f"{self.rid}-t{self.n}"
        self.n += 1
        params = replace(sampling, max_new_tokens=sample.remaining,
                         seed=sample.seed if self.n == 1 else sample.next_seed())
        out = await self.engine.agenerate(GenerateRequest(input_ids=sample.next_input_ids(), sampling=params, rid=rid))
        sample.absorb(out, keep_partial=True)
        if not sample.done:
            sample.finish_reason = "abort"


def format_result(r: EvalResult) -> str:
    return (f"{r.name}: avg@{r.k} = {100 * r.avg_at_k:.1f}% (95% CI {100 * r.ci95[0]:.1f}-"
            f"{100 * r.ci95[1]:.1f}), pass@{r.k} = {100 * r.pass_at_k:.1f}% on {r.num_problems} problems")

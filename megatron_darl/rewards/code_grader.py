"""Generated programs run against tests in the sandbox: HumanEval and LiveCodeBench formats.

What it is: `grade_code(response, payload, limits)` extracts the program from the response
(the last fenced code block, else the whole text) and runs it in `sandbox.run_sandboxed`:
  humaneval   prompt + completion + the problem's `check(entry_point)`; passes when `check`
              returns, shown by a per-run nonce printed after it (an `exit(0)` in the
              completion ends the run before the nonce, so it fails)
  stdio       one run per case with the case's input on stdin; stdout compared line by line,
              numbers with a tolerance
  functional  one run calling `Solution().fn_name(*args)` (or a plain function) per case; the
              return values are compared here, outside the sandbox, with the expected ones
Score 1.0 when every case passes, else 0.0; the detail names the first failing case.
What it is not: the sandbox (sandbox.py) nor a guard against a program that inspects the
harness's own frames to find the nonce; it stops the common reward hacks, not an adversary.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import Any

from megatron_darl.config.rewards import RewardConfig
from megatron_darl.rewards.sandbox import SandboxLimits, SandboxResult, run_sandboxed

CODE_FORMATS = ("humaneval", "stdio", "functional")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
# LiveCodeBench solutions assume these names, as its own harness provides them
IMPORT_HEADER = (
    "from typing import *\nfrom collections import *\nfrom itertools import *\n"
    "from functools import *\nfrom heapq import *\nfrom bisect import *\n"
    "import math, string, re, sys, collections, heapq, itertools, functools, bisect\n"
)

_FUNCTIONAL_HARNESS = '''
def _harness():
    import json, sys
    nonce = sys.stdin.readline().strip()
    inputs = json.loads(sys.stdin.readline())
    space = {{"__name__": "solution"}}
    exec(compile({source!r}, "solution.py", "exec"), space)
    if "Solution" in space:
        fn = getattr(space["Solution"](), {fn_name!r})
    else:
        fn = space[{fn_name!r}]
    results = []
    for text in inputs:
        args = [json.loads(line) for line in text.split("\\n") if line.strip()]
        results.append(fn(*args))
    sys.stdout.write("\\n" + nonce + json.dumps(results) + "\\n")
    sys.stdout.flush()
_harness()
'''


def limits_from_config(config: RewardConfig) -> SandboxLimits:
    return SandboxLimits(
        cpu_s=int(config.code_cpu_s),
        wall_s=float(config.code_wall_s),
        memory_mb=int(config.code_memory_mb),
        max_procs=int(config.code_max_procs),
        max_file_mb=int(config.code_max_file_mb),
    )


def extract_code(response: str) -> str:
    """The last fenced code block of the response, else the response itself."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def grade_code(response: str, payload: dict[str, Any], limits: SandboxLimits) -> tuple[float, str]:
    """(score, detail) of a generated program against the tests in `payload`."""
    payload = normalize_code_payload(payload)
    fmt = payload.get("format")
    if fmt not in CODE_FORMATS:
        raise ValueError(f"grade_code: answer['format']={fmt!r}; allowed: {CODE_FORMATS}")
    code = extract_code(response)
    if fmt == "humaneval":
        return _grade_humaneval(code, payload, limits)
    cases = payload.get("cases")
    if not isinstance(cases, list) or not cases:
        raise ValueError(f"grade_code: {fmt} payload needs a non-empty 'cases' list")
    if fmt == "stdio":
        return _grade_stdio(code, cases, limits)
    if not payload.get("fn_name"):
        raise ValueError("grade_code: functional payload needs 'fn_name'")
    return _grade_functional(code, str(payload["fn_name"]), cases, limits)


def normalize_code_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """Give a payload without "format" its format: the data role emits HumanEval problems as
    {task_id, prompt, test, entry_point} and LiveCodeBench rows as {public_test_cases,
    private_test_cases, func_name, starter_code}, each case carrying its "testtype"."""
    if "format" in payload:
        return payload
    if "entry_point" in payload:
        return {**payload, "format": "humaneval"}
    if "public_test_cases" in payload:
        cases = list(payload["public_test_cases"]) + list(payload.get("private_test_cases") or [])
        types = {c.get("testtype", "stdin") for c in cases}
        if len(types) > 1:
            raise ValueError(f"grade_code: LiveCodeBench cases mix test types {sorted(types)}")
        if types == {"functional"}:
            return {"format": "functional", "fn_name": payload.get("func_name"), "cases": cases}
        return {"format": "stdio", "cases": cases}
    raise ValueError(f"grade_code: cannot tell the code format from keys {sorted(payload)}")


def humaneval_program(code: str, problem: dict[str, Any]) -> str:
    """The solution: the prompt plus the completion, or, when the response restates the whole
    function, the prompt's imports plus the response."""
    for key in ("prompt", "test", "entry_point"):
        if key not in problem:
            raise ValueError(f"grade_code: humaneval payload lacks {key!r}")
    prompt, entry = problem["prompt"], problem["entry_point"]
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        imports = [ln for ln in prompt.splitlines() if ln.startswith(("import ", "from "))]
        return "\n".join(imports) + "\n" + code
    return prompt + code


def _grade_humaneval(
    code: str, problem: dict[str, Any], limits: SandboxLimits
) -> tuple[float, str]:
    nonce = secrets.token_hex(16)
    solution = humaneval_program(code, problem) + "\n\n" + problem["test"]
    program = (
        "def _harness():\n    import sys\n    nonce = sys.stdin.readline().strip()\n"
        f"    space = {{'__name__': 'solution'}}\n"
        f"    exec(compile({solution!r}, 'solution.py', 'exec'), space)\n"
        f"    space['check'](space[{problem['entry_point']!r}])\n"
        "    sys.stdout.write('\\n' + nonce + '\\n')\n_harness()\n"
    )
    result = run_sandboxed(program, nonce + "\n", limits)
    if result.passed and nonce in result.stdout.splitlines():
        return 1.0, "passed"
    if result.passed:
        return 0.0, "tests: the program exited before check() returned"
    return 0.0, _failure("tests", result)


def outputs_match(got: str, expected: str, tol: float = 1e-6) -> bool:
    """Line-by-line match of stripped output; tokens that are both numbers match within tol."""
    got_lines = [ln.strip() for ln in got.strip().splitlines()]
    exp_lines = [ln.strip() for ln in expected.strip().splitlines()]
    if got_lines == exp_lines:
        return True
    if len(got_lines) != len(exp_lines):
        return False
    for g_line, e_line in zip(got_lines, exp_lines):
        g_tok, e_tok = g_line.split(), e_line.split()
        if len(g_tok) != len(e_tok):
            return False
        for g, e in zip(g_tok, e_tok):
            if g != e and not _close(g, e, tol):
                return False
    return True


def _close(a: Any, b: Any, tol: float) -> bool:
    try:
        x, y = float(a), float(b)
    except (TypeError, ValueError):
        return False
    return math.isclose(x, y, rel_tol=tol, abs_tol=tol)


def _grade_stdio(code: str, cases: list[dict], limits: SandboxLimits) -> tuple[float, str]:
    program = IMPORT_HEADER + code
    for i, case in enumerate(cases):
        result = run_sandboxed(program, str(case["input"]), limits)
        if not result.passed:
            return 0.0, _failure(f"case {i}", result)
        if not outputs_match(result.stdout, str(case["output"])):
            return 0.0, f"case {i}: wrong output {result.stdout[:200]!r}"
    return 1.0, f"passed {len(cases)} cases"


def values_match(got: Any, expected: Any, tol: float = 1e-6) -> bool:
    """Equality of JSON values, with a tolerance for floats."""
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(
            values_match(g, e, tol) for g, e in zip(got, expected)
        )
    if isinstance(got, float) or isinstance(expected, float):
        return not isinstance(got, bool) and _close(got, expected, tol)
    return got == expected


def _grade_functional(
    code: str, fn_name: str, cases: list[dict], limits: SandboxLimits
) -> tuple[float, str]:
    nonce = secrets.token_hex(16)
    program = _FUNCTIONAL_HARNESS.format(source=IMPORT_HEADER + code, fn_name=fn_name)
    stdin = nonce + "\n" + json.dumps([str(c["input"]) for c in cases]) + "\n"
    result = run_sandboxed(program, stdin, limits)
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith(nonce)]
    if not result.passed or not lines:
        return 0.0, _failure("cases", result)
    got = json.loads(lines[-1][len(nonce):])
    for i, (value, case) in enumerate(zip(got, cases)):
        if not values_match(value, json.loads(case["output"])):
            return 0.0, f"case {i}: returned {json.dumps(value)[:200]}"
    return 1.0, f"passed {len(cases)} cases"


def _failure(what: str, result: SandboxResult) -> str:
    tail = result.stderr.strip().splitlines()[-1:] or [""]
    return f"{what}: {result.status} (exit {result.returncode}) {tail[0][:200]}"

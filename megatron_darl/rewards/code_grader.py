"""Generated programs run against tests: HumanEval and LiveCodeBench formats.

What it is: `grade_code(response, payload, limits)` extracts the program from the response
(the last fenced code block, else the whole text) and grades it; the candidate's code runs in the
sandbox (sandbox.py), LiveCodeBench's expected values stay here, and only data cross:
  humaneval   the problem's prompt (helpers such as `encode_cyclic`) and test (`check`) run in a
              sandbox of their own, beside the candidate's (prompt + completion, no test), and
              call it through a proxy; the worker only relays lines between the two and takes
              pass or fail from the checker (sandbox_relay.py): each argument and return value
              crosses as JSON of exactly builtin values; passes when `check` returns
  stdio       one run per case with the case's input on stdin; stdout compared here line by line,
              token by token (`outputs_match`)
  functional  one sandboxed program serving `Solution().fn_name(*args)` (or a plain function) for
              every case; the values are compared here with the expected ones (`values_match`)
Numbers: exact where the answer is exact. An integer expected (a token such as `421678599`, a
JSON int) needs exactly that integer (a float, even `3.0`, fails); a tolerance (1e-6, relative
and absolute) applies only where the expected value is not an integer (`2.5`, a JSON float).
LiveCodeBench's own checker (lcb_runner/evaluation/testing_util.py) compares stdio lines exactly,
then token by token as `Decimal`s (exact: `3.0` equals `3`, no tolerance), and functional values
with Python's `==` after turning a tuple into a list (`3.0 == 3` holds). We differ in two ways:
a non-integer expected value gets the 1e-6 tolerance (a float printed with other digits passes),
and an integer expected refuses a float, whatever its value (the checker of a judge would too).
Score 1.0 when every case passes, else 0.0; the detail names the first failing case.
What holds (each claim with its test): a returned object with its own `__eq__`, a subclass of a
builtin, patched builtins, a settrace that swaps `check`, re-reading stdin, walking frames, parsing
the tests from the program's file and running the canonical solution from the package's data all
score 0 on all 164 HumanEval problems, on both sandbox paths (tests/unit/rewards/test_reward_hacks.py):
the program holds no test, no expected value, no secret, and the benchmark data are hidden from it;
the 164 canonical solutions score 1 and the empty bodies 0 (tests/faults/test_sandbox.py); a
value that is not builtin data fails the call (tests/unit/rewards/test_sandbox_calls.py).
What it is not: the sandbox, nor a judge of a test's own quality: a test that accepts a wrong
value (HumanEval/33 compares the candidate partly with itself) still accepts it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from megatron_darl.config.rewards import RewardConfig
from megatron_darl.rewards.sandbox import SandboxLimits, SandboxResult, run_sandboxed
from megatron_darl.rewards.sandbox_calls import CandidateError, SandboxedFunction
from megatron_darl.rewards.sandbox_relay import run_checked

CODE_FORMATS = ("humaneval", "stdio", "functional")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
# LiveCodeBench solutions assume these names, as its own harness provides them
IMPORT_HEADER = (
    "from typing import *\nfrom collections import *\nfrom itertools import *\n"
    "from functools import *\nfrom heapq import *\nfrom bisect import *\n"
    "import math, string, re, sys, collections, heapq, itertools, functools, bisect\n"
)

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
    source = humaneval_program(code, problem)
    return run_checked(source, problem["entry_point"], problem["prompt"], problem["test"], limits)


def outputs_match(got: str, expected: str, tol: float = 1e-6) -> bool:
    """Line-by-line match of stripped output, token by token: an integer token expected must be
    printed as an integer of exactly that value; a tolerance `tol` (relative and absolute)
    applies only where the expected token is a number that is not an integer."""
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
            if g != e and not _tokens_match(g, e, tol):
                return False
    return True


_INTEGER = re.compile(r"[+-]?[0-9]+")


def _tokens_match(got: str, expected: str, tol: float) -> bool:
    if _INTEGER.fullmatch(expected):
        # exact: within a relative 1e-6, any answer above 10^6 would pass off by a little
        return _INTEGER.fullmatch(got) is not None and int(got) == int(expected)
    try:  # text that only overflows to infinity (400 digits against "1e400") is no match
        if not (math.isfinite(float(got)) and math.isfinite(float(expected))):
            return False
    except ValueError:
        return False
    return _close(got, expected, tol)


def _close(a: Any, b: Any, tol: float) -> bool:
    try:
        x, y = float(a), float(b)
    except (TypeError, ValueError, OverflowError):
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
    """Equality of JSON values: an int expected needs an int of exactly that value (a float,
    even 3.0, fails); a tolerance `tol` applies only where the expected value is a float."""
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(
            values_match(g, e, tol) for g, e in zip(got, expected)
        )
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, int):
        return type(got) is int and got == expected
    if isinstance(expected, float):
        return type(got) in (int, float) and _close(got, expected, tol)
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(values_match(got[k], expected[k], tol) for k in expected)
    return got == expected


def _grade_functional(
    code: str, fn_name: str, cases: list[dict], limits: SandboxLimits
) -> tuple[float, str]:
    with SandboxedFunction(IMPORT_HEADER + code, fn_name, limits, class_first=True) as fn:
        for i, case in enumerate(cases):
            args = [json.loads(line) for line in str(case["input"]).split("\n") if line.strip()]
            try:
                value = fn(*args)
            except CandidateError as e:
                return 0.0, _call_failure(f"case {i}", e)
            try:  # compared as its JSON form, as LiveCodeBench does (tuples as lists, keys as text)
                value = json.loads(json.dumps(value))
            except (TypeError, ValueError):
                return 0.0, f"case {i}: returned a value JSON cannot hold"
            if not values_match(value, json.loads(case["output"])):
                return 0.0, f"case {i}: returned {json.dumps(value)[:200]}"
    return 1.0, f"passed {len(cases)} cases"


def _call_failure(what: str, error: CandidateError) -> str:
    if error.result is not None and error.result.status != "ok":
        return _failure(what, error.result)
    return f"{what}: {str(error)[:200]}"


def _failure(what: str, result: SandboxResult) -> str:
    tail = result.stderr.strip().splitlines()[-1:] or [""]
    return f"{what}: {result.status} (exit {result.returncode}) {tail[0][:200]}"

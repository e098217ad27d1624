"""Wrong integer answers score 0 on the LiveCodeBench formats; float answers keep their tolerance.

Each wrong answer is off by a little from a large integer: the old comparison (every number with
rel_tol=1e-6) gave each of them 1 as
stdio (printed), and as functional where the value returned was a float (a JSON int against a JSON
int was already exact). They are graded through the real RewardPool, as stdio and as
functional items, along the root path and the user path ("userns": natively as a user, as root in
test_sandbox_user.py), next to the right answers to the same problems, which score 1. The
expected values are computed here with exact integers (the naive reference).
"""

from __future__ import annotations

import json
import math

import pytest

from megatron_darl.config.rewards import RewardConfig
from megatron_darl.rewards.api import RewardInput
from megatron_darl.rewards.code_grader import outputs_match, values_match
from megatron_darl.rewards.pool import RewardPool
from tests.helpers.sandbox import needs_sandbox

MOD = 998244353


def _factorial_mod(n: int) -> int:
    out = 1
    for i in range(1, n + 1):
        out = out * i % MOD
    return out


# name: (function name, arguments, exact answer, right body, wrong body); each body defines f
PROBLEMS = {
    "factorial_mod_minus_one": (
        (1000,), _factorial_mod(1000),
        "def f(n):\n    r = 1\n    for i in range(1, n + 1):\n        r = r * i % 998244353\n    return r\n",
        "def f(n):\n    r = 1\n    for i in range(1, n + 1):\n        r = r * i % 998244353\n    return r - 1\n"),
    "sum_missing_last_term": (
        (3_000_000,), 3_000_000 * 3_000_001 // 2,
        "def f(n):\n    return sum(range(1, n + 1))\n",
        "def f(n):\n    return sum(range(1, n))\n"),
    "triangular_in_floats": (
        (10**9 + 7,), (10**9 + 7) * (10**9 + 8) // 2,
        "def f(n):\n    return n * (n + 1) // 2\n",
        "def f(n):\n    return int(n * (n + 1) / 2)\n"),
    "binomial_through_lgamma": (
        (60, 30), math.comb(60, 30),
        "def f(n, k):\n    return math.comb(n, k)\n",
        "def f(n, k):\n    return round(math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)))\n"),
    "binomial_through_lgamma_unrounded": (
        (60, 30), math.comb(60, 30),
        "def f(n, k):\n    return math.comb(n, k)\n",
        "def f(n, k):\n    return math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1))\n"),
    "float_where_an_integer_is_expected": (
        (10**8,), 10**8 * (10**8 + 1) // 2,
        "def f(n):\n    return n * (n + 1) // 2\n",
        "def f(n):\n    return n * (n + 1) / 2\n"),
}
STDIO_MAIN = "import sys\nprint(f(*map(int, sys.stdin.read().split())))\n"


def _items(body: str, args: tuple, expected, fmt: str) -> RewardInput:
    if fmt == "stdio":
        payload = {"format": "stdio", "cases": [{"input": " ".join(map(str, args)) + "\n",
                                                 "output": f"{expected}\n"}]}
        code = body + STDIO_MAIN
    else:
        payload = {"format": "functional", "fn_name": "f",
                   "cases": [{"input": "\n".join(json.dumps(a) for a in args), "output": json.dumps(expected)}]}
        code = body
    return RewardInput("", f"```python\n{code}```", "code", payload)


def _grade(items: list[RewardInput]):
    with RewardPool(RewardConfig(num_workers=2, timeout_s=120, code_wall_s=15)) as pool:
        return pool.score(items)


@needs_sandbox
@pytest.mark.timeout(600)
def test_wrong_integer_answers_score_zero_and_right_ones_one(sandbox):
    cases = [(name, fmt, kind) for name in PROBLEMS for fmt in ("stdio", "functional") for kind in ("right", "wrong")]
    items = []
    for name, fmt, kind in cases:
        args, expected, right, wrong = PROBLEMS[name]
        items.append(_items(right if kind == "right" else wrong, args, expected, fmt))
    results = _grade(items)
    scored = {case: (r.score, r.status, r.detail) for case, r in zip(cases, results)}
    assert {s for _, s, _ in scored.values()} == {"ok"}, scored
    expected = {case: 1.0 if case[2] == "right" else 0.0 for case in cases}
    assert {case: v[0] for case, v in scored.items()} == expected, scored


@needs_sandbox
@pytest.mark.timeout(600)
def test_float_answers_within_tolerance_still_score_one(sandbox):
    body = "def f(n):\n    return n / 3\n"
    items = [
        RewardInput("", body + STDIO_MAIN, "code",
                    {"format": "stdio", "cases": [{"input": "10\n", "output": "3.3333333333\n"},
                                                  {"input": "7\n", "output": "2.33333333\n"}]}),
        RewardInput("", body, "code",
                    {"format": "functional", "fn_name": "f",
                     "cases": [{"input": "10", "output": "3.3333333"}, {"input": "9", "output": "3.0"}]}),
        # past the tolerance: still 0
        RewardInput("", body + STDIO_MAIN, "code",
                    {"format": "stdio", "cases": [{"input": "10\n", "output": "3.3334\n"}]}),
        RewardInput("", body, "code",
                    {"format": "functional", "fn_name": "f", "cases": [{"input": "10", "output": "3.3334"}]}),
    ]
    results = _grade(items)
    assert [(r.score, r.status) for r in results] == [(1.0, "ok"), (1.0, "ok"), (0.0, "ok"), (0.0, "ok")], results


def test_integers_compare_exactly_and_other_numbers_within_tolerance():
    # the naive reference: Python's exact integers and math.isclose
    assert outputs_match("421678599\n", "421678599")
    assert not outputs_match("421678598\n", "421678599")
    assert not outputs_match("5000000050000000.0", "5000000050000000")
    assert not outputs_match("1.1826458156486166e+17", "118264581564861424")
    assert outputs_match("+7 007", "7 7")  # integer tokens compare as integers
    assert outputs_match("0.3333333\n", "0.33333333")
    assert outputs_match("2.5", "2.500000") and outputs_match("3", "3.0")
    assert not outputs_match("3.0001", "3.0")
    assert not outputs_match("1" * 400, "1e400") and not outputs_match("x", "1.5")
    assert values_match([1, [2.0000000001]], [1, [2.0]])
    assert not values_match(4499998500000, 4500001500000)
    assert not values_match(5000000050000000.0, 5000000050000000)
    assert not values_match(3.0, 3) and not values_match(True, 1) and not values_match(1, True)
    assert values_match(3, 3.0) and values_match({"a": [1, 2.0000000001]}, {"a": [1, 2.0]})
    assert not values_match({"a": 2.0}, {"b": 2.0}) and not values_match(10**400, 1.5)

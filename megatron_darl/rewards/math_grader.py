"""Math answers graded with math-verify: boxed answers, fractions, decimals, LaTeX, units.

What it is: `grade_math(response, gold)` -> 1.0 when the response's final answer equals the
gold answer by math-verify's comparison, else 0.0. math-verify's own time limits use
signal.alarm, which only works on a main thread; they are switched off here and the reward
pool enforces the time limit instead by killing the worker that overruns.
A gold answer that is a whole number takes only a number written out: "40 - 7" is 33 to
math-verify, and a policy learns to leave the arithmetic to the grader (data/answers.py).
What it is not: safe to call without an outer time limit: some inputs (towers of powers such as
9^{9^{9^9}}) make sympy compute for minutes. Call it through RewardPool.
"""

from __future__ import annotations

import logging

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from megatron_darl.data.answers import integer_gold, is_number_literal

# math-verify logs a warning each time its time limit is off; the pool's limit replaces it
logging.getLogger("math_verify").setLevel(logging.ERROR)

_GOLD_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())
# In a response, only the final answer counts: a boxed one first, then the usual fallbacks.
_PRED_CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


def parse_gold(gold: str) -> list:
    """Parse a gold answer given as LaTeX with or without $...$, or as a plain number."""
    text = str(gold).strip()
    if not text:
        raise ValueError("grade_math: empty gold answer")
    parsed = []
    if "$" not in text and "\\boxed" not in text:
        # bare LaTeX (\frac{1}{2}, 2x+1) is only read as LaTeX inside math delimiters
        parsed = parse(f"${text}$", _GOLD_CONFIG, parsing_timeout=None)
    if not parsed:
        parsed = parse(text, _GOLD_CONFIG, parsing_timeout=None)
    if not parsed:
        raise ValueError(f"grade_math: could not parse gold answer {gold!r}")
    return parsed


def grade_math(response: str, gold: str) -> float:
    """1.0 if the final answer in `response` equals `gold`, else 0.0 (also when no answer); a
    whole-number gold needs a number written out, not an expression equal to it."""
    gold_parsed = parse_gold(gold)
    pred = parse(response, _PRED_CONFIG, parsing_timeout=None)
    if not pred:
        return 0.0
    if integer_gold(gold) and not is_number_literal(str(pred[-1])):
        return 0.0
    return 1.0 if verify(gold_parsed, pred, timeout_seconds=None) else 0.0

"""What counts as a final answer to a problem whose gold answer is a whole number.

What it is: `integer_gold(gold)` says whether a gold answer is a plain whole number (GSM8K,
AIME, the project's word problems), and `is_number_literal(text)` whether the answer text a grader
extracted from a response is a number written out ("33", "-5", "1,234", "33.0", "10%"), not an
expression. math-verify compares expressions symbolically, so "she has 40 - 7 stickers" equals
33 to it; a policy trained on that grader learns to restate the question's numbers and let the
grader do the arithmetic (measured: docs/measurements.md, "A real model"). Graders of whole-number
answers therefore accept only number literals (rewards/math_grader.py, data/word_problems.py).
What it is not: a parser; math-verify still reads and compares the answer.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?\d+(\.\d+)?(\\?%)?")  # a percent sign as math-verify reads it


def _plain(text: str) -> str:
    """Without thousands separators, spaces, `$` delimiters and a trailing full stop."""
    return re.sub(r"[,\s$]|\\[,!;: ]", "", str(text)).rstrip(".")


def integer_gold(gold: str) -> bool:
    return bool(_INTEGER.fullmatch(_plain(gold)))


def is_number_literal(text: str) -> bool:
    return bool(_NUMBER.fullmatch(_plain(text)))

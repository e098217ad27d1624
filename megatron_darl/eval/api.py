"""Eval role: the result type of a benchmark evaluation.

What it is: the `EvalResult` record that evaluation produces (its settings are the `eval` config
section, `config/eval.py`).
What it is not: the graders (they live in `rewards/`) or the generation backend.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalResult:
    """Accuracy of one benchmark: mean over problems of the mean (avg@k) or any (pass@k) score."""

    name: str
    num_problems: int
    avg_at_k: float
    pass_at_k: float
    k: int
    ci95: tuple[float, float] = (0.0, 0.0)  # normal-approximation interval of avg@k

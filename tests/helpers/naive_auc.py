"""The primary metric of the preregistered experiment written the slow, obvious way: a loop of
trapezoids over (sample mark, accuracy) from mark 0 to the budget, divided by the budget.

What it is: the reference the experiment tests check `experiment.prereg.auc_marks` and the
published figures against. What it is not: the library's metric (`experiment/prereg.py`)."""

from __future__ import annotations


def trapezoid_auc(marks: list[float], accuracy: list[float], budget: float) -> float:
    """Area under the piecewise-linear accuracy curve over the marks 0..budget, / budget."""
    xs = [m for m in marks if m <= budget]
    ys = accuracy[: len(xs)]
    assert xs[0] == 0 and xs[-1] == budget, f"the marks {xs} do not run from 0 to the budget {budget}"
    area = 0.0
    for i in range(1, len(xs)):
        area += (xs[i] - xs[i - 1]) * (ys[i] + ys[i - 1]) / 2
    return area / budget

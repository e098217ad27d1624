"""The published comparison (docs/results/results.json) against its own curves: every primary
figure recomputed from the runs it lists, with naive code (numpy means, scipy's paired t-test),
the per-regime tables' accuracy at the budget equal to the primary figures' means, and the design
it committed to (5 seeds a cell, a disjoint test split, a warm start selected on nothing).
What it is not: a rerun of the experiment (`scripts/compare_async.py --size budget`)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PUBLISHED = os.path.join(ROOT, "docs", "results", "results.json")


@pytest.fixture(scope="module")
def report():
    with open(PUBLISHED) as fh:
        return json.load(fh)


def _at_budget(curve: dict, budget: float) -> float:
    """Naive: the accuracy of the last evaluation whose mark is at or before the budget."""
    return [a for m, a in zip(curve["marks"], curve["accuracy"]) if m <= budget][-1]


def _first_crossing(curve: dict, target: float, budget: float) -> float:
    """Naive: walk a dense grid of the piecewise-linear curve (marks within the budget)."""
    pts = [(s, a) for m, s, a in zip(curve["marks"], curve["samples"], curve["accuracy"]) if m <= budget]
    xs, ys = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    if ys[0] >= target:
        return float(xs[0])
    for i in range(1, len(xs)):
        if ys[i] >= target:
            grid = np.linspace(xs[i - 1], xs[i], 200_001)
            hit = np.flatnonzero(np.interp(grid, xs, ys) >= target - 1e-12)
            return float(grid[hit[0]])
    return float(budget)


def _per_seed(report: dict, regime: str, method: str) -> dict[int, dict]:
    return {r["seed"]: r["curve"] for r in report["runs"] if r["regime"] == regime and r["method"] == method}


def test_the_design_is_what_the_issue_asks_for(report):
    d = report["design"]
    assert d["test_split_disjoint"] is True and d["warm_start_selected_on"] == "none"
    assert len(d["seeds"]) >= 5
    cells = [(reg, m) for reg in d["regimes"] for m in d["methods"]]
    cells += [(reg, m) for reg in d["ablation_regimes"] for m in d["ablations"]]
    for regime, method in cells:
        assert sorted(_per_seed(report, regime, method)) == sorted(d["seeds"]), (regime, method)


def test_every_primary_figure_follows_from_the_published_curves(report):
    from scipy import stats

    budget = report["design"]["budget_samples"]
    assert len(report["primary"]) == 4
    for fig in report["primary"]:
        ca, cb = _per_seed(report, fig["regime"], fig["a"]), _per_seed(report, fig["regime"], fig["b"])
        seeds = sorted(ca)
        base = np.mean([_at_budget(cb[s], budget) for s in seeds])
        if fig["metric"] == "accuracy_at_budget":
            va = np.array([_at_budget(ca[s], budget) for s in seeds])
            vb = np.array([_at_budget(cb[s], budget) for s in seeds])
        else:
            assert fig["target"] == pytest.approx(base)
            va = np.array([_first_crossing(ca[s], base, budget) for s in seeds])
            vb = np.array([_first_crossing(cb[s], base, budget) for s in seeds])
            assert fig["censored_a"] == int(np.sum(va >= budget))
            assert fig["ratio"] == pytest.approx(va.mean() / vb.mean(), rel=1e-3)
        assert fig["mean_a"] == pytest.approx(va.mean(), rel=1e-3)
        assert fig["mean_b"] == pytest.approx(vb.mean(), rel=1e-3)
        assert fig["difference"] == pytest.approx((va - vb).mean(), rel=1e-3)
        assert fig["p"] == pytest.approx(stats.ttest_rel(va, vb).pvalue, rel=1e-3)


def test_the_tables_accuracy_at_the_budget_matches_the_primary_figures(report):
    d = report["design"]
    for regime, spec in d["regimes"].items():
        (table,) = [t for key, t in report["tables"].items() if key.startswith(f"{spec['eta']}/")]
        for method in d["methods"]:
            curves = _per_seed(report, regime, method).values()
            mean = np.mean([_at_budget(c, d["budget_samples"]) for c in curves])
            assert table["rows"][method]["accuracy_at_budget"] == pytest.approx(mean), (regime, method)

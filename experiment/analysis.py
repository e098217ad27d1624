"""Statistics of the comparison: curves across seeds and the figures of each table row.

What it is: numpy and scipy.stats functions over `RunResult`s: the 95% t-interval of a mean across seeds,
curves resampled onto a shared x grid (mean and min-max band), the normalised area under the
accuracy-vs-samples curve, samples needed to reach a threshold, collapse detection, and
`cell_figures` / `eta_figures`, which turn the runs of one staleness into table rows.
What it is not: running anything (`runs.py`) or drawing (`report.py`).

Definitions (the README's Results section and docs/measurements.md quote them):
- final accuracy: the last evaluation's held-out accuracy; mean over seeds with the 95%
  t-interval of that mean (seed-to-seed spread, not the problem-sampling interval);
- AUC: mean held-out accuracy over the first X generated samples (trapezoids, curve starting at
  the warm start), X the smallest sample count any run of that eta's table reached, so every
  row integrates over the same sample budget;
- accuracy at the budget: for runs scheduled by sample marks (eval.every_samples, the budget
  size), the last evaluation whose mark is at or before X, the primary figures' definition
  (experiment/primary.py), so the tables and the primary figures agree; for step-scheduled runs,
  held-out accuracy at X (the same X as the AUC's), linear between the two evaluations around X;
- samples to 80%: generated samples of the first evaluation at which a seed's accuracy reaches
  80% of the best decoupled accuracy (the highest seed-mean accuracy either decoupled variant
  reached at that eta): a measured point, not interpolated between evaluations (an upper bound
  on the crossing, resolved to the evaluation interval); mean over the seeds that reached it,
  with how many did, and how many of those at the first evaluation (where it says nothing);
- paired tests: per seed, the difference of a figure between D-ARL and another method at the
  same setting (same warm start, seed and data); two-sided paired t-test of the mean
  difference, p-values Holm-corrected over every comparison of the report;
- collapse: a seed whose last evaluation is more than `COLLAPSE_DROP` below the warm start's
  accuracy, or that logged a non-finite loss;
- minimum ESS: the smallest per-step ESS fraction (`algo/ess_frac`) of any seed.
"""

from __future__ import annotations

import math

import numpy as np

from experiment.api import DECOUPLED, Curve, RunResult

COLLAPSE_DROP = 0.10  # accuracy points (as a fraction) below the warm start
THRESHOLD_FRAC = 0.8  # "samples to reach 80% of the best decoupled accuracy"


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with `df` degrees of freedom (scipy.stats)."""
    from scipy import stats

    return float(stats.t.ppf(0.975, df)) if df >= 1 else float("nan")


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t-interval of the mean; (v, nan, nan) for a single value."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return float("nan"), float("nan"), float("nan")
    m = float(a.mean())
    if a.size < 2:
        return m, float("nan"), float("nan")
    half = t95(a.size - 1) * float(a.std(ddof=1)) / math.sqrt(a.size)
    return m, m - half, m + half


def auc(x: list[float], y: list[float], x_max: float) -> float:
    """Mean of y over [x[0], x_max] by trapezoids (y interpolated at x_max)."""
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x_max <= xs[0]:
        return float(ys[0])
    keep = xs < x_max
    xs_c = np.append(xs[keep], x_max)
    ys_c = np.append(ys[keep], np.interp(x_max, xs, ys))
    area = float(np.sum((xs_c[1:] - xs_c[:-1]) * (ys_c[1:] + ys_c[:-1]) / 2.0))
    return area / (x_max - xs[0])


def first_reach(x: list[float], y: list[float], threshold: float) -> tuple[float, int] | None:
    """`(x[i], i)` of the first evaluation `i` whose accuracy reaches `threshold` (a measured point,
    never interpolated: between two evaluations nothing was measured); None if none does."""
    for i, v in enumerate(y):
        if v >= threshold:
            return float(x[i]), i
    return None


def accuracy_at(x: list[float], y: list[float], budget: float) -> float:
    """Accuracy at `budget` samples, linear between the evaluations around it."""
    return float(np.interp(budget, np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)))


def accuracy_at_budget(curve: Curve, budget: float) -> float:
    """Accuracy of the last evaluation at or before `budget` (by sample mark where recorded)."""
    xs = curve.marks if len(curve.marks) == len(curve.accuracy) else curve.samples
    keep = [i for i, x in enumerate(xs) if x <= budget]
    if not keep:
        raise ValueError(f"no evaluation at or before the budget {budget:g} (first at {xs[0]:g})")
    return float(curve.accuracy[keep[-1]])


def run_accuracy_at(curve: Curve, budget: float) -> float:
    """A table's accuracy at the budget: `accuracy_at_budget` where the curve has sample marks (the
    primary figures' definition), else `accuracy_at` over measured samples (step-scheduled runs)."""
    if curve.marks and len(curve.marks) == len(curve.accuracy):
        return accuracy_at_budget(curve, budget)
    return accuracy_at(curve.samples, curve.accuracy, budget)


def t_pvalue(t: float, df: int) -> float:
    """Two-sided p-value of Student's t with `df` degrees of freedom (scipy.stats)."""
    from scipy import stats

    if df < 1 or math.isnan(t):
        return float("nan")
    return float(2.0 * stats.t.sf(abs(t), df))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order; NaN stays NaN and does not count)."""
    idx = sorted((i for i, p in enumerate(pvalues) if not math.isnan(p)), key=lambda i: pvalues[i])
    out, running = [float("nan")] * len(pvalues), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (len(idx) - rank) * pvalues[i]))
        out[i] = running
    return out


def paired_test(a: dict[int, float], b: dict[int, float]) -> dict:
    """Paired t-test of `a - b` over the seeds both have (scipy.stats.ttest_rel): mean
    difference, its 95% t-interval, two-sided p (NaN under two seeds; 0 or 1 when every
    difference is the same: no spread)."""
    from scipy import stats

    seeds = sorted(set(a) & set(b))
    d = np.array([a[s] - b[s] for s in seeds], dtype=np.float64)
    mean, lo, hi = mean_interval(d.tolist())
    if d.size < 2:
        return {"seeds": len(seeds), "diff": mean, "diff_ci95": [lo, hi], "p": float("nan")}
    if float(d.std(ddof=1)) == 0.0:  # ttest_rel gives NaN without spread: a constant shift
        p = 1.0 if mean == 0 else 0.0
    else:
        p = float(stats.ttest_rel([a[s] for s in seeds], [b[s] for s in seeds]).pvalue)
    return {"seeds": len(seeds), "diff": mean, "diff_ci95": [lo, hi], "p": p}


def band(curves: list[tuple[list[float], list[float]]], points: int = 50) -> dict[str, list[float]]:
    """Curves of several seeds on one grid from 0 to the smallest last x: mean, min and max."""
    x_end = min(c[0][-1] for c in curves)
    grid = np.linspace(min(c[0][0] for c in curves), x_end, points)
    ys = np.stack([np.interp(grid, np.asarray(c[0], float), np.asarray(c[1], float)) for c in curves])
    return {"x": grid.tolist(), "mean": ys.mean(0).tolist(), "lo": ys.min(0).tolist(), "hi": ys.max(0).tolist()}


def collapsed(r: RunResult, drop: float = COLLAPSE_DROP) -> bool:
    return r.nonfinite_loss or r.final_accuracy < r.curve.accuracy[0] - drop


def best_decoupled(runs: list[RunResult]) -> float | None:
    """Highest accuracy the seed-mean curve of a decoupled variant reached (on its eval steps)."""
    best = None
    for name in DECOUPLED:
        mine = [r for r in runs if r.spec.method == name]
        if not mine:
            continue
        length = min(len(r.curve.accuracy) for r in mine)
        mean_curve = np.mean([r.curve.accuracy[:length] for r in mine], axis=0)
        best = max(best or -1.0, float(mean_curve.max()))
    return best


DRIFT = ("clip_frac", "ess_oldest", "kl_k3", "reused_frac")  # RunResult fields: means over steps


def _mean_of(runs: list[RunResult], name: str) -> float | None:
    vals = [getattr(r, name) for r in runs if getattr(r, name) is not None]
    return float(np.mean(vals)) if vals else None


def cell_figures(runs: list[RunResult], x_common: float, threshold: float | None) -> dict:
    """The table row of one (method, eta) from its seeds."""
    final = mean_interval([r.final_accuracy for r in runs])
    aucs = mean_interval([auc(r.curve.samples, r.curve.accuracy, x_common) for r in runs])
    at_budget = mean_interval([run_accuracy_at(r.curve, x_common) for r in runs])
    reach = [first_reach(r.curve.samples, r.curve.accuracy, threshold) for r in runs] if threshold is not None else []
    reached = [s for s, _ in filter(None, reach)]
    stale_mean = [r.staleness_mean for r in runs if r.staleness_mean is not None]
    stale_max = [r.staleness_max for r in runs if r.staleness_max is not None]
    ess = [r.ess_min for r in runs if r.ess_min is not None]
    return {
        "seeds": len(runs),
        "final_accuracy": final[0], "final_accuracy_ci95": [final[1], final[2]],
        "auc": aucs[0], "auc_ci95": [aucs[1], aucs[2]],
        "samples_to_threshold": float(np.mean(reached)) if reached else None,
        "reached_threshold": len(reached),
        "reached_at_first_eval": sum(i <= 1 for _, i in filter(None, reach)),
        "accuracy_at_budget": at_budget[0], "accuracy_at_budget_ci95": [at_budget[1], at_budget[2]],
        **{name: _mean_of(runs, name) for name in DRIFT},
        "collapses": sum(collapsed(r) for r in runs),
        "ess_min": min(ess) if ess else None,
        "staleness_mean": float(np.mean(stale_mean)) if stale_mean else None,
        "staleness_max": max(stale_max) if stale_max else None,
        "train_wall_s": float(np.mean([r.train_wall_s for r in runs])),
        "samples_generated": float(np.mean([r.samples_generated for r in runs])),
        "start_accuracy": float(np.mean([r.curve.accuracy[0] for r in runs])),
    }


def eta_figures(runs: list[RunResult], methods: list[str]) -> dict:
    """Rows of one eta's table (`runs` holds that eta's runs and the sync reference runs)."""
    if not runs:
        return {"threshold": None, "x_common": None, "rows": {}}
    x_common = min(r.curve.samples[-1] for r in runs)
    best = best_decoupled(runs)
    threshold = THRESHOLD_FRAC * best if best is not None else None
    rows = {}
    for name in methods:
        mine = [r for r in runs if r.spec.method == name]
        if mine:
            rows[name] = cell_figures(mine, x_common, threshold)
    return {"best_decoupled": best, "threshold": threshold, "x_common": x_common, "rows": rows}

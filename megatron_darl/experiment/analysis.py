"""Statistics of the comparison: curves across seeds and the figures of each table row.

What it is: plain numpy functions over `RunResult`s: the 95% t-interval of a mean across seeds,
curves resampled onto a shared x grid (mean and min-max band), the normalised area under the
accuracy-vs-samples curve, samples needed to reach a threshold, collapse detection, and
`cell_figures` / `eta_figures`, which turn the runs of one staleness into table rows.
What it is not: running anything (`runs.py`) or drawing (`report.py`).

Definitions (the README's Results section quotes them):
- final accuracy: the last evaluation's held-out accuracy; mean over seeds with the 95%
  t-interval of that mean (seed-to-seed spread, not the problem-sampling interval);
- AUC: mean held-out accuracy over the first X generated samples (trapezoids, curve starting at
  the warm start), X the smallest sample count any run of that eta's table reached, so every
  row integrates over the same sample budget;
- samples to 80%: generated samples at which a seed's curve first reaches 80% of the best
  decoupled accuracy (the highest seed-mean accuracy either decoupled variant reached at that
  eta), linear between evaluations; mean over the seeds that reached it, with how many did;
- collapse: a seed whose last evaluation is more than `COLLAPSE_DROP` below the warm start's
  accuracy, or that logged a non-finite loss;
- minimum ESS: the smallest per-step ESS fraction (`algo/ess_frac`) of any seed.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_darl.experiment.api import DECOUPLED, RunResult

COLLAPSE_DROP = 0.10  # accuracy points (as a fraction) below the warm start
THRESHOLD_FRAC = 0.8  # "samples to reach 80% of the best decoupled accuracy"
# two-sided 95% Student t quantiles by degrees of freedom, rounded up (Cornish-Fisher beyond 30)
_T95 = (12.7063, 4.3027, 3.1825, 2.7765, 2.5706, 2.447, 2.3647, 2.3061, 2.2622, 2.2282, 2.201, 2.1789, 2.1604,
        2.1448, 2.1315, 2.12, 2.1099, 2.101, 2.0931, 2.086, 2.0797, 2.0739, 2.0687, 2.0639, 2.0596, 2.0556, 2.0519,
        2.0485, 2.0453, 2.0423)


def t95(df: int) -> float:
    if df < 1:
        return float("nan")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


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


def first_reach(x: list[float], y: list[float], threshold: float) -> float | None:
    """Smallest x at which the piecewise-linear curve reaches `threshold`; None if it never does."""
    if y[0] >= threshold:
        return float(x[0])
    for i in range(1, len(y)):
        if y[i] >= threshold:
            frac = (threshold - y[i - 1]) / (y[i] - y[i - 1])
            return float(x[i - 1] + frac * (x[i] - x[i - 1]))
    return None


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


def cell_figures(runs: list[RunResult], x_common: float, threshold: float | None) -> dict:
    """The table row of one (method, eta) from its seeds."""
    final = mean_interval([r.final_accuracy for r in runs])
    aucs = mean_interval([auc(r.curve.samples, r.curve.accuracy, x_common) for r in runs])
    reach = [first_reach(r.curve.samples, r.curve.accuracy, threshold) for r in runs] if threshold is not None else []
    reached = [s for s in reach if s is not None]
    stale_mean = [r.staleness_mean for r in runs if r.staleness_mean is not None]
    stale_max = [r.staleness_max for r in runs if r.staleness_max is not None]
    ess = [r.ess_min for r in runs if r.ess_min is not None]
    return {
        "seeds": len(runs),
        "final_accuracy": final[0], "final_accuracy_ci95": [final[1], final[2]],
        "auc": aucs[0], "auc_ci95": [aucs[1], aucs[2]],
        "samples_to_threshold": float(np.mean(reached)) if reached else None,
        "reached_threshold": len(reached),
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

"""The sample-budget comparison's decided figures: its design and its primary tests.

What it is: the definitions the `budget` size commits to before any run (`design`,
`primary_definitions`, written into results.json at plan time), the two per-run figures, and the
tests that fill them in once the runs exist (`primary_figures`, `diagnostic_tests`):
- accuracy at the budget (`accuracy_at_budget`): test-split accuracy of the last evaluation at or
  before the budget. Evaluations are scheduled by sample marks (eval.every_samples) and the run's
  last one is labelled with the budget itself (train.max_generated_samples stops the run at the
  first step boundary at or after it): "at or before" reads the marks, so the last evaluation
  counts although the status it read showed a few samples past the budget (recorded in `samples`).
  Runs without marks (step-scheduled) read the measured samples.
- samples to the target (`samples_to_target`): the generated samples at which a run's curve first
  reaches `target` (the baseline's mean accuracy at the budget in that regime), linear between
  the last evaluation below it and the first at or above it (0 when step 0 is already there); a
  run that never reaches it within the budget is censored and given the budget, a lower bound on
  its samples (counted in `censored_a` / `censored_b`).
- a primary test: per regime, D-ARL (`a`) against the baseline (`b`) on both figures, paired by
  seed: `difference` the mean over seeds of a - b (accuracy as a fraction; samples in samples),
  its 95% t-interval (scipy.stats.t), p of the paired t-test (scipy.stats.ttest_rel), Holm over the
  primary tests only; for samples also `ratio` = mean a / mean b (the paper's sample-efficiency
  figure is 1 - ratio) with a paired bootstrap percentile interval (scipy.stats.bootstrap): the
  ratio of two skewed means.
What it is not: running anything, or the tables and plots (`report.py`).
"""

from __future__ import annotations

import math

import numpy as np

from experiment.analysis import accuracy_at_budget, holm, paired_test
from experiment.api import Curve, RunResult

METRICS = ("accuracy_at_budget", "samples_to_target")
BOOTSTRAP_RESAMPLES = 9999


def samples_to_target(curve: Curve, target: float, budget: float) -> tuple[float, bool]:
    """(samples at which the curve first reaches `target`, censored): linear between the last
    evaluation below the target and the first at or above it, over the evaluations at or before
    the budget; (budget, True) when none reaches it."""
    xs = curve.marks if len(curve.marks) == len(curve.accuracy) else curve.samples
    pts = [(s, a) for x, s, a in zip(xs, curve.samples, curve.accuracy) if x <= budget]
    for i, (s, a) in enumerate(pts):
        if a >= target:
            if i == 0:
                return float(s), False
            s0, a0 = pts[i - 1]
            return float(s0 + (target - a0) * (s - s0) / (a - a0)), False
    return float(budget), True


def design(size, warm: dict | None = None) -> dict:
    """What the comparison is, decided before the runs: the two cells of the primary tests, the
    budget, the seeds, whether the test split is disjoint from training and validation, and what
    the warm start was selected on (from its settings; `warm`, its warmstart.json, once made)."""
    settings = dict(s.split("=", 1) for s in size.settings)
    disjoint = settings.get("data.partition") == "hash"
    target = float(settings.get("demo.sft_target", 0) or 0)
    selected = "none" if target <= 0 else ("validation" if disjoint else "test")
    if warm and warm.get("sft_selected_on"):
        selected = warm["sft_selected_on"]
    return {"baseline": size.baseline, "darl": "darl", "budget_samples": size.budget, "seeds": list(size.seeds),
            "test_split_disjoint": disjoint, "warm_start_selected_on": selected,
            "accuracy": size.accuracy_eval, "eval_every_samples": size.every_samples,
            "regimes": {r.name: {"eta": r.eta, "settings": list(r.settings), "label": r.label} for r in size.regimes},
            "methods": list(size.methods), "ablations": list(size.ablations),
            "ablation_regimes": list(size.ablation_regimes), "settings": list(size.settings),
            "definitions": __doc__.split("- a primary test:")[0].split("What it is:")[1].strip()}


def primary_definitions(size) -> list[dict]:
    """The primary tests, in order: D-ARL against the baseline, per regime, on both metrics."""
    return [{"regime": r.name, "a": "darl", "b": size.baseline, "metric": m} for r in size.regimes for m in METRICS]


def _per_seed(runs: list[RunResult], method: str, regime: str, size) -> dict[int, Curve]:
    return {r.spec.seed: r.curve.scored_on(size.accuracy_eval) for r in runs
            if r.spec.method == method and r.spec.regime == regime}


def target_of(runs: list[RunResult], regime: str, size) -> float | None:
    """The baseline's mean accuracy at the budget in `regime` (None without baseline runs)."""
    base = _per_seed(runs, size.baseline, regime, size)
    return float(np.mean([accuracy_at_budget(c, size.budget) for c in base.values()])) if base else None


def compare(runs: list[RunResult], size, regime: str, a: str, b: str, metric: str) -> dict:
    """One paired comparison of `a` and `b` in `regime` on `metric` (p not corrected)."""
    ca, cb = _per_seed(runs, a, regime, size), _per_seed(runs, b, regime, size)
    out = {"regime": regime, "a": a, "b": b, "metric": metric}
    if metric == "accuracy_at_budget":
        va = {s: accuracy_at_budget(c, size.budget) for s, c in ca.items()}
        vb = {s: accuracy_at_budget(c, size.budget) for s, c in cb.items()}
    else:
        target = target_of(runs, regime, size)
        if target is None:
            return {**out, "seeds": 0, "difference": None, "ci_low": None, "ci_high": None, "p": None}
        ra = {s: samples_to_target(c, target, size.budget) for s, c in ca.items()}
        rb = {s: samples_to_target(c, target, size.budget) for s, c in cb.items()}
        va, vb = {s: v for s, (v, _) in ra.items()}, {s: v for s, (v, _) in rb.items()}
        out.update(target=target, censored_a=sum(c for _, c in ra.values()), censored_b=sum(c for _, c in rb.values()),
                   **ratio_interval(va, vb))
    t = paired_test(va, vb)
    return {**out, "seeds": t["seeds"], "mean_a": _mean(va), "mean_b": _mean(vb), "difference": t["diff"],
            "ci_low": t["diff_ci95"][0], "ci_high": t["diff_ci95"][1], "p": t["p"]}


def _mean(values: dict[int, float]) -> float | None:
    return float(np.mean(list(values.values()))) if values else None


def ratio_interval(a: dict[int, float], b: dict[int, float]) -> dict:
    """mean a / mean b over the seeds both have, with a 95% paired bootstrap percentile interval."""
    from scipy import stats

    seeds = sorted(set(a) & set(b))
    xa, xb = np.array([a[s] for s in seeds]), np.array([b[s] for s in seeds])
    if not seeds or xb.mean() <= 0:
        return {"ratio": None, "ratio_ci": [None, None]}
    ratio = float(xa.mean() / xb.mean())
    if len(seeds) < 3:
        return {"ratio": ratio, "ratio_ci": [None, None]}
    res = stats.bootstrap((xa, xb), lambda u, v, axis=-1: u.mean(axis) / np.maximum(v.mean(axis), 1e-12), paired=True,
                          vectorized=True, n_resamples=BOOTSTRAP_RESAMPLES, method="percentile", random_state=0)
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return {"ratio": ratio, "ratio_ci": [lo if math.isfinite(lo) else None, hi if math.isfinite(hi) else None]}


def baseline_gains(runs: list[RunResult], size) -> dict[str, float]:
    """Per regime, the baseline's mean over seeds of accuracy at the budget minus step 0: the
    testbed has RL signal where this reaches `size.gain_gate` (+8 points)."""
    out = {}
    for reg in size.regimes:
        base = _per_seed(runs, size.baseline, reg.name, size)
        if base:
            out[reg.name] = float(np.mean([accuracy_at_budget(c, size.budget) - c.accuracy[0] for c in base.values()]))
    return out


def primary_figures(runs: list[RunResult], size) -> list[dict]:
    """`primary_definitions` filled in from the runs, Holm-corrected over these tests only."""
    return _holm_within([compare(runs, size, d["regime"], d["a"], d["b"], d["metric"])
                         for d in primary_definitions(size)])


def _holm_within(rows: list[dict]) -> list[dict]:
    """Sets each row's `p_holm`: Holm over these rows only (one family of tests)."""
    for row, p in zip(rows, holm([math.nan if r["p"] is None else r["p"] for r in rows])):
        row["p_holm"] = None if math.isnan(p) else p
    return rows


def diagnostic_tests(runs: list[RunResult], size) -> list[dict]:
    """Every other cell against the baseline and against D-ARL, per regime and metric: not
    corrected with the primary tests; `p_holm` is Holm over the diagnostics only."""
    out = []
    for reg in size.regimes:
        cells = dict.fromkeys(r.spec.method for r in runs if r.spec.regime == reg.name)
        for m in [m for m in cells if m not in (size.baseline, "darl")]:
            out += [compare(runs, size, reg.name, m, ref, metric) for ref in (size.baseline, "darl")
                    for metric in METRICS if ref in cells]
    return _holm_within(out)

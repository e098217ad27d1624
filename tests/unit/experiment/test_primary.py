"""The budget size's decided figures against naive references: accuracy at the budget (the last
evaluation at or before it, by sample mark), samples to the target (first crossing, linear
between evaluations; checked on a dense grid), the paired t-test (t from its formula, p by
integrating Student's density), Holm over the primary tests only, the bootstrap ratio; the design
written before the runs and the budget plan's cells and overrides."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiment import primary as Q
from experiment.api import Curve, RunResult, RunSpec
from experiment.plan import SIZES, main_specs, run_overrides, with_overrides
from experiment.report_budget import DesignChanged, budget_markdown, budget_report, planned

BUDGET = SIZES["budget"].budget
EVERY = SIZES["budget"].every_samples


def _curve(acc, over=37.0):
    marks = [float(EVERY * i) for i in range(len(acc))]
    samples = [0.0] + [m + over for m in marks[1:]]  # the status read a few samples past each mark
    return Curve([10.0 * i for i in range(len(acc))], samples, [5.0 * i for i in range(len(acc))], list(acc),
                 marks, [a / 2 for a in acc])


def test_accuracy_at_budget_is_the_last_evaluation_at_or_before_it_by_mark():
    c = _curve([0.2, 0.25, 0.3, 0.35])
    assert Q.accuracy_at_budget(c, 3 * EVERY) == 0.35  # its measured samples are 37 past: the mark counts
    assert Q.accuracy_at_budget(c, 3 * EVERY - 1) == 0.3
    plain = Curve(c.steps, c.samples, c.wall_s, c.accuracy)  # no marks: measured samples
    assert Q.accuracy_at_budget(plain, 3 * EVERY) == 0.3


def test_the_tables_accuracy_at_the_budget_is_the_primary_figure_for_marked_runs():
    """The per-regime tables read the same figure as the primary tests: by mark, not interpolated
    at the smallest measured sample count (which put two values under one name in the report)."""
    from experiment.analysis import accuracy_at, run_accuracy_at

    c = _curve([0.2, 0.25, 0.3, 0.35], over=300.0)  # the last evaluation read 300 samples past its mark
    x_common = 3 * EVERY + 8
    assert run_accuracy_at(c, x_common) == Q.accuracy_at_budget(c, 3 * EVERY) == 0.35
    assert accuracy_at(c.samples, c.accuracy, x_common) < 0.35  # the old reading: between two evaluations
    plain = Curve(c.steps, c.samples, c.wall_s, c.accuracy)  # step-scheduled: interpolated, as before
    assert run_accuracy_at(plain, x_common) == pytest.approx(accuracy_at(c.samples, c.accuracy, x_common))


def _naive_crossing(samples, acc, target):
    dense = np.linspace(samples[0], samples[-1], 2_000_001)
    y = np.interp(dense, samples, acc)
    hit = np.flatnonzero(y >= target - 1e-12)
    return float(dense[hit[0]]) if len(hit) else None


@pytest.mark.parametrize("acc, target", [([0.2, 0.25, 0.4, 0.35], 0.3), ([0.2, 0.31, 0.2, 0.5], 0.3),
                                         ([0.35, 0.2, 0.4], 0.3), ([0.1, 0.2, 0.3], 0.3)])
def test_samples_to_target_is_the_first_crossing(acc, target):
    c = _curve(acc)
    got, censored = Q.samples_to_target(c, target, EVERY * (len(acc) - 1))
    assert not censored and got == pytest.approx(_naive_crossing(c.samples, acc, target), abs=0.05)


def test_a_run_that_never_reaches_the_target_is_censored_at_the_budget():
    assert Q.samples_to_target(_curve([0.2, 0.25, 0.28]), 0.3, 2 * EVERY) == (2 * EVERY, True)
    # an evaluation past the budget does not count
    assert Q.samples_to_target(_curve([0.2, 0.25, 0.5]), 0.3, EVERY) == (EVERY, True)


def _p_naive(t: float, df: int) -> float:
    x = np.linspace(0.0, abs(t), 400_001)
    logc = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    pdf = np.exp(logc - (df + 1) / 2 * np.log1p(x * x / df))
    return 1.0 - 2.0 * float(np.sum((pdf[1:] + pdf[:-1]) / 2 * np.diff(x)))


def _results(gains: dict[str, float], regimes=("gen", "stale"), seeds=5):
    out = []
    for reg in regimes:
        for m, g in gains.items():
            for s in range(seeds):
                noise = 0.01 * ((s * s + 3 * len(m) + s * len(m)) % 5)  # differs by seed and method
                acc = [0.25] + [0.25 + (g + noise) * i / 8 for i in range(1, 9)]
                out.append(RunResult(RunSpec(m, 1 if reg == "gen" else 4, 1e-4, s, regime=reg), _curve(acc), 1.0, 2.0,
                                     0.8, 100.0, False, float(BUDGET), 1.0))
    return out


def test_primary_tests_match_the_formulas_and_holm_covers_only_them():
    size = SIZES["budget"]
    runs = _results({"decoupled_areal": 0.08, "darl": 0.11, "naive_replay": 0.05})
    prim = Q.primary_figures(runs, size)
    assert [(r["regime"], r["metric"]) for r in prim] == [(g, m) for g in ("gen", "stale") for m in Q.METRICS]
    acc = prim[0]
    a = {r.spec.seed: r.curve.accuracy[-1] for r in runs if r.spec.method == "darl" and r.spec.regime == "gen"}
    b = {r.spec.seed: r.curve.accuracy[-1] for r in runs
         if r.spec.method == "decoupled_areal" and r.spec.regime == "gen"}
    d = np.array([a[s] - b[s] for s in range(5)])
    t = d.mean() / (d.std(ddof=1) / math.sqrt(5))
    assert acc["difference"] == pytest.approx(d.mean()) and acc["p"] == pytest.approx(_p_naive(t, 4), abs=1e-5)
    assert acc["ci_low"] < d.mean() < acc["ci_high"]
    ps = [r["p"] for r in prim]
    order = np.argsort(ps)
    naive = np.maximum.accumulate([min(1.0, (4 - k) * ps[i]) for k, i in enumerate(order)])
    assert [prim[i]["p_holm"] for i in order] == pytest.approx(list(naive))
    samples = prim[1]
    assert samples["target"] == pytest.approx(np.mean(list(b.values())))
    assert samples["difference"] < 0 and samples["ratio"] < 1 and samples["censored_a"] == 0
    lo, hi = samples["ratio_ci"]
    assert lo <= samples["ratio"] <= hi
    diag = Q.diagnostic_tests(runs, size)
    assert {(r["a"], r["b"]) for r in diag} == {("naive_replay", "decoupled_areal"), ("naive_replay", "darl")}
    dp = [r["p"] for r in diag]  # a family of its own: Holm over the diagnostics' p only
    dorder = np.argsort(dp)
    dnaive = np.maximum.accumulate([min(1.0, (len(dp) - k) * dp[i]) for k, i in enumerate(dorder)])
    assert [diag[i]["p_holm"] for i in dorder] == pytest.approx(list(dnaive))


def test_the_design_is_decided_before_the_runs_and_a_changed_one_is_refused():
    size = SIZES["budget"]
    doc = planned(size)
    d = doc["design"]
    assert ((d["baseline"], d["darl"], d["budget_samples"], d["seeds"])
            == ("decoupled_areal", "darl", BUDGET, [0, 1, 2, 3, 4]))
    assert d["test_split_disjoint"] is True and d["warm_start_selected_on"] == "none"  # a fixed step count
    stop = with_overrides(size, settings=(*size.settings, "demo.sft_target=0.25"))
    assert Q.design(stop)["warm_start_selected_on"] == "validation"
    assert doc["primary"] == Q.primary_definitions(size) and len(doc["primary"]) == 4
    assert Q.design(SIZES["seeds"])["warm_start_selected_on"] == "test"  # the earlier comparison's stop
    rep = budget_report(_results({"decoupled_areal": 0.08, "darl": 0.11}), size, {"sft_selected_on": "none"}, doc)
    assert rep["design"] == d and rep["sampled_primary"] and "## Primary tests" in "\n".join(budget_markdown(rep))
    # staleness: the mean over seeds of each run's mean, and the largest any run trained
    assert rep["staleness"]["stale"]["darl"] == {"mean": 1.0, "max": 2.0}
    assert "D-ARL (K = eta + 3) 1.00 (2)" in "\n".join(budget_markdown(rep))
    with pytest.raises(DesignChanged):
        budget_report([], with_overrides(size, seeds=(0, 1, 2)), None, doc)


def test_the_budget_plan_runs_every_cell_alike():
    size = SIZES["budget"]
    specs = main_specs(size, {})
    assert len(specs) == len({s.name for s in specs}) == (4 * 2 + 2) * 5
    assert {s.method for s in specs if s.regime == "stale"} == set(size.methods)
    for s in specs:
        over = run_overrides(s, size)
        eta = 1 if s.regime == "gen" else 4
        assert f"algo.max_head_offpolicyness={eta}" in over
        assert ("demo.min_step_s=0" if s.regime == "gen" else "demo.min_step_s=1.0") == over[-1]
        if s.method != "decoupled_areal":  # every replay cell: the same window, warmup and reuse order
            assert f"algo.k={eta + 3}" in over and "algo.warmup=0" in over and "algo.reuse_order=freshest" in over
    from megatron_darl.config import load_config

    cfg = load_config("configs/cpu_demo_darl.yaml", run_overrides(specs[-1], size))
    assert cfg.train.max_generated_samples == BUDGET and cfg.data.partition == "hash" and cfg.eval.sampled_k == 4


def test_the_baseline_gain_is_its_accuracy_at_the_budget_over_step_0():
    size = SIZES["budget"]
    runs = _results({"decoupled_areal": 0.08, "darl": 0.11})
    gains = Q.baseline_gains(runs, size)
    naive = np.mean([r.curve.accuracy[-1] - r.curve.accuracy[0] for r in runs
                     if r.spec.method == "decoupled_areal" and r.spec.regime == "gen"])
    assert set(gains) == {"gen", "stale"} and gains["gen"] == pytest.approx(naive) and size.gain_gate == 0.08


def test_the_report_of_a_baseline_alone_prints_dashes_not_a_crash():
    """One seed of the baseline (a probe): no D-ARL, no interval; every figure it cannot have is "-"."""
    size = with_overrides(SIZES["budget"], methods=("decoupled_areal",), seeds=(0,))
    runs = [r for r in _results({"decoupled_areal": 0.08}, seeds=1)]
    rep = budget_report(runs, size, None, planned(size))
    md = "\n".join(budget_markdown(rep))
    assert "| gen | D-ARL (K = eta + 3) | decoupled, AReaL cap 5 | accuracy at budget | - [-, -] pts" in md
    assert rep["baseline_gain"]["gen"] == pytest.approx(0.08 + 0.01 * (3 * len("decoupled_areal") % 5))

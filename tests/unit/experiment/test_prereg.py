"""The preregistered experiment's rules against naive references: the primary metric (trapezoids
by hand), phase A's choice and futility stop on crafted results, the power rule against a Monte
Carlo of the paired t-test, phase B's seeds (disjoint from phase A's) and the design's contents."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from experiment import prereg as R
from experiment.api import DARL_VARIANTS, METHODS, Curve, RunResult
from experiment.plan import SIZES, main_specs, run_overrides
from tests.helpers.naive_auc import trapezoid_auc

SIZE = SIZES["budget2"]
BUDGET, EVERY = SIZE.budget, SIZE.every_samples


def _curve(acc: list[float]) -> Curve:
    marks = [float(EVERY * i) for i in range(len(acc))]
    return Curve([10.0 * i for i in range(len(acc))], [m + 17.0 * (i > 0) for i, m in enumerate(marks)],
                 [3.0 * i for i in range(len(acc))], list(acc), marks, [a / 2 for a in acc])


def flat(level: float, start: float = 0.2) -> list[float]:
    """A curve that rises linearly from `start` to `level` over the nine marks."""
    return [start + (level - start) * i / 8 for i in range(9)]


def phase_a(levels: dict[str, dict[str, float]], size=SIZE, jitter: float = 0.004) -> list[RunResult]:
    """Every phase-A run of `size`; a cell's final level from `levels[regime][method]` (default
    0.25), plus a seed-dependent jitter."""
    out = []
    for spec in main_specs(size, {}):
        level = levels.get(spec.regime, {}).get(spec.method, 0.25) + jitter * ((spec.seed * 7 + len(spec.method)) % 5)
        out.append(RunResult(spec, _curve(flat(level)), 1.0, 2.0, 0.9, 100.0, False, float(BUDGET), 1.0))
    return out


def test_the_primary_metric_is_the_trapezoid_area_over_the_marks_by_hand():
    acc = [0.2, 0.3, 0.25, 0.35, 0.4, 0.4, 0.3, 0.5, 0.45]
    by_hand = sum(EVERY * (acc[i] + acc[i + 1]) / 2 for i in range(8)) / BUDGET
    assert R.auc_marks(_curve(acc), BUDGET) == pytest.approx(by_hand)
    assert R.auc_marks(_curve(acc + [0.9]), BUDGET) == pytest.approx(by_hand)  # past the budget: not counted
    assert R.last_three(_curve(acc), BUDGET) == pytest.approx((0.3 + 0.5 + 0.45) / 3)
    with pytest.raises(ValueError, match="do not run from 0 to the budget"):
        R.auc_marks(_curve(acc[:5]), BUDGET)  # a run short of the budget has no area over it
    with pytest.raises(ValueError, match="sample mark"):
        R.auc_marks(Curve([0.0, 1.0], [0.0, 5.0], [0.0, 1.0], [0.2, 0.3]), BUDGET)


def _auc_naive(level: float) -> float:
    """The AUC of `flat(level)` by hand: a straight line's mean is the mean of its ends."""
    return (0.2 + level) / 2


def test_the_choice_is_the_best_worst_regime_margin_over_each_regimes_best_baseline():
    levels = {"gen": {"decoupled_areal": 0.30, "naive_replay": 0.28, "darl_behav": 0.33, "darl_mixture": 0.36,
                      "darl_behav_abs": 0.305},
              "stale": {"decoupled_areal": 0.27, "naive_replay": 0.31, "darl_behav": 0.33, "darl_mixture": 0.29,
                        "darl_behav_abs": 0.34}}
    ch = R.choose(phase_a(levels, jitter=0.0), SIZE)
    assert ch["missing"] == [] and ch["best_baseline"] == {"gen": "decoupled_areal", "stale": "naive_replay"}
    # worst-regime margins by hand: behav min(.03, .02) = .02; mixture min(.06, -.02); abs min(.005, .03)
    assert ch["worst_margin"]["darl_behav"] == pytest.approx((_auc_naive(0.33) - _auc_naive(0.31)))
    assert ch["worst_margin"]["darl_mixture"] == pytest.approx(_auc_naive(0.29) - _auc_naive(0.31))
    assert ch["chosen"] == "darl_behav" and ch["futile"] is False  # not mixture, the best in one regime only


def test_ties_go_to_the_earlier_variant_and_a_missing_run_decides_nothing():
    ch = R.choose(phase_a({}, jitter=0.0), SIZE)  # every cell equal: margins 0 > -0.5 points
    assert ch["chosen"] == DARL_VARIANTS[0] and not ch["futile"]
    runs = [r for r in phase_a({}) if not (r.spec.method == "darl_mixture" and r.spec.seed == 3
                                           and r.spec.regime == "stale")]
    ch = R.choose(runs, SIZE)
    assert ch["chosen"] is None and ch["futile"] is None and ch["missing"] == ["stale_darl_mixture_s3"]


def test_the_futility_stop_applies_when_no_variant_is_above_the_bound_in_both_regimes():
    worse = {reg: {v: 0.25 - 0.011 for v in DARL_VARIANTS} for reg in ("gen", "stale")}  # -0.55 points AUC
    ch = R.choose(phase_a(worse, jitter=0.0), SIZE)
    assert ch["futile"] is True and ch["chosen"] is None
    assert max(ch["worst_margin"].values()) == pytest.approx(-0.0055)
    worse["gen"]["darl_behav_tokens"] = 0.25 + 0.02  # better in one regime only: still futile
    assert R.choose(phase_a(worse, jitter=0.0), SIZE)["futile"] is True
    worse["stale"]["darl_behav_tokens"] = 0.25 - 0.009  # -0.45 points: above the bound
    ch = R.choose(phase_a(worse, jitter=0.0), SIZE)
    assert ch["futile"] is False and ch["chosen"] == "darl_behav_tokens"
    assert SIZE.prereg.futility_margin == -0.005


def _power_mc(n: int, effect: float, sd: float, alpha: float, reps: int = 200_000) -> float:
    """Naive: simulate n normal paired differences, run scipy's one-sample t-test on each draw."""
    from scipy import stats

    d = np.random.default_rng(n).normal(effect, sd, (reps, n))
    return float(np.mean(stats.ttest_1samp(d, 0.0, axis=1).pvalue < alpha))


@pytest.mark.parametrize("sd", [0.009, 0.013, 0.02])
def test_the_power_rule_against_a_simulated_paired_t_test_and_a_hand_bound(sd):
    from scipy import stats

    pre = SIZE.prereg
    n, power = R.seed_count(sd, pre, tests=2)
    alpha = pre.alpha / 2
    assert power == pytest.approx(R.power_paired(n, pre.effect, sd, alpha))
    assert R.power_paired(n, pre.effect, sd, alpha) == pytest.approx(_power_mc(n, pre.effect, sd, alpha), abs=0.005)
    if n < pre.phase_b_max_seeds:
        assert power >= 0.8 and (n == pre.phase_b_min_seeds or _power_mc(n - 1, pre.effect, sd, alpha) < 0.8)
    else:
        assert power < 0.8 or R.power_paired(n - 1, pre.effect, sd, alpha) < 0.8
    # by hand: the normal approximation ((z_{1-a/2} + z_{power}) sd / effect)^2 is a lower bound (t has fatter tails)
    z = stats.norm.ppf
    assert n >= min(math.ceil(((z(1 - alpha / 2) + z(0.8)) * sd / pre.effect) ** 2), pre.phase_b_max_seeds)


def test_phase_b_seeds_come_after_phase_a_and_its_cells_are_the_choice():
    levels = {"gen": {"darl_behav": 0.32}, "stale": {"darl_behav": 0.30, "naive_replay": 0.28}}
    runs = phase_a(levels)
    ch = R.choose(runs, SIZE)
    plan = R.phase_b_plan(runs, SIZE, ch)
    sds = {}
    for reg in ("gen", "stale"):
        a = {r.spec.seed: _trap(r) for r in runs if r.spec.regime == reg and r.spec.method == ch["chosen"]}
        b = {r.spec.seed: _trap(r) for r in runs if r.spec.regime == reg and r.spec.method == ch["best_baseline"][reg]}
        sds[reg] = np.std([a[s] - b[s] for s in range(5)], ddof=1)
    assert plan["paired_sd"] == pytest.approx(sds) and plan["sd"] == pytest.approx(max(sds.values()))
    assert plan["n_seeds"] == R.seed_count(max(sds.values()), SIZE.prereg, 2)[0]
    assert plan["seeds"] == list(range(5, 5 + plan["n_seeds"])) and not set(plan["seeds"]) & set(SIZE.seeds)
    specs = R.phase_b_specs(SIZE, plan)
    assert {(s.regime, s.method) for s in specs} == {("gen", "darl_behav"), ("gen", ch["best_baseline"]["gen"]),
                                                     ("stale", "darl_behav"), ("stale", "naive_replay")}
    assert {s.seed for s in specs} == set(plan["seeds"])
    assert not {s.name for s in specs} & {s.name for s in main_specs(SIZE, {})}


def _trap(r: RunResult) -> float:
    return trapezoid_auc(r.curve.marks, r.curve.accuracy, BUDGET)


def test_the_design_names_phases_seeds_rules_and_every_variant_override():
    d = R.design(SIZE)
    assert d["phases"]["A"]["seeds"] == [0, 1, 2, 3, 4] and d["phases"]["B"]["first_seed"] == 5
    assert set(d["phases"]["A"]["candidates"]) == set(DARL_VARIANTS) and len(DARL_VARIANTS) == 5
    assert "worst-regime margin" in d["rules"] and "noncentral t" in d["rules"] and "futility" in d["rules"]
    assert "trapezoids" in d["primary_metric"] and d["futility_margin"] == -0.005 and d["effect"] == 0.014
    over = {m: set(c["overrides"]) for m, c in d["cells"].items()}
    for c in d["cells"].values():  # each key once: the design reads as the run's config
        assert len({o.split("=", 1)[0] for o in c["overrides"]}) == len(c["overrides"])
    assert {"algo.trust_anchor=behavior"} <= over["darl_behav"]
    assert {"algo.trust_anchor=behavior", "algo.pmis_beta=tokens"} <= over["darl_behav_tokens"]
    assert {"algo.trust_anchor=mixture", "algo.pmis_beta=balance"} <= over["darl_mixture"]
    assert {"algo.trust_anchor=behavior", "algo.sg_tau_abs=0.04"} <= over["darl_behav_abs"]
    assert {"algo.trust_anchor=behavior", "algo.sg=false"} <= over["darl_behav_nosel"]
    assert "algo.sg_new_first=false" in over["darl"] and not any("sg_new_first" in o for v in DARL_VARIANTS
                                                                  for o in over[v])
    assert d["cells"]["decoupled_hi_lr"]["lr"] == 2e-4 and d["cells"]["decoupled_areal"]["lr"] == 1e-4
    assert {"naive", "decoupled_areal", "naive_replay", "decoupled_replay", "darl"} <= set(d["cells"])
    assert d["phases"]["secondary"]["task"] == ["data.dataset_kwargs.min_digits=3", "data.dataset_kwargs.max_digits=3"]


def test_every_phase_a_cell_runs_at_its_rate_and_the_variants_at_darls_depth():
    for spec in main_specs(SIZE, {}):
        over = run_overrides(spec, SIZE)
        assert f"optim.lr={METHODS[spec.method].lr or 1e-4}" in over
        if spec.method in DARL_VARIANTS:
            assert f"algo.k={spec.eta + 3}" in over
    assert R.check(SIZE) == [] and SIZE.check() == []
    bad = replace(SIZE, prereg=replace(SIZE.prereg, phase_b_first_seed=4))
    assert any("phase B's first seed 4" in e for e in bad.check())

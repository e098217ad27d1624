"""The preregistered two-phase experiment: its design, choice rule, futility stop and power rule.

What it is: `Prereg`, the decisions fixed before any run (the D-ARL variants phase A chooses
from, the baselines, phase B's first seed, the futility bound, the effect phase B is powered
for, the second task); the primary metric `auc_marks` (area under the greedy test-accuracy curve
over the scheduled sample marks 0..budget, trapezoids, divided by the budget) and the secondary
`last_three`; `choose` (phase A's choice and futility stop); `power_paired` and `phase_b_plan`
(phase B's seed count from phase A's paired spread); `phase_b_specs` / `secondary_specs` (the
runs of the later phases); and `design`, the document results.json holds before the first run.

The rules, as `design` writes them:
- choice: per regime, the best baseline is the baseline with the highest phase-A mean AUC; a
  variant's margin in a regime is its mean AUC minus that best baseline's; the variant with the
  largest worst-regime margin is chosen (ties: the earlier in `candidates`);
- futility: when no variant's worst-regime margin is above `futility_margin` (-0.5 points),
  phase A is published as a negative result and phase B does not run. Phase A's margin has a
  standard error of about 0.55 points (the published budget runs' paired AUC spread, 0.8-1.3
  points, over 5 seeds): a variant whose true margin is the +1.4 points phase B is powered for
  shows a margin at or below -0.5 points with probability under 1%, and a variant at or below it
  is unlikely to be +1.4 points ahead (taking the best of five baselines biases the margin down
  by a fraction of a point, not by two);
- power: n is the smallest seed count in [`phase_b_min_seeds`, `phase_b_max_seeds`] (5 to 20) at
  which the two-sided paired t-test at level a = alpha / (number of regimes) (Holm's first step,
  so each regime's test keeps the power on its own) rejects with probability >= `power` (0.8)
  when the true mean difference is `effect` (1.4 points) and the SD of the paired differences is
  the largest over regimes of phase A's (chosen variant minus best baseline, ddof 1):
  power(n) = P(|T| > t_{1 - a/2, n - 1}), T noncentral t with n - 1 degrees of freedom and
  noncentrality effect * sqrt(n) / SD; the largest count, its power recorded, when none reaches it.
What it is not: running anything (`prereg_run.py`) or phase B's figures (`prereg_report.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from experiment.api import METHODS, Curve, RunResult, RunSpec

PRIMARY_METRIC = ("area under the greedy test-accuracy curve over the scheduled sample marks 0..budget (trapezoids "
                  "between evaluations, divided by the budget); each run's curve must hold every mark")
PUBLISHED_RERUN = ("The published cells (decoupled, naive + replay, decoupled + replay, D-ARL) are rerun, not reused: "
                   "the learner's optimizer step and D-ARL's selection changed in the same release, so the published "
                   "runs are not this code's; the published D-ARL keeps its selection (algo.sg_new_first=false), the "
                   "variants take the one that never lets a reused group displace a never-trained group.")
SECONDARY_METRICS = ("accuracy_at_budget", "last_three", "samples_to_target", "sampled_auc")


@dataclass(frozen=True)
class Prereg:
    """The decisions of the two-phase experiment fixed before any run (see the module's rules)."""

    candidates: tuple[str, ...]  # the D-ARL variants phase A chooses one from
    baselines: tuple[str, ...]  # each regime's best baseline is chosen among these
    references: tuple[str, ...] = ()  # cells phase A runs for the diagnostics only (the published D-ARL)
    phase_b_first_seed: int = 5
    futility_margin: float = -0.005  # a variant's worst-regime AUC margin must exceed it (fraction)
    effect: float = 0.014  # phase B is powered for this AUC difference (fraction: 1.4 points)
    power: float = 0.8
    alpha: float = 0.05  # family-wise, Holm over the regimes
    phase_b_min_seeds: int = 5
    phase_b_max_seeds: int = 20
    secondary_task: tuple[str, ...] = ()  # the overrides that make the second task
    secondary_label: str = ""
    secondary_gate: float = 0.08  # the no-replay baseline's mean gain there, per regime, to run the rest
    default_rule: str = ""  # what the outcome changes in the project's defaults ("": nothing preregistered)
    question: str = ""  # the question the experiment answers, as preregistered ("": budget2's, in its docs)
    cells_note: str = ""  # what the design says of its cells' provenance ("": budget2's `PUBLISHED_RERUN`)


def auc_marks(curve: Curve, budget: float) -> float:
    """The primary metric: trapezoids over (mark, accuracy) for the marks 0..budget, / budget."""
    if len(curve.marks) != len(curve.accuracy):
        raise ValueError("auc_marks: the curve has no sample mark at every evaluation (eval.every_samples)")
    pts = [(m, a) for m, a in zip(curve.marks, curve.accuracy) if m <= budget]
    if not pts or pts[0][0] != 0 or pts[-1][0] != budget:
        raise ValueError(f"auc_marks: the marks {[p[0] for p in pts]} do not run from 0 to the budget {budget:g}")
    area = sum((x1 - x0) * (y0 + y1) / 2.0 for (x0, y0), (x1, y1) in zip(pts, pts[1:]))
    return float(area / budget)


def last_three(curve: Curve, budget: float) -> float:
    """Mean accuracy of the last three evaluations at or before the budget (by mark)."""
    xs = curve.marks if len(curve.marks) == len(curve.accuracy) else curve.samples
    acc = [a for x, a in zip(xs, curve.accuracy) if x <= budget]
    return float(np.mean(acc[-3:]))


def cell_aucs(results: list[RunResult], regime: str, method: str, budget: float,
              seeds: tuple[int, ...] | list[int] | None = None) -> dict[int, float]:
    """{seed: primary metric} of one cell (restricted to `seeds` when given)."""
    return {r.spec.seed: auc_marks(r.curve, budget) for r in results
            if r.spec.regime == regime and r.spec.method == method and (seeds is None or r.spec.seed in seeds)}


def choose(results: list[RunResult], size) -> dict:
    """Phase A's decision from its runs: the best baseline per regime, every variant's margins,
    the chosen variant and whether the futility stop applies. With any candidate or baseline run
    of phase A missing, nothing is decided (`missing` names them)."""
    pre, seeds = size.prereg, tuple(size.seeds)
    cells = (*pre.baselines, *pre.candidates)
    aucs = {reg.name: {m: cell_aucs(results, reg.name, m, size.budget, seeds) for m in cells} for reg in size.regimes}
    missing = [f"{reg}_{m}_s{s}" for reg, per in aucs.items() for m in cells for s in seeds if s not in per[m]]
    out = {"missing": missing, "chosen": None, "futile": None, "futility_margin": pre.futility_margin}
    if missing:
        return out
    means = {reg: {m: float(np.mean([v[s] for s in seeds])) for m, v in per.items()} for reg, per in aucs.items()}
    best = {reg: max(pre.baselines, key=lambda m: per[m]) for reg, per in means.items()}  # ties: the earlier
    margins = {v: {reg: means[reg][v] - means[reg][best[reg]] for reg in means} for v in pre.candidates}
    worst = {v: min(m.values()) for v, m in margins.items()}
    top = max(pre.candidates, key=lambda v: worst[v])
    futile = worst[top] <= pre.futility_margin
    return {**out, "mean_auc": means, "best_baseline": best, "margins": margins, "worst_margin": worst,
            "chosen": None if futile else top, "futile": futile}


def power_paired(n: int, effect: float, sd: float, alpha: float) -> float:
    """Power of the two-sided paired t-test at level `alpha` with `n` pairs, true mean difference
    `effect` and SD `sd` of the differences (noncentral t)."""
    from scipy import stats

    if n < 2:
        return 0.0
    if sd <= 0:
        return 1.0
    df, nc = n - 1, effect * math.sqrt(n) / sd
    crit = float(stats.t.ppf(1.0 - alpha / 2.0, df))
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))


def seed_count(sd: float, pre: Prereg, tests: int) -> tuple[int, float]:
    """(n, power at n): the power rule's smallest n in [min, max] with enough power, else the max."""
    alpha = pre.alpha / tests
    for n in range(pre.phase_b_min_seeds, pre.phase_b_max_seeds + 1):
        p = power_paired(n, pre.effect, sd, alpha)
        if p >= pre.power:
            return n, p
    return pre.phase_b_max_seeds, power_paired(pre.phase_b_max_seeds, pre.effect, sd, alpha)


def phase_b_plan(results: list[RunResult], size, choice: dict) -> dict:
    """Phase B's design from phase A (written into results.json before its first run): the chosen
    variant, each regime's best baseline, phase A's paired SD per regime, the seed count and seeds."""
    pre, seeds = size.prereg, tuple(size.seeds)
    sds = {}
    for reg in size.regimes:
        a = cell_aucs(results, reg.name, choice["chosen"], size.budget, seeds)
        b = cell_aucs(results, reg.name, choice["best_baseline"][reg.name], size.budget, seeds)
        sds[reg.name] = float(np.std([a[s] - b[s] for s in seeds], ddof=1))
    sd = max(sds.values())
    n, power = seed_count(sd, pre, len(size.regimes))
    first = pre.phase_b_first_seed
    return {"chosen": choice["chosen"], "best_baseline": dict(choice["best_baseline"]), "paired_sd": sds, "sd": sd,
            "alpha_per_test": pre.alpha / len(size.regimes), "effect": pre.effect, "n_seeds": n,
            "power": power, "reaches_power": power >= pre.power, "seeds": list(range(first, first + n))}


def phase_b_specs(size, plan: dict) -> list[RunSpec]:
    """Phase B's runs: per regime, its best baseline and the chosen variant, on phase B's seeds."""
    g = size.grid()[0]
    return [RunSpec(m, reg.eta, METHODS[m].lr or g.lr, s, g.minibatches, regime=reg.name) for reg in size.regimes
            for m in dict.fromkeys((plan["best_baseline"][reg.name], plan["chosen"])) for s in plan["seeds"]]


def secondary_specs(size, plan: dict, regimes: list[str] | None = None) -> list[RunSpec]:
    """The second task's runs on phase B's seeds: the no-replay baseline (the gate) in every
    regime when `regimes` is None; else, in `regimes` (those the gate passed), the chosen variant
    and that regime's best baseline."""
    g = size.grid()[0]
    out = []
    for reg in size.regimes:
        if regimes is None:
            cells: tuple[str, ...] = (size.baseline,)
        elif reg.name in regimes:
            cells = tuple(dict.fromkeys((plan["best_baseline"][reg.name], plan["chosen"])))
        else:
            continue
        out += [RunSpec(m, reg.eta, METHODS[m].lr or g.lr, s, g.minibatches, regime=reg.name) for m in cells
                for s in plan["seeds"]]
    return out


def design(size) -> dict:
    """What results.json holds before the first run: phases and their seeds, the rules, the
    metrics, every cell's overrides and learning rate, the regimes, the budget and the settings."""
    pre = size.prereg
    doc = __doc__.split("The rules, as `design` writes them:")[1].split("What it is not:")[0]
    rate = size.grid()[0].lr
    return {
        "kind": "preregistered two-phase", "budget_samples": size.budget, "eval_every_samples": size.every_samples,
        "regimes": {r.name: {"eta": r.eta, "settings": list(r.settings), "label": r.label} for r in size.regimes},
        "settings": list(size.settings), "primary_metric": PRIMARY_METRIC, "secondary_metrics": list(SECONDARY_METRICS),
        "phases": {
            "A": {"seeds": list(size.seeds), "cells": list(size.methods), "candidates": list(pre.candidates),
                  "baselines": list(pre.baselines), "references": list(pre.references)},
            "B": {"first_seed": pre.phase_b_first_seed, "seeds_min": pre.phase_b_min_seeds,
                  "seeds_max": pre.phase_b_max_seeds, "cells": "the chosen variant and each regime's best baseline",
                  "test": "paired t over seeds on the primary metric, two-sided, Holm over the regimes"},
            "secondary": {"task": list(pre.secondary_task), "label": pre.secondary_label, "gate": pre.secondary_gate,
                          "gate_cell": size.baseline, "seeds": "phase B's",
                          "test": "as phase B's, Holm over the regimes the gate passed"}},
        "published_cells": pre.cells_note or PUBLISHED_RERUN, "rules": " ".join(doc.split()),
        "futility_margin": pre.futility_margin,
        "effect": pre.effect, "power": pre.power, "alpha": pre.alpha, "gain_gate": size.gain_gate,
        "baseline": size.baseline,
        "cells": {m: {"label": METHODS[m].label, "overrides": list(METHODS[m].overrides),
                      "lr": METHODS[m].lr or rate, "replay_depth": METHODS[m].depth} for m in size.methods},
        # only where set: budget2's design, written before these fields, stays what it was
        **({"question": pre.question} if pre.question else {}),
        **({"default_rule": pre.default_rule} if pre.default_rule else {}),
    }


def check(size) -> list[str]:
    """What is wrong with a size's preregistration (empty when nothing)."""
    pre = size.prereg
    errs = [f"prereg: {m!r} is not among the size's methods" for m in (*pre.candidates, *pre.baselines,
                                                                       *pre.references) if m not in size.methods]
    if pre.phase_b_first_seed <= max(size.seeds):
        errs.append(f"prereg: phase B's first seed {pre.phase_b_first_seed} must come after phase A's {size.seeds}")
    if not 2 <= pre.phase_b_min_seeds <= pre.phase_b_max_seeds:
        errs.append("prereg: phase B needs 2 <= phase_b_min_seeds <= phase_b_max_seeds")
    if size.baseline not in pre.baselines:
        errs.append(f"prereg: the gate's baseline {size.baseline!r} must be one of the baselines")
    return errs

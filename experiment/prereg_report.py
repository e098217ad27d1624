"""The preregistered two-phase experiment's figures: phase A's table, phase B's tests, the second task.

What it is: `phase_a_table` (per regime and cell: mean primary metric with its 95% t-interval
and its range over phase A's seeds, the secondary figures, and the replay totals: groups evicted
untrained and groups filtered, None where a run did not log them), `phase_a_cost` (per regime,
the runs' own wall time and load), `primary_figures` (phase B: the chosen variant against each
regime's best baseline on the primary metric, paired by seed: difference, 95% t-interval, p of
the paired t-test, Holm over the regimes), `secondary_figures` (the same pairs on accuracy at the
budget, the mean of the last three evaluations, samples to the target and the sampled curve's
AUC, Holm over these only), `secondary_family` (the second task: its gate and its tests),
`phase_a_contrasts` (phase A's exploratory pairs: every variant against each regime's best
baseline and what each single change did, paired by seed, not preregistered and not corrected),
`prereg_markdown` and `plot_phase_a` (each regime's cells, mean over phase A's seeds against the
sample marks).
What it is not: the rules themselves (`prereg.py`) or running anything (`prereg_run.py`).
"""

from __future__ import annotations

import math
import os

import numpy as np

from experiment.analysis import accuracy_at_budget, holm, mean_interval, paired_test
from experiment.api import METHODS, RunResult
from experiment.prereg import SECONDARY_METRICS, auc_marks, last_three
from experiment.primary import samples_to_target


def _per_seed(results: list[RunResult], regime: str, method: str, seeds) -> dict[int, object]:
    return {r.spec.seed: r for r in results if r.spec.regime == regime and r.spec.method == method
            and r.spec.seed in seeds}


def _figure(metric: str, budget: float, target: float | None = None):
    """The per-run figure of `metric` (a function of a RunResult)."""
    return {"auc": lambda r: auc_marks(r.curve, budget),
            "accuracy_at_budget": lambda r: accuracy_at_budget(r.curve, budget),
            "last_three": lambda r: last_three(r.curve, budget),
            "samples_to_target": lambda r: samples_to_target(r.curve, target, budget)[0],
            "sampled_auc": lambda r: auc_marks(r.curve.scored_on("sampled"), budget)}[metric]


def paired_row(results: list[RunResult], size, regime: str, pair: tuple[str, str], metric: str, seeds) -> dict:
    """`pair` = (a, b) compared on `metric` in `regime` over `seeds`, paired by seed (p not corrected)."""
    a, b = pair
    ra, rb = _per_seed(results, regime, a, seeds), _per_seed(results, regime, b, seeds)
    out = {"regime": regime, "a": a, "b": b, "metric": metric}
    target = None
    if metric == "samples_to_target":
        if not rb:
            return {**out, "seeds": 0, "difference": None, "ci_low": None, "ci_high": None, "p": None}
        target = float(np.mean([accuracy_at_budget(r.curve, size.budget) for r in rb.values()]))
        out["target"] = target
    fn = _figure(metric, size.budget, target)
    va, vb = {s: fn(r) for s, r in ra.items()}, {s: fn(r) for s, r in rb.items()}
    t = paired_test(va, vb)
    return {**out, "seeds": t["seeds"], "mean_a": float(np.mean(list(va.values()))) if va else None,
            "mean_b": float(np.mean(list(vb.values()))) if vb else None, "difference": t["diff"],
            "ci_low": t["diff_ci95"][0], "ci_high": t["diff_ci95"][1], "p": t["p"]}


def _holm_within(rows: list[dict]) -> list[dict]:
    for row, p in zip(rows, holm([math.nan if r["p"] is None or r["p"] != r["p"] else r["p"] for r in rows])):
        row["p_holm"] = None if math.isnan(p) else p
    return rows


def primary_figures(results: list[RunResult], size, plan: dict) -> list[dict]:
    """Phase B: per regime, the chosen variant minus its best baseline on the primary metric."""
    return _holm_within([paired_row(results, size, reg.name, (plan["chosen"], plan["best_baseline"][reg.name]),
                                    "auc", plan["seeds"]) for reg in size.regimes])


def secondary_figures(results: list[RunResult], size, plan: dict) -> list[dict]:
    """Phase B's pairs on every secondary metric (Holm over these rows only)."""
    return _holm_within([paired_row(results, size, reg.name, (plan["chosen"], plan["best_baseline"][reg.name]),
                                    metric, plan["seeds"]) for reg in size.regimes for metric in SECONDARY_METRICS])


def gate_gains(results: list[RunResult], size, seeds) -> dict[str, float]:
    """Per regime, the no-replay baseline's mean accuracy at the budget minus step 0."""
    out = {}
    for reg in size.regimes:
        runs = _per_seed(results, reg.name, size.baseline, seeds)
        if runs:
            out[reg.name] = float(np.mean([accuracy_at_budget(r.curve, size.budget) - r.curve.accuracy[0]
                                           for r in runs.values()]))
    return out


def secondary_family(results: list[RunResult], size, plan: dict) -> dict:
    """The second task: the gate per regime and, where it passed, the primary test (Holm over those)."""
    gains = gate_gains(results, size, plan["seeds"])
    passed = [reg for reg, g in gains.items() if g >= size.prereg.secondary_gate]
    rows = _holm_within([paired_row(results, size, reg, (plan["chosen"], plan["best_baseline"][reg]), "auc",
                                    plan["seeds"]) for reg in passed])
    return {"gate_gain": gains, "gate": size.prereg.secondary_gate, "passed": passed, "tests": rows}


# Phase A's contrasts beyond the choice: (a, b, what a - b changes). Not preregistered and not
# corrected for multiplicity: they describe phase A's five seeds. The variants' margins over the
# best baseline are biased down, since that baseline is picked on the same runs.
CONTRASTS = (
    ("darl_behav", "darl", "clip anchor (behavior vs proximal) and new-first selection, D-ARL"),
    ("darl_behav", "darl_behav_nosel", "selection, behavior-anchored D-ARL"),
    ("darl_behav_tokens", "darl_behav", "beta = tokens vs beta = ESS, behavior-anchored D-ARL"),
    ("darl_mixture", "darl_behav", "clip against the balance mixture vs each sample's behavior policy"),
    ("darl_behav_abs", "darl_behav", "absolute gate 0.04 vs the quantile threshold"),
    ("darl_behav_nosel", "naive_replay", "D-ARL's weights and per-version objective vs naive PPO, both replaying"),
    ("naive_replay", "naive", "replay, naive async"),
    ("decoupled_replay", "decoupled_areal", "replay, decoupled PPO"),
    ("naive", "decoupled_areal", "clip anchor (behavior vs proximal) without replay"),
    ("naive_replay", "decoupled_replay", "clip anchor (behavior vs proximal) with replay"),
    ("decoupled_hi_lr", "decoupled_areal", "lr 2e-4 vs 1e-4, decoupled PPO without replay"),
)


def phase_a_contrasts(results: list[RunResult], size, choice: dict) -> list[dict]:
    """Phase A, on the primary metric, paired by seed (p not corrected): every variant and reference
    against each regime's best baseline (once phase A chose it), then `CONTRASTS`."""
    seeds, rows = tuple(size.seeds), []
    best = choice.get("best_baseline") or {}
    own = [c for c in CONTRASTS if c[0] in size.methods and c[1] in size.methods]
    for reg in size.regimes:
        against = [(v, best[reg.name], "against the best baseline") for v in (*size.prereg.candidates,
                                                                               *size.prereg.references)
                   if reg.name in best]
        for a, b, what in against + own:
            row = paired_row(results, size, reg.name, (a, b), "auc", seeds)
            if row["seeds"] >= 2:
                rows.append({**row, "contrast": what})
    return rows


def _mean_known(values: list) -> float | None:
    """Mean over runs, None when any run did not log the figure (unknown, not 0)."""
    return None if not values or any(v is None for v in values) else float(np.mean(values))


def phase_a_table(results: list[RunResult], size) -> dict[str, dict[str, dict]]:
    """Per regime and cell, phase A's figures over its seeds."""
    out: dict[str, dict[str, dict]] = {}
    for reg in size.regimes:
        for m in size.methods:
            runs = list(_per_seed(results, reg.name, m, size.seeds).values())
            if not runs:
                continue
            aucs = [auc_marks(r.curve, size.budget) for r in runs]
            mean, lo, hi = mean_interval(aucs)
            out.setdefault(reg.name, {})[m] = {
                "seeds": len(runs), "auc": mean, "auc_ci95": [lo, hi], "auc_range": [min(aucs), max(aucs)],
                "accuracy_at_budget": float(np.mean([accuracy_at_budget(r.curve, size.budget) for r in runs])),
                "last_three": float(np.mean([last_three(r.curve, size.budget) for r in runs])),
                "evicted_untrained": _mean_known([r.evicted_untrained for r in runs]),
                "filtered_groups": _mean_known([r.filtered_groups for r in runs]),
                "clip_frac_behavior": _mean_known([r.clip_frac_behavior for r in runs]),
                "reused_frac": _mean_known([r.reused_frac for r in runs]),
                "ess_min": _mean_known([r.ess_min for r in runs]), "kl_k3": _mean_known([r.kl_k3 for r in runs])}
            mism = {k: _mean_known([getattr(r, k) for r in runs])
                    for k in ("mismatch_abs_mean", "mismatch_kl", "mismatch_clip_frac")}
            out[reg.name][m].update({k: v for k, v in mism.items() if v is not None})  # budget2's: none logged
    return out


def phase_a_cost(results: list[RunResult], size) -> dict[str, dict]:
    """Per regime, what phase A's runs cost where they ran: their count, their own wall time in
    all (hours), the median and range of a run's (seconds), and the median 1-minute load average
    at a run's end; None where no run recorded its cost."""
    out = {}
    for reg in size.regimes:
        costs = [r.run_cost for r in results if r.spec.regime == reg.name and r.spec.seed in size.seeds
                 and r.run_cost]
        if costs:
            wall = [c["wall_s"] for c in costs]
            out[reg.name] = {"runs": len(costs), "wall_h": sum(wall) / 3600.0, "wall_s_median": float(np.median(wall)),
                             "wall_s_range": [min(wall), max(wall)],
                             "load1_median": float(np.median([c["load1"] for c in costs]))}
    return out


def _pts(v, scale: float = 100.0, fmt: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(scale * v, fmt)


def _test_lines(rows: list[dict], contrast: bool = False) -> list[str]:
    """A table of paired rows; `contrast`: what a - b changes in place of the metric, and no Holm."""
    head = "| regime | a | b | changes | a - b [95% CI] | means | seeds | p |" if contrast else \
        "| regime | a | b | metric | a - b [95% CI] | means | seeds | p | p Holm |"
    out = [head, "|---" * (8 if contrast else 9) + "|"]
    for r in rows:
        scale = 1.0 if r["metric"] == "samples_to_target" else 100.0
        fmt = "+.0f" if scale == 1.0 else "+.2f"
        lo, hi = _pts(r["ci_low"], scale, fmt), _pts(r["ci_high"], scale, fmt)
        diff = f"{_pts(r['difference'], scale, fmt)} [{lo}, {hi}]"
        means = f"{_pts(r.get('mean_a'), scale, fmt[1:])} vs {_pts(r.get('mean_b'), scale, fmt[1:])}"
        what = r["contrast"] if contrast else r["metric"]
        row = (f"| {r['regime']} | {METHODS[r['a']].label} | {METHODS[r['b']].label} | {what} | {diff} | {means} "
               f"| {r['seeds']} | {_pts(r['p'], 1, '.3f')} |")
        out.append(row if contrast else f"{row} {_pts(r.get('p_holm'), 1, '.3f')} |")
    return [*out, ""]


def _phase_a_lines(rep: dict) -> list[str]:
    out = []
    for reg, cells in (rep.get("phase_a") or {}).items():
        mism = any("mismatch_abs_mean" in c for c in cells.values())  # budget2's runs did not log it
        extra = " mismatch \\|b - p\\| | clipped at lr 0 |" if mism else ""
        out += [f"### Phase A, {reg}", "", "| cell | AUC % [95% CI] | seed range | at budget % | last three % "
                f"| evicted untrained | filtered groups | clip frac vs mu | reused share |{extra}",
                "|---" * (11 if mism else 9) + "|"]
        for m, c in cells.items():
            lo, hi = c["auc_ci95"]
            low, high = c["auc_range"]
            row = (f"| {METHODS[m].label} | {_pts(c['auc'])} [{_pts(lo)}, {_pts(hi)}] | {_pts(low)}-{_pts(high)} "
                   f"| {_pts(c['accuracy_at_budget'])} | {_pts(c['last_three'])} "
                   f"| {_pts(c['evicted_untrained'], 1, '.0f')} | {_pts(c['filtered_groups'], 1, '.0f')} "
                   f"| {_pts(c['clip_frac_behavior'], 1, '.3f')} | {_pts(c['reused_frac'], 1, '.2f')} |")
            if mism:
                row += (f" {_pts(c.get('mismatch_abs_mean'), 1, '.2g')} |"
                        f" {_pts(c.get('mismatch_clip_frac'), 1, '.3f')} |")
            out.append(row)
        out.append("")
    for reg, c in (rep.get("phase_a_cost") or {}).items():
        lo, hi = c["wall_s_range"]
        out += [f"Phase A's {c['runs']} {reg} runs took {c['wall_h']:.2f} h of their own wall time; a run "
                f"{c['wall_s_median']:.0f} s (median; range {lo:.0f}-{hi:.0f} s); 1-minute load at a run's end "
                f"{c['load1_median']:.1f} (median).", ""]
    return out


def _choice_lines(choice: dict | None) -> list[str]:
    if not choice or choice.get("futile") is None:
        missing = (choice or {}).get("missing") or []
        return [f"Phase A's choice: not made yet ({len(missing)} phase-A runs missing).", ""]
    margins = "; ".join(f"{METHODS[v].label}: " + ", ".join(f"{reg} {_pts(m, 100, '+.2f')}" for reg, m in per.items())
                        for v, per in choice["margins"].items())
    best = ", ".join(f"{reg}: {METHODS[m].label}" for reg, m in choice["best_baseline"].items())
    verdict = (f"**Futility stop**: no variant's worst-regime margin is above {_pts(choice['futility_margin'])} points;"
               " phase A is published as a negative result and phase B does not run." if choice["futile"] else
               f"Chosen: **{METHODS[choice['chosen']].label}**.")
    return [f"Best baseline per regime (phase A mean AUC): {best}. AUC margins over it, points: {margins}. {verdict}",
            ""]


def prereg_markdown(rep: dict) -> str:
    """results.md of the two-phase experiment."""
    d = rep["design"]
    out = [f"# D-ARL, preregistered two-phase experiment ({rep['status']})", "", "## Design (written before the runs)",
           "", *([f"Question: {d['question']}", ""] if d.get("question") else []),
           f"Budget {d['budget_samples']} generated samples, evaluated every {d['eval_every_samples']}; phase A "
           f"seeds {d['phases']['A']['seeds']}; phase B from seed {d['phases']['B']['first_seed']}. Primary metric: "
           f"{d['primary_metric']}.", "", d["rules"], ""]
    for m, c in d["cells"].items():  # a cell whose label names its own rate is not given it twice
        rate = "" if METHODS[m].lr else f", lr {c['lr']:g}"
        out.append(f"- {m}: {c['label']}{rate} ({' '.join(c['overrides'])})")
    out += ["", d["published_cells"], ""]
    out += [f"Default rule: {d['default_rule']}", ""] if d.get("default_rule") else []
    out += ["", "## Phase A (exploration)", "", *_phase_a_lines(rep), *_choice_lines(rep.get("choice"))]
    if rep.get("phase_a_contrasts"):
        out += ["### Phase A contrasts (exploratory: not preregistered, p not corrected)", "",
                "AUC, points, paired by seed over phase A's seeds. Against the best baseline the margins are biased "
                "down (that baseline is picked on the same runs).", "",
                *_test_lines(rep["phase_a_contrasts"], contrast=True)]
    plan = rep.get("phase_b")
    if plan:
        out += ["## Phase B (confirmation)", "", f"Seeds {plan['seeds']} ({plan['n_seeds']}: power "
                f"{plan['power']:.2f} at {_pts(plan['effect'])} points, paired SD {_pts(plan['sd'], 100, '.2f')} "
                f"points, alpha {plan['alpha_per_test']:.3f} per test), written before its first run.", ""]
        if rep.get("primary"):
            out += ["Primary (AUC, points; Holm over the regimes):", "", *_test_lines(rep["primary"])]
        if rep.get("secondary"):
            out += ["Secondary figures (Holm over these only):", "", *_test_lines(rep["secondary"])]
    fam = rep.get("secondary_family")
    if fam:
        gains = ", ".join(f"{reg} {_pts(g, 100, '+.1f')}" for reg, g in fam["gate_gain"].items())
        out += ["## Second task (secondary family)", "", f"{d['phases']['secondary']['label']}: the baseline gains "
                f"{gains} points (gate {_pts(fam['gate'], 100, '.0f')}); tested in {fam['passed'] or 'no regime'}.",
                "", *(_test_lines(fam["tests"]) if fam["tests"] else [])]
    return "\n".join(out) + "\n"


def plot_phase_a(results: list[RunResult], size, out_dir: str) -> list[str]:
    """curves_samples.png: one panel per regime, each cell's mean greedy accuracy over phase A's
    seeds at every sample mark (D-ARL variants dashed); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(size.regimes), figsize=(5.5 * len(size.regimes), 4.2), squeeze=False, sharey=True)
    colors = plt.get_cmap("tab20")
    drawn = False
    for ax, reg in zip(axes[0], size.regimes):
        for i, m in enumerate(size.methods):
            runs = list(_per_seed(results, reg.name, m, size.seeds).values())
            if not runs:
                continue
            n = min(len(r.curve.marks) for r in runs)
            mean = np.mean([r.curve.accuracy[:n] for r in runs], axis=0)
            ax.plot(runs[0].curve.marks[:n], 100 * mean, label=METHODS[m].label, color=colors(i),
                    ls="--" if m in size.prereg.candidates else "-", lw=1.4)
            drawn = True
        ax.set_title(f"{reg.name}: {reg.label}", fontsize=9)
        ax.set_xlabel("generated samples (scheduled mark)")
        ax.grid(alpha=0.3)
    if not drawn:
        plt.close(fig)
        return []
    axes[0][0].set_ylabel("greedy test accuracy %, mean over phase A's seeds")
    handles = {h.get_label(): h for a in axes[0] for h in a.get_lines()}
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.18, 1, 1))
    path = os.path.join(out_dir, "curves_samples.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]

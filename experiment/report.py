"""The experiment's outputs: markdown tables, PNG plots of the curves, one JSON document.

What it is: `build_report(results, size, best, tuning_scores, tuning_results, pilot)` -> the
JSON-able figures of every table (per eta, or per eta and rate where the rate is a factor: the
main methods, with sync as the eta = 0 reference, and D-ARL's seed-paired tests against each of
them, Holm-corrected; the ablations at the tuning eta; the tuning grid) and every run's curve; `markdown(report)` -> the
tables as markdown; and `plot_curves(results, size, out_dir)`, which writes one PNG per x axis
(training steps, generated samples, training wall-clock without evaluation time), one panel per
eta, each method as its mean over seeds with a min-max band.
What it is not: running (`runs.py`) or the statistics themselves (`analysis.py`).
"""

from __future__ import annotations

import math
import os

from experiment.analysis import (
    COLLAPSE_DROP,
    THRESHOLD_FRAC,
    auc,
    band,
    eta_figures,
    holm,
    paired_test,
    run_accuracy_at,
)
from experiment.api import METHODS, REPLAY_DEPTH, RunResult, Setting, darl_window
from experiment.plan import Size

AXES = {"steps": "training steps", "samples": "generated samples", "wall_s": "training wall-clock (s, eval excluded)"}


def _groups(results: list[RunResult], size: Size) -> list[tuple[str, str, list[RunResult]]]:
    """(key, title, runs) of each main table: one per eta (tuned sizes: each method at its own
    setting) or one per (eta, rate) where the rate is a factor (`size.tune` false); sync, at
    eta = 0, joins every table of its rate."""
    out = []
    for eta in size.etas:
        mine = [r for r in results
                if (r.spec.eta == eta or r.spec.method == "sync") and not METHODS[r.spec.method].ablation]
        if size.tune:
            out.append((str(eta), f"eta = {eta}", mine))
            continue
        for lr in sorted({r.spec.lr for r in mine}):
            out.append((f"{eta}/lr{lr:g}", f"eta = {eta}, lr {lr:g}", [r for r in mine if r.spec.lr == lr]))
    return out


FIGURES = ("accuracy_at_budget", "auc", "final_accuracy")  # the decided figures, in that order


def paired_tests(runs: list[RunResult], x_common: float, reference: str = "darl") -> list[dict]:
    """D-ARL against every other method of a table, per figure, paired by seed (p not corrected)."""
    def per_seed(method: str, fig: str) -> dict[int, float]:
        fn = {"accuracy_at_budget": lambda r: run_accuracy_at(r.curve, x_common),
              "auc": lambda r: auc(r.curve.samples, r.curve.accuracy, x_common),
              "final_accuracy": lambda r: r.final_accuracy}[fig]
        return {r.spec.seed: fn(r) for r in runs if r.spec.method == method}

    others = [m for m in dict.fromkeys(r.spec.method for r in runs) if m not in (reference, "sync")]
    if not any(r.spec.method == reference for r in runs):
        return []
    return [{"method": m, "figure": f, **paired_test(per_seed(reference, f), per_seed(m, f))}
            for m in others for f in FIGURES]


def build_report(results: list[RunResult], size: Size, best: dict[str, Setting], tuning_scores: dict,
                 tuning_results: list[RunResult] = (), pilot: dict | None = None) -> dict:
    """Every figure of the tables (keyed by eta, or eta/rate, as a string, for JSON), the paired
    tests (Holm-corrected over all of them), and every run's curve."""
    tables = {}
    for key, title, runs in _groups(results, size):
        fig = eta_figures(runs, list(size.methods))
        fig["title"] = title
        fig["tests"] = paired_tests(runs, fig["x_common"]) if fig["x_common"] is not None else []
        tables[key] = fig
    tests = [t for fig in tables.values() for t in fig["tests"]]
    for t, p in zip(tests, holm([t["p"] for t in tests])):
        t["p_holm"] = p
    abl_runs = [r for r in results if r.spec.eta == size.tune_eta and
                (METHODS[r.spec.method].ablation or r.spec.method == "darl")]
    ablations = eta_figures(abl_runs + [r for r in results if r.spec.eta == size.tune_eta and
                                        r.spec.method in ("decoupled_areal", "decoupled_verl")],
                            ["darl", *size.ablations])
    return {
        "size": size.name, "steps": size.steps, "eval_every": size.every, "etas": list(size.etas),
        "budget_samples": size.budget, "eval_every_samples": size.every_samples,
        "seeds": list(size.seeds), "lr_grid": list(size.lr_grid), "tune_eta": size.tune_eta,
        "tuned_per_method": size.tune,
        "mb_grid": list(size.mb_grid), "grid": [g.label for g in size.grid()], "settings": list(size.settings),
        "tuned": {m: {"lr": g.lr, "minibatches": g.minibatches, "label": g.label} for m, g in best.items()},
        "tuning_auc": tuning_scores, "pilot": pilot,
        "tables": tables, "ablations": ablations,
        "definitions": {"collapse_drop": COLLAPSE_DROP, "threshold_frac": THRESHOLD_FRAC, "figures": list(FIGURES),
                        "tests": "paired t-test over seeds, two-sided, Holm-corrected over every test of the report"},
        "runs": [_run_json(r) for r in results],
        "tuning_runs": [_run_json(r) for r in tuning_results if r.spec.name not in {x.spec.name for x in results}],
    }


def _run_json(r: RunResult) -> dict:
    return {"name": r.spec.name, "method": r.spec.method, "regime": r.spec.regime, "eta": r.spec.eta, "lr": r.spec.lr,
            "minibatches": r.spec.minibatches, "seed": r.spec.seed, "final_accuracy": r.final_accuracy,
            "staleness_mean": r.staleness_mean, "staleness_max": r.staleness_max, "ess_min": r.ess_min,
            "train_wall_s": r.train_wall_s, "samples_generated": r.samples_generated, "cost": r.run_cost,
            "clip_frac": r.clip_frac, "ess_oldest": r.ess_oldest, "kl_k3": r.kl_k3, "reused_frac": r.reused_frac,
            "clip_frac_behavior": r.clip_frac_behavior, "evicted_untrained": r.evicted_untrained,
            "filtered_groups": r.filtered_groups,
            # only where logged: runs made before the mismatch metrics read as they were published
            **{k: v for k in ("mismatch_abs_mean", "mismatch_kl", "mismatch_clip_frac")
               if (v := getattr(r, k)) is not None},
            "curve": {"steps": r.curve.steps, "samples": r.curve.samples, "wall_s": r.curve.wall_s,
                      "accuracy": r.curve.accuracy, "marks": r.curve.marks, "sampled": r.curve.sampled}}


def finite(obj):
    """`obj` with every NaN or infinite float replaced by None (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def _pct(v, ci=None) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if ci is None or any(c is None or math.isnan(c) for c in ci):
        return f"{100 * v:.1f}"
    return f"{100 * v:.1f} [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def _num(v, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _table(fig: dict, tuned: dict[str, dict]) -> list[str]:
    lines = ["| method | setting | final accuracy % [95% CI] | AUC % [95% CI] | samples to 80% of best decoupled "
             "(reached) | collapses | min ESS | staleness mean / max | train wall s | samples |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in fig["rows"].items():
        setting = tuned.get(name) or tuned.get(METHODS[name].tune_as or name) or {"label": "-"}
        reach = (f"{_num(row['samples_to_threshold'], '.0f')} ({row['reached_threshold']}/{row['seeds']}, "
                 f"{row['reached_at_first_eval']} at the 1st evaluation)")
        stale = f"{_num(row['staleness_mean'], '.2f')} / {_num(row['staleness_max'], '.0f')}"
        lines.append(f"| {METHODS[name].label} | {setting['label']} "
                     f"| {_pct(row['final_accuracy'], row['final_accuracy_ci95'])} "
                     f"| {_pct(row['auc'], row['auc_ci95'])} | {reach} | {row['collapses']}/{row['seeds']} "
                     f"| {_num(row['ess_min'], '.3f')} | {stale} | {_num(row['train_wall_s'], '.0f')} "
                     f"| {_num(row['samples_generated'], '.0f')} |")
    return lines


def _factor_table(fig: dict) -> list[str]:
    """A table of one (eta, rate): the decided figures, then the drift diagnostics beside them."""
    lines = ["| method | accuracy at the budget % [95% CI] | AUC % [95% CI] | final accuracy % [95% CI] "
             "| clip frac | ESS oldest version | KL k3 | reused share | staleness mean / max | collapses |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in fig["rows"].items():
        lines.append(f"| {METHODS[name].label} | {_pct(row['accuracy_at_budget'], row['accuracy_at_budget_ci95'])} "
                     f"| {_pct(row['auc'], row['auc_ci95'])} "
                     f"| {_pct(row['final_accuracy'], row['final_accuracy_ci95'])} "
                     f"| {_num(row['clip_frac'], '.3f')} | {_num(row['ess_oldest'], '.3f')} "
                     f"| {_num(row['kl_k3'], '.2e')} | {_num(row['reused_frac'], '.2f')} "
                     f"| {_num(row['staleness_mean'], '.2f')} / {_num(row['staleness_max'], '.0f')} "
                     f"| {row['collapses']}/{row['seeds']} |")
    return lines


def _tests_table(tests: list[dict]) -> list[str]:
    if not tests:
        return []
    lines = ["D-ARL minus each method, paired by seed (points; p two-sided, Holm over the whole report):", "",
             "| method | figure | difference [95% CI] | seeds | p | p Holm |", "|---|---|---|---|---|---|"]
    for t in tests:
        diff = _pct(t["diff"], t["diff_ci95"])
        lines.append(f"| {METHODS[t['method']].label} | {t['figure'].replace('_', ' ')} | {diff} | {t['seeds']} "
                     f"| {_num(t['p'], '.3f')} | {_num(t.get('p_holm'), '.3f')} |")
    return [*lines, ""]


def _caption(fig: dict) -> str:
    return (f"Warm start {_pct(next(iter(fig['rows'].values()))['start_accuracy']) if fig['rows'] else '-'}%; "
            f"AUC over the first {_num(fig['x_common'], '.0f')} samples; 80% of the best decoupled accuracy "
            f"= {_pct(fig['threshold'])}%.")


def _warm_lines(warm: dict | None) -> list[str]:
    """What the shared warm start's target stop selected from (`warmstart.checks_summary`), when
    its warmstart.json recorded its checks."""
    summ = (warm or {}).get("checks_summary")
    if not summ or summ["later_half_median"] is None:
        return []
    lo, hi = summ["later_half_range"]
    on = ("the validation split, disjoint from the test split the curves are scored on (the test checks are in "
          "the design section)" if warm.get("sft_selected_on") == "validation" else
          "the problems the curves are scored on: step 0 is a high point")
    if warm.get("sft_selected_on") == "none":
        return []  # a fixed step count: nothing was selected (the design section shows its test checks)
    return [f"Warm start: {warm['sft_steps']} SFT steps, stopped at {_pct(warm['sft_heldout_accuracy'])}% held-out "
            f"greedy accuracy, the first of {summ['checks']} checks to reach {_pct(warm['sft_target'])}%, on "
            f"{on}. Best check before it "
            f"{_pct(summ['best_before_stop'])}%; checks over the later half of the steps before it: median "
            f"{_pct(summ['later_half_median'])}% (range {_pct(lo)}-{_pct(hi)}%).", ""]


def _curve_lines(runs: list[dict]) -> list[str]:
    """Mean held-out accuracy over seeds at every in-loop evaluation, per cell (method, eta, lr,
    minibatches): the numbers behind the plots. Cells whose seeds were evaluated at different
    steps are left out."""
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["method"], r["eta"], r["lr"], r["minibatches"]), []).append(r)
    rows = {k: v for k, v in cells.items() if len({tuple(r["curve"]["steps"]) for r in v}) == 1}
    if not rows:
        return []
    steps = max((v[0]["curve"]["steps"] for v in rows.values()), key=len)
    out = ["## Mean accuracy by step (%, over seeds)", "",
           "| method | eta | lr | seeds | " + " | ".join(f"{s:g}" for s in steps) + " |",
           "|---|---|---|---|" + "---|" * len(steps)]
    for (m, eta, lr, _), v in rows.items():
        means = [sum(r["curve"]["accuracy"][i] for r in v) / len(v) for i in range(len(v[0]["curve"]["steps"]))]
        cells_txt = [_pct(x) for x in means] + ["-"] * (len(steps) - len(means))
        out.append(f"| {METHODS[m].label} | {eta} | {lr:g} | {len(v)} | " + " | ".join(cells_txt) + " |")
    return [*out, ""]


def _pilot_lines(pilot: dict | None) -> list[str]:
    """What the pilot measured at each rate and the rate it chose (reports that recorded the
    pilot's accuracy; earlier ones only its clip fractions)."""
    if not pilot or "final_accuracy" not in pilot:
        return []
    rates = list(pilot["clip_frac"])
    why = (f"the smallest whose clip fraction reached {_pct(pilot['threshold'])}%" if pilot["reached"] else
           f"none reached {_pct(pilot['threshold'])}%: the largest tried")
    return [f"Pilot: {METHODS[pilot['method']].label}, {pilot['steps']} steps from the warm start, one seed, "
            f"at rates {' / '.join(rates)}: "
            f"PPO clip fraction {' / '.join(_pct(pilot['clip_frac'][r]) for r in rates)}%, "
            f"final accuracy {' / '.join(_pct(pilot['final_accuracy'][r]) for r in rates)}%. Second rate "
            f"{pilot['rate']:g}, {why}.", ""]


def _cost_lines(report: dict) -> list[str]:
    """The runs' own wall time (kept when a later invocation reuses them) and this invocation's."""
    if report.get("runs_wall_s") is None:
        return []
    parts = [f"main runs {report['runs_wall_s'] / 60:.1f} min"]
    if (report.get("pilot") or {}).get("runs_wall_s") is not None:
        parts.insert(0, f"pilot {report['pilot']['runs_wall_s'] / 60:.1f} min")
    if (report.get("warm_start") or {}).get("sft_seconds") is not None:
        parts.insert(0, f"warm start (SFT) {report['warm_start']['sft_seconds'] / 60:.1f} min")
    return [f"Wall time, one run at a time: {', '.join(parts)}. This invocation: {report['wall_s'] / 60:.1f} min "
            "(less where it reused finished runs).", ""]


def markdown(report: dict) -> str:
    best = report["tuned"]
    length = (f"{report['budget_samples']} generated samples, evaluation every {report['eval_every_samples']} samples"
              if report.get("budget_samples") else f"{report['steps']} steps, evaluation every {report['eval_every']}")
    out = [f"# D-ARL comparison ({report['size']}: {length}, seeds {report['seeds']})", ""]
    out += _warm_lines(report.get("warm_start")) + _pilot_lines(report.get("pilot")) + _cost_lines(report)
    for fig in report["tables"].values():
        table = _table(fig, best) if report["tuned_per_method"] else _factor_table(fig)
        out += [f"## {fig['title']}", "", _caption(fig), "", *table, "", *_tests_table(fig["tests"])]
    if report["ablations"]["rows"] and len(report["ablations"]["rows"]) > 1:
        k = darl_window(report["tune_eta"])
        out += [f"## D-ARL ablations (eta = {report['tune_eta']})", "",
                _caption(report["ablations"]) + f" D-ARL's own window here is K = {k} (replay depth "
                f"{REPLAY_DEPTH}): its row is that depth's ablation.",
                "",
                *_table(report["ablations"], best), ""]
    if report["tuning_auc"]:
        out += [f"## Tuning (eta = {report['tune_eta']}, AUC %, higher is better)", "",
                "| method | " + " | ".join(report["grid"]) + " | chosen |",
                "|---|" + "---|" * (len(report["grid"]) + 1)]
        for m, per in report["tuning_auc"].items():
            cells = " | ".join(_pct(per.get(label)) for label in report["grid"])
            out.append(f"| {METHODS[m].label} | {cells} | {best[m]['label'] if m in best else '-'} |")
        out.append("")
    out += _curve_lines(report["runs"])
    out.append(f"Collapse: the last evaluation more than {100 * report['definitions']['collapse_drop']:.0f} "
               "points below the warm start, or a non-finite loss. Intervals: 95% t-interval across seeds.")
    return "\n".join(out) + "\n"


def plot_curves(results: list[RunResult], size: Size, out_dir: str) -> list[str]:
    """One PNG per x axis, one panel per eta (plus the ablation panel); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(title, list(size.methods), runs) for _, title, runs in _groups(results, size)]
    if size.ablations:
        panels.append((f"D-ARL ablations, eta = {size.tune_eta}", ["darl", *size.ablations],
                       [r for r in results if r.spec.eta == size.tune_eta]))
    paths = []
    colors = plt.get_cmap("tab20")
    for axis, xlabel in AXES.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False, sharey=True)
        for ax, (title, methods, pool) in zip(axes[0], panels):
            for m in methods:
                runs = [r for r in pool if r.spec.method == m]
                if not runs:
                    continue
                b = band([(getattr(r.curve, axis), r.curve.accuracy) for r in runs])
                color = colors(list(METHODS).index(m))  # one colour per method in every panel
                ax.plot(b["x"], [100 * v for v in b["mean"]], label=METHODS[m].label, lw=1.5, color=color,
                        ls="--" if METHODS[m].ablation else "-")
                ax.fill_between(b["x"], [100 * v for v in b["lo"]], [100 * v for v in b["hi"]],
                                color=color, alpha=0.15, lw=0)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("held-out accuracy %")
        fig.suptitle(f"Held-out accuracy against {xlabel}: mean over seeds, band from the lowest to the "
                     f"highest seed", fontsize=10)
        handles = {h.get_label(): h for a in axes[0] for h in a.get_lines()}
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 6), fontsize=8)
        fig.tight_layout(rect=(0, 0.12, 1, 1))
        path = os.path.join(out_dir, f"curves_{axis}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths

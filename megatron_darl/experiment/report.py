"""The experiment's outputs: markdown tables, PNG plots of the curves, one JSON document.

What it is: `build_report(results, size, best, tuning_scores, tuning_results)` -> the JSON-able
figures of every table (per eta: the main methods, with sync as the eta = 0 reference; the
ablations at the tuning eta; the tuning grid) and every run's curve; `markdown(report)` -> the
tables as markdown; and `plot_curves(results, size, out_dir)`, which writes one PNG per x axis
(training steps, generated samples, training wall-clock without evaluation time), one panel per
eta, each method as its mean over seeds with a min-max band.
What it is not: running (`runs.py`) or the statistics themselves (`analysis.py`).
"""

from __future__ import annotations

import math
import os

from megatron_darl.experiment.analysis import COLLAPSE_DROP, THRESHOLD_FRAC, band, eta_figures
from megatron_darl.experiment.api import METHODS, REPLAY_DEPTH, RunResult, Setting, darl_window
from megatron_darl.experiment.plan import Size

AXES = {"steps": "training steps", "samples": "generated samples", "wall_s": "training wall-clock (s, eval excluded)"}


def build_report(results: list[RunResult], size: Size, best: dict[str, Setting], tuning_scores: dict,
                 tuning_results: list[RunResult] = ()) -> dict:
    """Every figure of the tables (keyed by eta, as a string, for JSON) and every run's curve."""
    sync = [r for r in results if r.spec.method == "sync"]
    tables = {}
    for eta in size.etas:
        runs = [r for r in results if r.spec.eta == eta and not METHODS[r.spec.method].ablation] + sync
        tables[str(eta)] = eta_figures(runs, list(size.methods))
    abl_runs = [r for r in results if r.spec.eta == size.tune_eta and
                (METHODS[r.spec.method].ablation or r.spec.method == "darl")]
    ablations = eta_figures(abl_runs + [r for r in results if r.spec.eta == size.tune_eta and
                                        r.spec.method in ("decoupled_areal", "decoupled_verl")],
                            ["darl", *size.ablations])
    return {
        "size": size.name, "steps": size.steps, "eval_every": size.every, "etas": list(size.etas),
        "seeds": list(size.seeds), "lr_grid": list(size.lr_grid), "tune_eta": size.tune_eta,
        "mb_grid": list(size.mb_grid), "grid": [g.label for g in size.grid()], "settings": list(size.settings),
        "tuned": {m: {"lr": g.lr, "minibatches": g.minibatches, "label": g.label} for m, g in best.items()},
        "tuning_auc": tuning_scores,
        "tables": tables, "ablations": ablations,
        "definitions": {"collapse_drop": COLLAPSE_DROP, "threshold_frac": THRESHOLD_FRAC},
        "runs": [_run_json(r) for r in results],
        "tuning_runs": [_run_json(r) for r in tuning_results if r.spec.name not in {x.spec.name for x in results}],
    }


def _run_json(r: RunResult) -> dict:
    return {"name": r.spec.name, "method": r.spec.method, "eta": r.spec.eta, "lr": r.spec.lr,
            "minibatches": r.spec.minibatches, "seed": r.spec.seed, "final_accuracy": r.final_accuracy,
            "staleness_mean": r.staleness_mean, "staleness_max": r.staleness_max, "ess_min": r.ess_min,
            "train_wall_s": r.train_wall_s, "samples_generated": r.samples_generated, "cost": r.run_cost,
            "curve": {"steps": r.curve.steps, "samples": r.curve.samples, "wall_s": r.curve.wall_s,
                      "accuracy": r.curve.accuracy}}


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
        reach = f"{_num(row['samples_to_threshold'], '.0f')} ({row['reached_threshold']}/{row['seeds']})"
        stale = f"{_num(row['staleness_mean'], '.2f')} / {_num(row['staleness_max'], '.0f')}"
        lines.append(f"| {METHODS[name].label} | {setting['label']} | {_pct(row['final_accuracy'], row['final_accuracy_ci95'])} "
                     f"| {_pct(row['auc'], row['auc_ci95'])} | {reach} | {row['collapses']}/{row['seeds']} "
                     f"| {_num(row['ess_min'], '.3f')} | {stale} | {_num(row['train_wall_s'], '.0f')} "
                     f"| {_num(row['samples_generated'], '.0f')} |")
    return lines


def _caption(fig: dict) -> str:
    return (f"Warm start {_pct(next(iter(fig['rows'].values()))['start_accuracy']) if fig['rows'] else '-'}%; "
            f"AUC over the first {_num(fig['x_common'], '.0f')} samples; 80% of the best decoupled accuracy "
            f"= {_pct(fig['threshold'])}%.")


def markdown(report: dict) -> str:
    best = report["tuned"]
    out = [f"# D-ARL comparison ({report['size']}: {report['steps']} steps, evaluation every "
           f"{report['eval_every']}, seeds {report['seeds']})", ""]
    for eta, fig in report["tables"].items():
        out += [f"## eta = {eta}", "", _caption(fig), "", *_table(fig, best), ""]
    if report["ablations"]["rows"] and len(report["ablations"]["rows"]) > 1:
        k = darl_window(report["tune_eta"])
        out += [f"## D-ARL ablations (eta = {report['tune_eta']})", "",
                _caption(report["ablations"]) + f" D-ARL's own window here is K = {k} (replay depth {REPLAY_DEPTH}): its row is that depth's "
                "ablation.",
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
    out.append(f"Collapse: the last evaluation more than {100 * report['definitions']['collapse_drop']:.0f} "
               "points below the warm start, or a non-finite loss. Intervals: 95% t-interval across seeds.")
    return "\n".join(out) + "\n"


def plot_curves(results: list[RunResult], size: Size, out_dir: str) -> list[str]:
    """One PNG per x axis, one panel per eta (plus the ablation panel); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"eta = {eta}", [m for m in size.methods], eta) for eta in size.etas]
    if size.ablations:
        panels.append((f"D-ARL ablations, eta = {size.tune_eta}", ["darl", *size.ablations], size.tune_eta))
    paths = []
    colors = plt.get_cmap("tab20")
    for axis, xlabel in AXES.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False, sharey=True)
        for ax, (title, methods, eta) in zip(axes[0], panels):
            for m in methods:
                runs = [r for r in results if r.spec.method == m and r.spec.eta == (0 if METHODS[m].eta_free else eta)]
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

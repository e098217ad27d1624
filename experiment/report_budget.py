"""The budget size's part of results.json and results.md: design, primary tests, diagnostics.

What it is: `planned(size, warm)`, the document written into results.json BEFORE the first run
(the design and the primary tests' definitions, no numbers); `budget_report(results, size,
warm, planned_doc)`, the same design and definitions with the figures filled in (refusing a
design that changed since it was written), the diagnostic comparisons, the same comparisons on
the sampled curve (avg@4 at temperature 1), the mean staleness of trained tokens per regime
and cell, and the warm start's last checks on the test split; `budget_markdown(report)`, their
markdown.
What it is not: the statistics (`primary.py`) or the per-eta tables and plots (`report.py`).
"""

from __future__ import annotations

from dataclasses import replace

from experiment.api import METHODS, RunResult
from experiment.primary import baseline_gains, design, diagnostic_tests, primary_definitions, primary_figures


class DesignChanged(RuntimeError):
    """results.json holds a design written before the runs that differs from this invocation's."""


def planned(size, warm: dict | None = None) -> dict:
    """What results.json holds before any run: the design and the primary tests, undecided."""
    return {"status": "planned", "design": design(size, warm), "primary": primary_definitions(size)}


def _comparable(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "warm_start_selected_on"}


def budget_report(results: list[RunResult], size, warm: dict | None, planned_doc: dict | None) -> dict:
    """The decided figures of a finished (or partial) budget experiment."""
    now = design(size, warm)
    if planned_doc is not None and _comparable(planned_doc["design"]) != _comparable(now):
        raise DesignChanged("results.json holds a design written before the runs that differs from this "
                            "invocation's (other size, seeds or settings): use another --out, or remove it")
    sampled = [replace(r, curve=r.curve.scored_on("sampled")) for r in results
               if len(r.curve.sampled) == len(r.curve.accuracy)]
    sampled_size = replace(size, accuracy_eval="sampled")
    return {"design": now, "primary": primary_figures(results, size), "diagnostics": diagnostic_tests(results, size),
            "sampled_primary": primary_figures(sampled, sampled_size) if sampled else [],
            "staleness": _staleness(results, size), "warm_start_test": (warm or {}).get("test_checks_summary"),
            "baseline_gain": baseline_gains(results, size), "gain_gate": size.gain_gate,
            "warm_start_test_final": (warm or {}).get("sft_test_accuracy")}


def _staleness(results: list[RunResult], size) -> dict:
    """Per regime and cell: the mean over seeds of each run's mean staleness of trained sequences,
    and the largest staleness any of its runs trained (`{"mean": .., "max": ..}`)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for reg in size.regimes:
        for m in dict.fromkeys(r.spec.method for r in results):
            runs = [r for r in results if r.spec.regime == reg.name and r.spec.method == m]
            means = [r.staleness_mean for r in runs if r.staleness_mean is not None]
            maxes = [r.staleness_max for r in runs if r.staleness_max is not None]
            if means:
                out.setdefault(reg.name, {})[m] = {"mean": sum(means) / len(means),
                                                   "max": max(maxes) if maxes else None}
    return out


def _n(v, scale: float = 1.0, fmt: str = "+.1f") -> str:
    """`v * scale` formatted, "-" for a missing or non-finite figure (one seed has no interval)."""
    return "-" if v is None or v != v or v in (float("inf"), float("-inf")) else format(scale * v, fmt)


def _fmt(row: dict) -> tuple[str, str, str]:
    if row.get("difference") is None:
        return "-", "-", "-"
    if row["metric"] == "accuracy_at_budget":
        diff = f"{_n(row['difference'], 100)} [{_n(row['ci_low'], 100)}, {_n(row['ci_high'], 100)}] pts"
        return diff, f"{_n(row.get('mean_a'), 100, '.1f')} vs {_n(row.get('mean_b'), 100, '.1f')}%", "-"
    diff = f"{_n(row['difference'], 1, '+.0f')} [{_n(row['ci_low'], 1, '+.0f')}, {_n(row['ci_high'], 1, '+.0f')}]"
    means = (f"{_n(row.get('mean_a'), 1, '.0f')} vs {_n(row.get('mean_b'), 1, '.0f')} "
             f"(censored {row.get('censored_a', 0)}/{row.get('censored_b', 0)})")
    lo, hi = row.get("ratio_ci") or (None, None)
    ratio = _n(row.get("ratio"), 1, ".2f") + (f" [{_n(lo, 1, '.2f')}, {_n(hi, 1, '.2f')}]" if lo is not None else "")
    return diff, means, ratio


def _rows(rows: list[dict], holm: bool) -> list[str]:
    head = "| regime | a | b | metric | a - b [95% CI] | means | ratio a/b [bootstrap 95%] | seeds | p |"
    out = [head + (" p Holm |" if holm else ""), "|---" * (9 + holm) + "|"]
    for r in rows:
        diff, means, ratio = _fmt(r)
        p = _n(r.get("p"), 1, ".3f")
        line = (f"| {r['regime']} | {METHODS[r['a']].label} | {METHODS[r['b']].label} "
                f"| {r['metric'].replace('_', ' ')} "
                f"| {diff} | {means} | {ratio} | {r.get('seeds', 0)} | {p} |")
        out.append(line + (f" {_n(r.get('p_holm'), 1, '.3f')} |" if holm else ""))
    return out


def budget_markdown(rep: dict) -> list[str]:
    """The design, the primary table, the staleness per regime and the diagnostics, as markdown."""
    d = rep["design"]
    out = ["## Design (written before the runs)", "",
           f"Baseline {METHODS[d['baseline']].label}; D-ARL; budget {d['budget_samples']} generated samples, "
           f"evaluated every {d['eval_every_samples']}; seeds {d['seeds']}; test split disjoint from training and "
           f"validation: {d['test_split_disjoint']}; warm start selected on: {d['warm_start_selected_on']}; "
           f"figures read the {d['accuracy']} curve.", ""]
    out += [f"- {name}: {r['label']} ({', '.join(r['settings'])})" for name, r in d["regimes"].items()] + [""]
    wt = rep.get("warm_start_test")
    if wt:
        out += [f"Warm start on the test split: the model RL starts from scores {100 * wt['final']:.1f}%; its last "
                f"{wt['last']} checks (steps {wt['last_steps'][0]}-{wt['last_steps'][1]}) average "
                f"{100 * wt['mean']:.1f}% (SD {100 * (wt['sd'] or 0):.1f}, range {100 * wt['range'][0]:.1f}-"
                f"{100 * wt['range'][1]:.1f}%): step 0 is "
                f"{100 * (wt['final'] - wt['mean']):+.1f} points from their mean.", ""]
    gains = rep.get("baseline_gain") or {}
    if gains:
        out += ["Testbed: the baseline's mean gain from step 0 at the budget, per regime: " + "; ".join(
            f"{reg} {100 * g:+.1f} points" for reg, g in gains.items()) + f" (the comparison needs >= "
            f"{100 * rep['gain_gate']:.0f} in every regime).", ""]
    out += ["## Primary tests (D-ARL against the baseline; Holm over these only)", "", *_rows(rep["primary"], True), ""]
    if rep["staleness"]:
        out += ["Staleness of trained sequences in versions, mean over seeds of each run's mean (largest in any "
                "run), per regime: " + "; ".join(
                    f"{reg}: " + ", ".join(f"{METHODS[m].label} {v['mean']:.2f} ({_n(v['max'], 1, '.0f')})"
                                           for m, v in cells.items())
                    for reg, cells in rep["staleness"].items()) + ". The gate counts groups, as AReaL's does "
                "(rollout/staleness.py): a group that finishes after groups admitted later can be trained eta + 1 "
                "versions after its first token.", ""]
    if rep["sampled_primary"]:
        out += ["The same tests on avg@4 at temperature 1 (a diagnostic):", "",
                *_rows(rep["sampled_primary"], True), ""]
    if rep["diagnostics"]:
        out += ["## Diagnostics (each other cell against the baseline and D-ARL; p Holm over the diagnostics only)", "",
                *_rows(rep["diagnostics"], True), ""]
    return out

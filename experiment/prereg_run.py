"""Running the preregistered two-phase experiment: design, phase A, the choice, phase B, the second task.

What it is: `write_design` (results.json before any run; a rerun whose design differs is refused
with `DesignChanged`), `write_phase_b` (phase B's seeds and cells written before its first run; a
rerun that would decide otherwise is refused), `run_experiment` (the phases in order, one run at
a time through the caller's driver, which skips finished runs: it can span sessions),
`plan_lines` (what `--plan` prints: every run of each phase and the time estimates) and
`report_doc` (results.json: the design, phase A's table and choice, phase B's plan and figures,
the second task's family, every run with its curve and replay totals).
What it is not: the rules (`prereg.py`), the figures (`prereg_report.py`) or the run driver
(scripts/compare_async.py's `Driver`, `runs.py`).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from experiment import plan as P
from experiment import prereg as R
from experiment import prereg_report as Q
from experiment.report import _run_json, finite
from experiment.report_budget import DesignChanged

PLAN_SD = 0.013  # paired AUC SD for --plan's estimate: the published budget runs' 0.8-1.3 points


def _results_path(out: str) -> str:
    return os.path.join(out, "results.json")


def _plain(obj):
    """`obj` as JSON reads it back (tuples as lists), for comparing with what a file holds."""
    return json.loads(json.dumps(obj))


def _write(out: str, doc: dict) -> None:
    with open(_results_path(out), "w", encoding="utf-8") as fh:
        json.dump(finite(doc), fh, indent=1, allow_nan=False)


def write_design(out: str, size) -> dict:
    """results.json before any run; an existing one is kept when its design is this one."""
    now = _plain(R.design(size))
    if os.path.isfile(_results_path(out)):
        with open(_results_path(out), encoding="utf-8") as fh:
            old = json.load(fh)
        if old.get("design") is not None:
            if old["design"] != now:
                raise DesignChanged(f"{_results_path(out)} holds a design written before the runs that differs from "
                                    "this invocation's (cells, seeds, rules or settings): use another --out")
            return old
    doc = {"size": size.name, "status": "planned", "design": now, "choice": None, "phase_b": None, "primary": [],
           "runs": []}
    os.makedirs(out, exist_ok=True)
    _write(out, doc)
    return doc


def write_phase_b(out: str, doc: dict, plan: dict) -> dict:
    """Phase B's plan into results.json before its first run; an existing one must be this one."""
    plan = _plain(plan)
    if doc.get("phase_b") is not None and doc["phase_b"] != plan:
        raise DesignChanged(f"{_results_path(out)} holds phase B's plan ({doc['phase_b']['chosen']}, "
                            f"{doc['phase_b']['n_seeds']} seeds) and phase A's runs now decide otherwise: refusing")
    doc = {**doc, "phase_b": plan, "status": "phase B planned"}
    _write(out, doc)
    return doc


def plan_lines(size, estimate) -> list[str]:
    """Every run of each phase (phase B's and the second task's with the chosen variant and best
    baselines still open) and the time estimate of each, `estimate(specs)` seconds."""
    pre = size.prereg
    a = P.main_specs(size, {})
    n_typ, _ = R.seed_count(PLAN_SD, pre, len(size.regimes))
    other = next(b for b in pre.baselines if b != size.baseline)  # a best baseline other than the gate's cell
    example = {"chosen": pre.candidates[0], "best_baseline": {r.name: other for r in size.regimes}}
    out = [f"plan ({size.name}, preregistered two-phase): phase A: {len(a)} runs ({len(size.methods)} cells x "
           f"regimes {[r.name for r in size.regimes]} x seeds {list(size.seeds)}), about {estimate(a) / 3600:.1f} h "
           "on a quiet 2-core machine:", *[f"  A {s.name}" for s in a]]
    for label, n in (("at a paired SD of 1.3 points", n_typ), ("at most", pre.phase_b_max_seeds)):
        plan = {**example, "seeds": list(range(pre.phase_b_first_seed, pre.phase_b_first_seed + n))}
        b = R.phase_b_specs(size, plan)
        sec = [*R.secondary_specs(size, plan), *R.secondary_specs(size, plan, [r.name for r in size.regimes])]
        out.append(f"phase B, {label} {n} seeds ({plan['seeds'][0]}-{plan['seeds'][-1]}): {len(b)} runs, about "
                   f"{estimate(b) / 3600:.1f} h; second task ({pre.secondary_label}): up to {len(sec)} runs, about "
                   f"{estimate(sec) / 3600:.1f} h")
    out += ["phase B runs (<variant>: the chosen one; <baseline>: each regime's best), each seed from "
            f"{pre.phase_b_first_seed}:", *[f"  B {reg.name}_{m}_eta{reg.eta}_lr<its rate>_s<seed>"
                                            for reg in size.regimes for m in ("<baseline>", "<variant>")],
            f"second task: the same names under <out>/secondary, {size.baseline} first (the gate: >= "
            f"{100 * pre.secondary_gate:.0f} points gain in a regime), then phase B's cells in the regimes it passed",
            f"no phase B and no second task when phase A's futility stop applies (no variant's worst-regime AUC "
            f"margin above {100 * pre.futility_margin:+.1f} points)"]
    return out


def _tagged(results, phase: str, task: str = "main") -> list[dict]:
    return [{**_run_json(r), "phase": phase, "task": task} for r in results]


def report_doc(doc: dict, size, runs: dict, choice: dict, family: dict | None) -> dict:
    """results.json after (some of) the runs; `runs` maps "A", "B", "secondary" to their results."""
    plan = doc.get("phase_b")
    status = ("phase A incomplete" if choice.get("futile") is None else "futile: negative result"
              if choice["futile"] else "phase B planned")
    rep = {**doc, "choice": choice, "phase_a": Q.phase_a_table(runs["A"], size),
           "phase_a_contrasts": Q.phase_a_contrasts(runs["A"], size, choice),
           "phase_a_cost": Q.phase_a_cost(runs["A"], size)}
    if plan:
        b = [r for r in runs["B"] if r.spec.seed in plan["seeds"]]
        complete = len(b) == len(R.phase_b_specs(size, plan))
        status = "phase B complete" if complete else "phase B incomplete"
        rep.update(primary=Q.primary_figures(b, size, plan), secondary=Q.secondary_figures(b, size, plan))
    rep.update(status=status, secondary_family=family,
               runs=[*_tagged(runs["A"], "A"), *_tagged(runs["B"], "B"),
                     *_tagged(runs["secondary"], "secondary", "second")])
    return finite(rep)


def run_experiment(args, size, new_driver, gate) -> tuple[int, dict | None]:
    """The phases in order. `new_driver(out, size)` makes a driver (`run(specs)` -> results,
    `failed`); `gate(driver, size, skip)` runs the baseline first and says why to stop, if so.
    Returns (exit code, the report or None)."""
    try:
        doc = write_design(args.out, size)
    except DesignChanged as exc:
        return _refuse(exc)
    drv = new_driver(args.out, size)
    stop = gate(drv, size, args.no_gate)
    if stop:
        print(f"compare_async: {stop}", flush=True)
        return 2, None
    runs = {"A": drv.run(P.main_specs(size, {})), "B": [], "secondary": []}
    choice = R.choose(runs["A"], size)
    family, failed = None, list(drv.failed)
    if choice["chosen"] is not None:
        plan = R.phase_b_plan(runs["A"], size, choice)
        try:
            doc = write_phase_b(args.out, doc, plan)
        except DesignChanged as exc:
            return _refuse(exc)
        runs["B"] = drv.run(R.phase_b_specs(size, doc["phase_b"]))
        runs["secondary"], family, failed2 = _second_task(args, size, doc["phase_b"], new_driver)
        failed = [*drv.failed, *failed2]
    report = report_doc(doc, size, runs, choice, family)
    report.update(failed=failed, not_run=list(drv.missing), plots=Q.plot_phase_a(runs["A"], size, args.out))
    _write(args.out, report)
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as fh:
        fh.write(Q.prereg_markdown(report))
    return (0 if not failed else 1), report


def second_task_size(size):
    """The size of the second task's runs: the size's settings and the task's overrides."""
    return replace(size, settings=(*size.settings, *size.prereg.secondary_task))


def _second_task(args, size, plan: dict, new_driver) -> tuple[list, dict | None, list[str]]:
    """The second task under <out>/secondary (its own warm start): the gate, then the tests.
    Returns its runs, its family's figures and its failed runs."""
    pre = size.prereg
    out = os.path.join(args.out, "secondary")
    if not pre.secondary_task or (args.report_only and not os.path.isdir(os.path.join(out, "_warm"))):
        return [], None, []
    size2 = second_task_size(size)
    drv = new_driver(out, size2)
    gate_runs = drv.run(R.secondary_specs(size2, plan))
    passed = [reg for reg, g in Q.gate_gains(gate_runs, size2, plan["seeds"]).items() if g >= pre.secondary_gate]
    results = drv.run(R.secondary_specs(size2, plan, passed))
    merged = list({r.spec.name: r for r in [*gate_runs, *results]}.values())
    return merged, Q.secondary_family(merged, size2, plan), list(drv.failed)


def _refuse(exc: Exception) -> tuple[int, None]:
    print(f"compare_async: {exc}", file=sys.stderr, flush=True)
    return 2, None

"""The comparison experiment of docs/ALGORITHM.md on the CPU demo: curves, tables, plots, JSON.

What it is: the one entry point of the comparison. From one shared warm start (made once, copied
into every run) it runs the methods of the suite: sync, naive async, decoupled PPO (AReaL cap 5,
verl token IS 2), the two of them with replay over D-ARL's window (`naive_replay`,
`decoupled_replay`), D-ARL and its ablations. Sizes (megatron_darl/experiment/plan.py):
- `seeds` (the default): the seeds' regime, eta = 1 and K = 4, four cells (decoupled without
  replay, naive + replay, decoupled + replay, D-ARL), 4 seeds, two learning rates as a factor
  (5e-5, and the smallest of a short pilot's rates on which the PPO clip acts on >= 3%
  of tokens); the warm start must lie in 10-35% or it stops before the main runs;
- `etas`: every method tuned on one grid at one eta, then run at eta = 1, 2, 4, 8, and D-ARL's
  ablations;
- `quick`: CI, a few minutes: decoupled PPO and D-ARL at eta = 1, 2 seeds, 4 steps each;
- `budget`: the sample budget as the stop. 2-term chain_sum split by question hash
  into disjoint train / validation / test sets, a warm start of a fixed 450 steps, curves on
  1000 test questions (greedy, and avg@4 at temperature 1) every 4096 generated samples; every
  run stops at 32768 generated samples; a generation-bound regime (`gen`: unpaced learner, eta 1)
  and a staleness-bound one (`stale`: learner paced to >= 1 s a step, eta 4); the baseline
  (decoupled, no replay), naive + replay, decoupled + replay, D-ARL, and D-ARL without selection
  and without P-MIS (in `gen`); 5 seeds. results.json holds the design and the primary tests'
  definitions before the first run (`experiment/report_budget.py`), their figures after;
- `budget2`: the preregistered two-phase experiment on the same testbed (experiment/prereg.py):
  phase A (seeds 0-4, both regimes) reruns the published cells and adds naive async and
  decoupled PPO at lr 2e-4 without replay and five D-ARL variants (the clip anchored at each
  sample's behavior policy or at the balance mixture); a rule fixed in advance chooses one
  variant, or stops for futility; phase B runs it against each regime's best baseline on fresh
  seeds from 5, as many as the power rule sets from phase A's spread; a second task (3-digit
  chain_sum) is a secondary family. results.json holds the design before the first run and phase
  B's plan before its first run; a rerun with another design is refused.
Each run evaluates held-out accuracy inside its loop every `eval.every_steps` steps, so it yields
a curve against steps, generated samples and wall-clock. Writes into `--out` (and, with
`--publish DIR`, copies into DIR): `results.md` (a table per eta, or per eta and rate: accuracy at
the smallest sample budget every run reached, AUC over it, final accuracy, with intervals across
seeds; D-ARL minus each method paired by seed, Holm-corrected; drift diagnostics beside them:
PPO clip fraction, ESS of the oldest version, KL, reused share, staleness reached),
`curves_{steps,samples,wall_s}.png` (one panel per table, mean and min-max band over seeds),
`results.json`; prints the tables, and last one JSON object. Rerunning skips finished runs (a
half-finished one is redone), so an interrupted experiment continues where it stopped.
What it is not: a benchmark of speed (bench/async_speedup.py) or a verdict: it prints what it
measures, whichever method wins.

    python scripts/compare_async.py --quick --out /tmp/cmp        # CI: a few minutes
    python scripts/compare_async.py --out runs/compare --publish docs/results   # the comparison
    python scripts/compare_async.py --plan                        # runs and time budget, then exit
    python scripts/compare_async.py --size budget --out runs/budget --publish docs/results   # D-ARL's claim
    python scripts/compare_async.py --size budget --out runs/budget --report-only   # interim: finished runs only
    python scripts/compare_async.py --size budget2 --out runs/budget2 --publish docs/results/budget2   # two phases
    python scripts/compare_async.py --size bf16 --out runs/bf16 --publish docs/results/bf16 --design-only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's package

from experiment import plan as P
from experiment.analysis import collapsed
from experiment.api import DARL_VARIANTS
from experiment.prereg_run import plan_lines, run_experiment, second_task_size, write_design
from experiment.primary import baseline_gains
from experiment.report import build_report, finite, markdown, plot_curves
from experiment.report_budget import DesignChanged, budget_markdown, budget_report, planned
from experiment.runs import NotRun, RunFailed, prepare_warm_start, read_result, run_or_reuse
from megatron_darl.launch.warmstart import read_stats

# The time budget printed by --plan, for a quiet small CPU machine (docs/measurements.md): seconds per training step by
# method at the default size (batch 32 x 8, paced to >= 1 s; synchronous steps add generation to
# it, D-ARL's add the recompute over its candidates), one in-loop evaluation of 500 problems, and
# the fixed cost of a run (start-up of the launcher, engine, manager and learner, evaluation before
# and after, export, teardown). Every run records its own wall and CPU seconds in
# runs/<name>/experiment_cost.json, to check these figures against.
STEP_S = {"sync": 1.5, "darl": 1.2, "darl_nosel": 1.2, "darl_nopmis": 1.2, "darl_d0": 1.2, "darl_d1": 1.2,
          "darl_d7": 1.2, **dict.fromkeys(DARL_VARIANTS, 1.2), "*": 1.0}
EVAL_S = 1.5
OVERHEAD_S = 35.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/cpu_demo_darl.yaml", help="base recipe of every run")
    p.add_argument("--out", default="runs/compare", help="experiment folder (runs, logs, tables, plots)")
    p.add_argument("--size", choices=list(P.SIZES), default="seeds")
    p.add_argument("--quick", action="store_const", const="quick", dest="size", help="same as --size quick")
    p.add_argument("--methods", nargs="+", help="main methods (default: the size's)")
    p.add_argument("--ablations", nargs="*", help="D-ARL ablations, at the tuning eta (default: the size's)")
    p.add_argument("--etas", nargs="+", type=int)
    p.add_argument("--regimes", nargs="+", help="budget size: the regimes to run (default: all)")
    p.add_argument("--seeds", nargs="+", type=int)
    p.add_argument("--lr-grid", nargs="+", type=float, dest="lr_grid", help="learning rates tuned per method")
    p.add_argument("--mb-grid", nargs="+", type=int, dest="mb_grid",
                   help="algo.ppo_n_minibatches values tuned with the rate (default: the recipe's, not tuned)")
    p.add_argument("--tune-eta", type=int, dest="tune_eta")
    p.add_argument("--tune-seeds", nargs="+", type=int, dest="tune_seeds")
    p.add_argument("--steps", type=int)
    p.add_argument("--every", type=int, help="eval.every_steps")
    p.add_argument("--extra", nargs="*", default=[], help="overrides applied to every run, after the size's")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds before one run counts as failed")
    p.add_argument("--plan", action="store_true", help="print the runs and the time budget, then exit")
    p.add_argument("--design-only", action="store_true", dest="design_only",
                   help="preregistered sizes: write results.json's design into --out (and --publish), then exit")
    p.add_argument("--report-only", action="store_true", dest="report_only",
                   help="run nothing: tables, plots and results.json from the finished runs (an interim report)")
    p.add_argument("--no-gate", action="store_true", dest="no_gate",
                   help="budget size: run every cell even when the baseline gains less than the size's gain gate")
    p.add_argument("--publish", help="also copy results.md, results.json and the plots into this folder "
                                     "(e.g. docs/results)")
    return p


def _size(args) -> P.Size:
    size = P.with_overrides(P.SIZES[args.size], methods=args.methods, ablations=args.ablations, etas=args.etas,
                            seeds=args.seeds, lr_grid=args.lr_grid, mb_grid=args.mb_grid, tune_eta=args.tune_eta,
                            tune_seeds=args.tune_seeds, steps=args.steps, every=args.every)
    if args.regimes:
        size = P.with_overrides(size, regimes=tuple(r for r in size.regimes if r.name in args.regimes),
                                ablation_regimes=tuple(r for r in size.ablation_regimes if r in args.regimes))
    if args.tune_eta is None and size.tune_eta not in size.etas:
        size = P.with_overrides(size, tune_eta=size.etas[0])
    if args.tune_seeds is None and not set(size.tune_seeds) <= set(size.seeds):
        size = P.with_overrides(size, tune_seeds=size.seeds[:1])
    return size


def _preflight(args, size: P.Size, specs) -> str | None:
    """Load the resolved config of every distinct method's first run now, so that a bad
    override (a typo in --extra, evaluation switched off) stops the experiment before it starts."""
    from megatron_darl.config import ConfigError, load_config

    for spec in {(s.method, s.regime): s for s in reversed(specs)}.values():
        try:
            load_config(args.config, P.run_overrides(spec, size, args.extra))
        except (ConfigError, ValueError, FileNotFoundError) as exc:
            return f"{spec.name}: {exc}"
    return None


class Driver:
    """Runs specs in order, with a progress line per run and an estimate of what is left."""

    def __init__(self, args, size: P.Size, total: int):
        self.args, self.size, self.total = args, size, total
        self.done, self.ran, self.failed, self.spent = 0, 0, [], 0.0  # ran: runs made here, not reused
        self.missing: list[str] = []  # --report-only: runs without a finished folder
        self.seen: dict[str, object] = {}  # results of this session by run name (tuning runs reused)
        self.warm = prepare_warm_start(args.out, args.config, [*size.settings, *args.extra])

    def run(self, specs) -> list:
        results = []
        self.total = max(self.total, self.done + len({s.name for s in specs} - set(self.seen)))
        for spec in specs:
            if spec.name in self.seen:
                results.append(self.seen[spec.name])
                continue
            over = P.run_overrides(spec, self.size, self.args.extra)
            self.done += 1
            head = f"[{self.done}/{self.total}] {spec.name:34s}"
            try:
                steps = spec.length(self.size.steps, self.size.every)[0]
                run_dir, reused, secs = run_or_reuse(spec, self.args.out, self.args.config, self.warm, over,
                                                     steps, True, self.args.run_timeout, self.size.budget,
                                                     run=not self.args.report_only)
                r = read_result(spec, run_dir)
            except NotRun:
                self.missing.append(spec.name)
                print(f"{head} not run yet (--report-only)", flush=True)
                continue
            except RunFailed as exc:
                self.failed.append(str(exc))
                print(f"{head} failed: {exc}", flush=True)
                continue
            self.spent += secs
            self.ran += 0 if reused else 1
            self.seen[spec.name] = r
            results.append(r)
            stale = "-" if r.staleness_mean is None else f"{r.staleness_mean:.2f}/{r.staleness_max:.0f}"
            left = self.spent / max(1, self.ran) * (self.total - self.done)  # at the pace of runs made here
            print(f"{head} {'reused' if reused else f'{secs:.0f} s'}: accuracy {100 * r.curve.accuracy[0]:.1f}% -> "
                  f"{100 * r.final_accuracy:.1f}%{' (collapsed)' if collapsed(r) else ''}, staleness mean/max "
                  f"{stale}; about {left / 60:.0f} min left", flush=True)
        return results


def _pilot(drv: "Driver", size: P.Size) -> tuple[P.Size, dict | None, str | None]:
    """Run the pilot (if the size has one): check the warm start's accuracy, add the chosen rate
    to the grid. Returns the size to run, what the pilot measured, and why to stop (or None)."""
    if not size.pilot_lrs:
        return size, None, None
    pilots = drv.run(P.pilot_specs(size))
    if not pilots:
        return size, None, "every pilot run failed"
    warm = pilots[0].curve.accuracy[0]
    if size.warm_range and not size.warm_range[0] <= warm <= size.warm_range[1]:
        return size, None, (f"the warm start's accuracy {100 * warm:.1f}% is outside {size.warm_range}: "
                            f"change demo.sft_steps (--extra) and rerun")
    chosen, clip = P.pilot_choice(size, pilots)
    rate = chosen if chosen is not None else max(size.pilot_lrs)
    print(f"pilot: clip fraction by rate {clip}; higher rate {rate:g}"
          f"{'' if chosen is not None else f' (none reached {size.pilot_clip:.0%}: the largest tried)'}", flush=True)
    info = {"clip_frac": clip, "rate": rate, "reached": chosen is not None, "threshold": size.pilot_clip,
            "method": size.pilot_method, "steps": size.pilot_steps, "warm_start_accuracy": warm,
            "final_accuracy": {f"{r.spec.lr:g}": r.final_accuracy for r in pilots}, "runs_wall_s": runs_wall_s(pilots)}
    return P.with_overrides(size, lr_grid=(*size.lr_grid, rate)), info, None


def _gate(drv: "Driver", size: P.Size, skip: bool) -> str | None:
    """A budget size runs its baseline first, in every regime; why to stop before the other
    cells when its mean gain from step 0 at the budget is below `size.gain_gate` in a regime."""
    if not size.budget or not size.gain_gate:
        return None
    base = drv.run([s for s in P.main_specs(size, {}) if s.method == size.baseline])
    gains = baseline_gains(base, size)
    print("baseline gain from step 0 at the budget: "
          + ", ".join(f"{k} {100 * v:+.1f} points" for k, v in gains.items()), flush=True)
    low = {k: v for k, v in gains.items() if v < size.gain_gate}
    if low and not skip:
        return (f"the baseline gains less than {100 * size.gain_gate:.0f} points in {sorted(low)}: this testbed has "
                f"too little RL signal for the comparison (--no-gate runs it anyway)")
    return None


def runs_wall_s(results: list) -> float:
    """The runs' own wall seconds summed (each run records its invocation's, reused or not)."""
    return round(sum((r.run_cost or {}).get("wall_s", 0.0) for r in results), 1)


def publish(out: str, dest: str) -> None:
    """Copy the outputs a reader needs (results.md, results.json, the plots) into `dest`."""
    os.makedirs(dest, exist_ok=True)
    for name in ("results.md", "results.json", "curves_steps.png", "curves_samples.png", "curves_wall_s.png"):
        if os.path.isfile(os.path.join(out, name)):
            shutil.copyfile(os.path.join(out, name), os.path.join(dest, name))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    size = _size(args)
    errs = size.check()
    if errs:
        print("compare_async: " + "; ".join(errs), file=sys.stderr)
        return 2
    if size.prereg is not None:
        return _prereg(args, size)
    pilots = P.pilot_specs(size) if size.pilot_lrs else []
    planned = P.with_overrides(size, lr_grid=(*size.lr_grid, max(size.pilot_lrs))) if pilots else size
    tuning = P.tuning_specs(planned)
    main_guess = P.main_specs(planned, {m: planned.grid()[0] for m in planned.methods})
    tuned_cells = {(t.method, t.eta, t.seed) for t in tuning}  # main runs the tuning phase already made
    main_new = [m for m in main_guess if (m.method, m.eta, m.seed) not in tuned_cells]
    total = len(pilots) + len(tuning) + len(main_new)
    budget = P.estimate_s([*pilots, *tuning, *main_new], planned, STEP_S, EVAL_S, OVERHEAD_S)
    print(_plan_line(planned, pilots, tuning, main_guess, total, budget), flush=True)
    if args.plan:
        return 0
    bad = _preflight(args, planned, [*pilots, *tuning, *main_guess])
    if bad:
        print(f"compare_async: {bad}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    plan_doc = write_plan(args.out, size) if size.budget else None  # the design, before any run
    t0 = time.time()
    drv = Driver(args, size, total)
    size, pilot, stop = _pilot(drv, size)
    stop = stop or _gate(drv, size, args.no_gate)  # a warm start out of range, a testbed without signal
    if stop:
        print(f"compare_async: {stop}", file=sys.stderr)
        return 2
    tuned = drv.run(tuning)
    best, scores = P.best_settings(size, tuned)
    drv.failed += P.untuned(size, best)
    if size.tune:
        print("tuned: " + ", ".join(f"{m} {g.label}" for m, g in best.items()), flush=True)
    results = drv.run(P.main_specs(size, best))
    report = build_report(results, size, best if size.tune else {}, scores, tuned, pilot)
    # wall_s: this invocation (seconds when it reuses finished runs); runs_wall_s: the main runs' own
    # wall times summed, which a rerun keeps
    report.update({"failed": drv.failed, "not_run": drv.missing, "wall_s": round(time.time() - t0, 1),
                   "runs_wall_s": runs_wall_s(results),
                   "warm_start": read_stats(drv.warm), "out": os.path.abspath(args.out)})
    try:
        text = _text(report, results, size, plan_doc)
    except DesignChanged as exc:
        print(f"compare_async: {exc}", file=sys.stderr)
        return 2
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as fh:
        fh.write(text)
    report["plots"] = plot_curves(results, size, args.out) if results else []
    report = finite(report)  # intervals of a single seed are NaN: null in JSON
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1, allow_nan=False)
    if args.publish:
        publish(args.out, args.publish)
    print(text, flush=True)
    print(json.dumps(report, allow_nan=False))
    return 0 if not drv.failed else 1


def _prereg(args, size: P.Size) -> int:
    """The preregistered two-phase experiment (`--size budget2`, experiment/prereg_run.py)."""
    print("\n".join(plan_lines(size, lambda specs: P.estimate_s(specs, size, STEP_S, EVAL_S, OVERHEAD_S))),
          flush=True)
    if args.plan:
        return 0
    if args.design_only:  # the preregistration, committed before any run (git history dates it)
        try:
            write_design(args.out, size)
        except DesignChanged as exc:
            print(f"compare_async: {exc}", file=sys.stderr)
            return 2
        if args.publish:
            os.makedirs(args.publish, exist_ok=True)
            shutil.copy(os.path.join(args.out, "results.json"), os.path.join(args.publish, "results.json"))
        print(f"design written: {os.path.join(args.publish or args.out, 'results.json')}", flush=True)
        return 0
    phase_a = P.main_specs(size, {})
    bad = _preflight(args, size, phase_a) or _preflight(args, second_task_size(size), phase_a[:1])
    if bad:
        print(f"compare_async: {bad}", file=sys.stderr)
        return 2

    def new_driver(out: str, sz: P.Size) -> Driver:
        return Driver(argparse.Namespace(**{**vars(args), "out": out}), sz, 0)

    code, report = run_experiment(args, size, new_driver, _gate)
    if report is None:
        return code
    if args.publish:
        publish(args.out, args.publish)
    with open(os.path.join(args.out, "results.md"), encoding="utf-8") as fh:
        print(fh.read(), flush=True)
    print(json.dumps(report, allow_nan=False))
    return code


def _text(report: dict, results: list, size: P.Size, plan_doc: dict | None) -> str:
    """results.md; a budget size's design, primary tests and diagnostics go first (and into
    `report`). DesignChanged when they differ from the design written before the runs."""
    text = markdown(report)
    missing = report.get("not_run") or []
    interim = [f"**Interim report** (`--report-only`): {len(missing)} planned runs have not run yet "
               f"({', '.join(missing)}); every figure below is from the finished runs only.", ""] if missing else []
    head, rest = text.split("\n", 1)
    if not size.budget:
        return "\n".join([head, "", *interim, rest])
    report.update(budget_report(results, size, report["warm_start"], plan_doc))
    return "\n".join([head, "", *interim, *budget_markdown(report), rest])


def write_plan(out: str, size: P.Size) -> dict:
    """results.json before the runs: the design and the primary tests' definitions (kept when it
    already holds them: a rerun continues the same experiment; `budget_report` refuses a
    changed design)."""
    path = os.path.join(out, "results.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            old = json.load(fh)
        if old.get("design"):
            return {"design": old["design"], "primary": old["primary"]}
    doc = planned(size)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
    return doc


def _plan_line(size: P.Size, pilots, tuning, main_guess, total: int, budget: float) -> str:
    if size.budget:
        regimes = ", ".join(f"{r.name} (eta {r.eta}, {' '.join(r.settings)})" for r in size.regimes)
        return (f"plan ({size.name}): {len(main_guess)} runs: {len(size.methods)} methods x regimes {regimes} x "
                f"{len(size.seeds)} seeds, and {len(size.ablations)} ablations in {list(size.ablation_regimes)}; "
                f"each stops at {size.budget} generated samples, evaluated every {size.every_samples}; estimated "
                f"{budget / 60:.0f} min on a quiet 2-core machine")
    n_abl = len({s.method for s in main_guess if s.method in size.ablations})
    pilot = (f"{len(pilots)} pilot runs ({size.pilot_method}, {size.pilot_steps} steps at rates "
             f"{list(size.pilot_lrs)}; the grid's last rate stands for the pilot's choice), " if pilots else "")
    if size.tune:
        phase = (f"{len(tuning)} tuning runs (grid {[g.label for g in size.grid()]} at eta {size.tune_eta}, "
                 f"seeds {list(size.tune_seeds)}), ")
        cells = f"{len(size.methods)} methods x etas {list(size.etas)} x {len(size.seeds)} seeds"
    else:
        phase = ""
        cells = (f"{len(size.methods)} methods x etas {list(size.etas)} x rates {list(size.lr_grid)} x "
                 f"{len(size.seeds)} seeds")
    sync = ", sync at eta 0 only" if "sync" in size.methods else ""
    return (f"plan ({size.name}): {pilot}{phase}{len(main_guess)} main runs ({cells}{sync}, {n_abl} ablations at "
            f"eta {size.tune_eta}), {total} distinct runs of {size.steps} steps; estimated {budget / 60:.0f} min "
            f"on a quiet 2-core machine")


if __name__ == "__main__":
    raise SystemExit(main())

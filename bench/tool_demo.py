"""Benchmark: the tool demo (configs/cpu_demo_tools.yaml) against the same run without the tool.

What it is: for each seed, two `darl-train` runs of the tool demo: with the Python tool
(`rollout.tool=python`) and without it (`rollout.tool=none demo.sft_tool_fraction=0`: the same
task, a warm start of direct answers only, RL with nothing to call; `rollout.filter_equal_rewards=
false`: with the filter on, seed 1234's no-tool run kept 64 of the first 50,118 groups, the rest
having no correct sample, and its first step took 437 s; 24 steps would take about 3 hours). Each is read back from its
summary.json: greedy held-out accuracy before and after RL with the paired 95% interval, the
share of samples that called the tool before and after (paired), and the command's wall time.
Prints one row per run, then per arm the median and range over seeds, and last one JSON line.
What it is not: a test (tests/unit/launch/test_warmstart_tools.py and tests/unit/rollout/test_tools*.py
check the pieces). Timings mean something only on a machine that runs nothing else.

    python3 bench/tool_demo.py [--seeds 1234 1235 1236] [--root runs/tool_demo] [--extra KEY=VALUE ...] [--keep]

`--keep` reads a run folder that already holds a finished run of this script (its summary.json
and the wall time it recorded, bench_wall.json) instead of running it again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.smollm2_run import run as run_recipe

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "cpu_demo_tools.yaml")
ARMS = {"tool": ["rollout.tool=python"],
        "no tool": ["rollout.tool=none", "demo.sft_tool_fraction=0", "rollout.filter_equal_rewards=false"]}


def run(run_dir: str, extra: list[str], timeout_s: float, keep: bool = False) -> tuple[dict, float]:
    """One fresh run of the recipe into `run_dir` (bench/smollm2_run.py's), or with `keep` the
    finished one there: its summary.json and wall seconds."""
    summary, wall_file = os.path.join(run_dir, "summary.json"), os.path.join(run_dir, "bench_wall.json")
    if not (keep and os.path.isfile(summary) and os.path.isfile(wall_file)):
        wall = run_recipe(run_dir, extra, timeout_s, recipe=RECIPE)
        with open(wall_file, "w", encoding="utf-8") as fh:
            json.dump({"wall_s": wall, "overrides": extra}, fh)
    with open(wall_file, encoding="utf-8") as fh:
        recorded = json.load(fh)
    if recorded.get("overrides") != extra:
        raise SystemExit(f"{run_dir} holds a run with {recorded.get('overrides')}, not {extra}: "
                         "remove it or drop --keep")
    with open(summary, encoding="utf-8") as fh:
        return json.load(fh), float(recorded["wall_s"])


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def row(arm: str, seed: int, s: dict, wall: float) -> dict:
    lo, hi = s["gain_ci95"]
    out = {"arm": arm, "seed": seed, "before": s["accuracy_before"], "after": s["accuracy_after"],
           "gain": s["gain"], "gain_lo": lo, "gain_hi": hi, "wall_s": round(wall, 1),
           "calls_before": s.get("tool_call_rate_before"), "calls_after": s.get("tool_call_rate_after")}
    print(f"{arm:8s} seed {seed}: {pct(out['before'])}% -> {pct(out['after'])}%, gain {100 * out['gain']:+.1f} "
          f"(95% CI {100 * lo:+.1f} to {100 * hi:+.1f}); samples calling the tool {pct(out['calls_before'])}% -> "
          f"{pct(out['calls_after'])}%; {wall / 60:.1f} min", flush=True)
    return out


def summarize(rows: list[dict]) -> dict:
    out = {}
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        out[arm] = {k: {"median": statistics.median(r[k] for r in mine), "min": min(r[k] for r in mine),
                        "max": max(r[k] for r in mine)}
                    for k in ("before", "after", "gain", "gain_lo", "wall_s")}
        g = out[arm]["gain"]
        print(f"{arm:8s} over {len(mine)} seeds: gain median {100 * g['median']:+.1f} points (range "
              f"{100 * g['min']:+.1f} to {100 * g['max']:+.1f}); lower 95% bound above 0 in "
              f"{sum(r['gain_lo'] > 0 for r in mine)} of {len(mine)}; wall median "
              f"{out[arm]['wall_s']['median'] / 60:.1f} min")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235, 1236])
    ap.add_argument("--root", default="runs/tool_demo")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--keep", action="store_true", help="read finished runs of this script instead of re-running")
    args = ap.parse_args()
    rows = []
    for seed in args.seeds:
        for arm in args.arms:
            folder = os.path.join(args.root, f"{arm.replace(' ', '_')}_{seed}")
            summary, wall = run(folder, [*ARMS[arm], f"train.seed={seed}", *args.extra], args.timeout, args.keep)
            rows.append(row(arm, seed, summary, wall))
    print(json.dumps({"runs": rows, "summary": summarize(rows)}))


if __name__ == "__main__":
    main()

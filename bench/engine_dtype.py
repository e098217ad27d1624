"""Benchmark: the demo with an fp32 and a bf16 darl-engine: mismatch, speed, gain, probe cost.

What it is: the README's demo (configs/cpu_demo_darl.yaml, learner fp32; `--config` another recipe,
such as configs/cpu_smollm2_word_problems_darl.yaml) run whole `--runs` times
for each engine dtype of `--dtypes`, the weight probe on, every run in a fresh folder (the warm
start is made once and copied: it does not depend on the engine), then read back:
- the engine-learner mismatch the learner logs each step (`algo/mismatch_*`, docs/ALGORITHM.md:
  mean and max |behavior - learner log-prob| at the same version, KL(mu || pi) and the share of
  tokens a PPO ratio would clip at lr = 0), median over the steps that logged it: only steps with
  tokens at a version the learner holds do, and `--extra learner.mismatch_every=1` makes every
  step hold the versions of its fresh tokens ("steps with mismatch", "tokens compared");
- the weight probe (`rollout/probe_max_abs`: what each version's check saw; its cost, the
  learner's forward `perf/probe_learner_s` against the step `perf/step_s`, and the engine's check
  `rollout/probe_s`, which runs inside the weight update);
- engine tokens/s (generated tokens per engine-second with requests in flight) and the demo's
  greedy held-out gain;
- before the runs, one matmul of the engine's shape class (64x128 @ 128x512, one thread) per
  dtype: whether this CPU computes bf16 or fp16 natively (AVX512-BF16, AMX) or emulates it.
Per dtype it prints the median and the range over the runs (never the best run), then one JSON line.
What it is not: a test (tests/integration/test_e2e_engine_dtype.py checks a bf16 run end to end;
tests/faults/test_weight_probe.py what the probe catches). Timings mean something only on a
machine that runs nothing else.

    python3 bench/engine_dtype.py [--runs 3] [--dtypes float32 bfloat16] [--probe-tokens 256]
                                  [--config configs/cpu_demo_darl.yaml] [--root runs/engine_dtype]
                                  [--extra KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiment.runs import child_env  # noqa: E402 (the checkout first on the path)

DEMO = os.path.join(ROOT, "configs", "cpu_demo_darl.yaml")
MISMATCH = ("abs_mean", "abs_max", "kl", "clip_frac", "tokens_frac")


def _smollm2_read():
    """bench/smollm2_run.py's `read` (gain, engine tokens/s, ... of a run folder): one reader."""
    spec = importlib.util.spec_from_file_location("smollm2_run", os.path.join(ROOT, "bench", "smollm2_run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.read


def matmul_us(dtype: str, reps: int = 200) -> float:
    """Microseconds of one 64x128 @ 128x512 matmul in `dtype` on one thread (median of `reps`)."""
    import torch

    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    a, b = torch.randn(64, 128).to(dt), torch.randn(128, 512).to(dt)
    for _ in range(10):
        a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def run_one(run_dir: str, dtype: str, probe_tokens: int, extra: list[str], model_from: str | None,
            timeout_s: float, config: str = DEMO) -> float:
    """One run of `config` into a fresh `run_dir` (the warm start or converted model copied from
    `model_from` when given); the command's wall seconds."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    if model_from:
        shutil.copytree(model_from, os.path.join(run_dir, "model"))
    cmd = [sys.executable, "-m", "megatron_darl", "train", "--config", config, f"train.run_dir={run_dir}",
           f"rollout.engine_dtype={dtype}", f"rollout.probe_tokens={probe_tokens}", "logging.progress=false", *extra]
    print("running:", " ".join(cmd), flush=True)
    start = time.monotonic()
    with open(os.path.join(run_dir, "bench.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, env=child_env()).returncode
    if rc != 0:
        raise RuntimeError(f"darl-train exited {rc}; see {run_dir}/bench.log")
    return time.monotonic() - start


def read_run(run_dir: str, read) -> dict:
    """`read`'s figures plus the medians over steps 1.. of the mismatch and the probe."""
    out = read(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    every = sorted((m for m in rows if "train/batch_groups" in m), key=lambda m: m.get("step", -1))
    steps = every[1:]  # timings and the probe: step 0 pays the start-up
    med = lambda key, rows=steps: statistics.median(v) if (v := [m[key] for m in rows if key in m]) else None  # noqa: E731
    for k in MISMATCH:  # every step that logged it: only steps with tokens at a version the learner holds do
        out[f"mismatch_{k}"] = med(f"algo/mismatch_{k}", every)
    out["mismatch_steps"] = sum("algo/mismatch_abs_mean" in m for m in every)
    out["probe_max_abs"] = med("rollout/probe_max_abs")
    worst = [m["rollout/probe_max_abs"] for m in steps if "rollout/probe_max_abs" in m]
    out["probe_max_abs_worst"] = max(worst) if worst else None
    out["probe_failures"] = steps[-1].get("rollout/probe_failures") if steps else None
    step_s, learner_s, engine_s = med("perf/step_s"), med("perf/probe_learner_s"), med("rollout/probe_s")
    out.update(step_s=step_s, probe_learner_s=learner_s, probe_engine_s=engine_s,
               probe_learner_frac=learner_s / step_s if learner_s is not None and step_s else None)
    out.pop("curve", None)
    return out


def spread(values: list) -> str:
    """'median (min to max)' of the non-missing values."""
    v = [x for x in values if x is not None]
    if not v:
        return "not logged"
    if len(v) == 1:
        return f"{v[0]:.3g}"
    return f"{statistics.median(v):.3g} ({min(v):.3g} to {max(v):.3g})"


ROWS = (("gain", "held-out gain (points)", 100.0), ("mismatch_steps", "steps with mismatch", 1.0),
        ("mismatch_abs_mean", "mean |b - p|", 1.0),
        ("mismatch_abs_max", "max |b - p|", 1.0), ("mismatch_kl", "KL(mu || pi)", 1.0),
        ("mismatch_clip_frac", "clipped at lr 0", 1.0), ("mismatch_tokens_frac", "tokens compared", 1.0),
        ("probe_max_abs", "probe max |delta|", 1.0),
        ("probe_failures", "probe failures", 1.0), ("engine_tokens_per_s", "engine tokens/s", 1.0),
        ("step_s", "step s", 1.0), ("probe_learner_s", "probe learner s", 1.0),
        ("probe_learner_frac", "probe / step", 1.0), ("probe_engine_s", "probe engine s", 1.0),
        ("wall_s", "command s", 1.0))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--probe-tokens", type=int, default=256)
    p.add_argument("--config", default=DEMO, help="the recipe (default: the demo's)")
    p.add_argument("--root", default="runs/engine_dtype")
    p.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of the demo")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args()
    root, read = os.path.abspath(args.root), _smollm2_read()
    matmul = {d: matmul_us(d) for d in ("float32", "bfloat16", "float16")}
    print("matmul 64x128 @ 128x512, one thread: " + ", ".join(f"{d} {us:.1f} us" for d, us in matmul.items()))
    results: dict[str, list[dict]] = {d: [] for d in args.dtypes}
    model = None
    for i in range(args.runs):
        for dtype in args.dtypes:  # interleaved: a drift of the machine hits every dtype alike
            run_dir = os.path.join(root, f"{dtype}_{i}")
            wall = run_one(run_dir, dtype, args.probe_tokens, args.extra, model, args.timeout, args.config)
            made = os.path.join(run_dir, "model")  # the warm start (a packaged model is cached elsewhere)
            model = model or (made if os.path.isdir(made) else None)
            r = read_run(run_dir, read)
            r["wall_s"] = wall
            results[dtype].append(r)
            print(f"  {dtype} run {i}: gain {100 * r['gain']:+.1f}, mean |b - p| {r['mismatch_abs_mean']}, "
                  f"{r['engine_tokens_per_s']:.0f} engine tokens/s", flush=True)
    print(f"\n{'':<24}" + "".join(f"{d:<34}" for d in args.dtypes))
    for key, label, scale in ROWS:
        cells = [spread([None if r.get(key) is None else scale * r[key] for r in results[d]]) for d in args.dtypes]
        print(f"{label:<24}" + "".join(f"{c:<34}" for c in cells))
    print(json.dumps({"matmul_us": matmul, "config": args.config, "probe_tokens": args.probe_tokens,
                      "extra": args.extra, "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Running the experiment's training runs and reading back what they measured.

What it is: `prepare_warm_start` (the supervised warm start, made once per experiment folder and
copied into every run, so all runs and seeds start from the same weights), `run_or_reuse`
(one `darl-train` subprocess per `RunSpec`, skipped when its folder already holds the finished
run with the same overrides; a half-finished folder is removed and the run redone from the
start, so that its wall-clock curve is one uninterrupted run), and `read_result` (the curve,
staleness, ESS, wall time and replay totals of a finished run from its `summary.json` and
`metrics.jsonl`).
What it is not: the choice of runs (`plan.py`) or their statistics (`analysis.py`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time

from experiment.api import Curve, RunResult, RunSpec

RUN_RECORD = "experiment_run.json"  # the overrides a run folder was made with


def child_env() -> dict[str, str]:
    """Environment of a run: one thread per process, and this package first on the path, so
    that every process of the run uses the same code as the experiment that started it."""
    import megatron_darl

    root = os.path.dirname(os.path.dirname(os.path.abspath(megatron_darl.__file__)))
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + (os.pathsep + path if path else ""))


class RunFailed(RuntimeError):
    """A training run exited non-zero or left an incomplete run folder (names its log)."""


class NotRun(RuntimeError):
    """`run_or_reuse(..., run=False)`: the run has no finished folder, and running was not asked."""


def prepare_warm_start(out: str, config: str, extra: list[str]) -> str:
    """The shared warm-started model folder (`<out>/_warm/model`), made on first use."""
    warm = os.path.join(out, "_warm")
    model = os.path.join(warm, "model")
    if not os.path.isfile(os.path.join(model, "warmstart.json")):
        code = ("import sys; from megatron_darl.config import load_config; "
                "from megatron_darl.launch.warmstart import prepare_model; "
                "prepare_model(load_config(sys.argv[1], sys.argv[2:]))")
        subprocess.run([sys.executable, "-c", code, config, f"train.run_dir={warm}", *extra], check=True,
                       env=child_env())
    return model


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _load(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def command(spec: RunSpec, run_dir: str, config: str, overrides: list[str]) -> list[str]:
    model = os.path.join(run_dir, "model")
    return [sys.executable, "-m", "megatron_darl", "train", "--config", config, f"train.run_dir={run_dir}",
            f"model.hf_dir={model}", f"model.tokenizer={model}", "model.init=hf", "checkpoint.every_steps=0",
            "logging.progress=false", *overrides]


def finished(run_dir: str, cmd: list[str], steps: int, eval_on: bool, budget: int = 0) -> bool:
    """Whether `run_dir` holds the complete run of exactly `cmd`: same overrides, the learner
    reached `steps` (or, with a sample `budget`, stopped on it or reached `steps`), the launcher
    wrote its summary, and (with evaluation on) the final version was evaluated in the loop."""
    record = _load(os.path.join(run_dir, RUN_RECORD))
    learner = _load(os.path.join(run_dir, "learner_summary.json"))
    if record is None or record.get("command") != cmd[1:] or learner is None:
        return False
    final = learner.get("final_version")
    done = final == steps or (budget > 0 and learner.get("stopped_on") == "samples")
    if not done or _load(os.path.join(run_dir, "summary.json")) is None:
        return False
    if not eval_on:
        return True
    rows = _read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    return any(r.get("eval/version") == final for r in rows)


def run_or_reuse(spec: RunSpec, out: str, config: str, warm_model: str, overrides: list[str], steps: int,
                 eval_on: bool, timeout_s: float, budget: int = 0, run: bool = True) -> tuple[str, bool, float]:
    """Run `spec` unless its finished folder exists; returns (run_dir, reused, seconds).
    `run=False`: only reuse (`NotRun` when there is nothing finished to reuse)."""
    run_dir = os.path.abspath(os.path.join(out, "runs", spec.name))
    cmd = command(spec, run_dir, config, overrides)
    if finished(run_dir, cmd, steps, eval_on, budget):
        return run_dir, True, 0.0
    if not run:
        raise NotRun(f"{spec.name}: no finished run folder")
    shutil.rmtree(run_dir, ignore_errors=True)  # half-finished or other settings: redo from the start
    shutil.copytree(warm_model, os.path.join(run_dir, "model"))
    with open(os.path.join(run_dir, RUN_RECORD), "w", encoding="utf-8") as fh:
        json.dump({"spec": spec.__dict__, "command": cmd[1:]}, fh, indent=1)
    log_path = os.path.join(out, "logs", f"{spec.name}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    t0, cpu0 = time.time(), _children_cpu_s()
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                env=child_env()).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not finished(run_dir, cmd, steps, eval_on, budget):
        why = f"exit code {rc}" if rc != 0 else "exit code 0 but the run folder is incomplete"
        raise RunFailed(f"{spec.name}: {why}; see {log_path}")
    # CPU seconds of every process of the run (each parent waits for its children): a machine-load
    # independent size of the run, for budgeting (`--plan`) on another machine
    with open(os.path.join(run_dir, "experiment_cost.json"), "w", encoding="utf-8") as fh:
        json.dump({"wall_s": time.time() - t0, "cpu_s": _children_cpu_s() - cpu0, "load1": os.getloadavg()[0]}, fh)
    return run_dir, False, time.time() - t0


def _children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _finite(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _mean(values) -> float | None:
    vals = [v for v in (_finite(x) for x in values) if v is not None]
    return sum(vals) / len(vals) if vals else None


def _oldest_ess(row: dict) -> float | None:
    """`algo/ess_frac/v{k}` of the smallest (oldest) version k the step trained on."""
    per = {int(k.rsplit("/v", 1)[1]): v for k, v in row.items() if k.startswith("algo/ess_frac/v")}
    return per[min(per)] if per else None


def drift_diagnostics(rows: list[dict]) -> dict:
    """Means over the steps of the PPO clip fraction (against the loss's anchor and against the
    behavior policy), the oldest version's ESS fraction, the k3 KL estimate, the reused share
    of the batch and the engine-learner mismatch (RunResult's drift and mismatch fields)."""
    return {"clip_frac": _mean(r.get("train/clip_frac") for r in rows),
            "clip_frac_behavior": _mean(r.get("algo/clip_frac_behavior") for r in rows),
            "ess_oldest": _mean(_oldest_ess(r) for r in rows),
            "kl_k3": _mean(r.get("algo/kl_k3") for r in rows),
            "reused_frac": _mean(r.get("replay/reused_frac") for r in rows),
            **{f"mismatch_{k}": _mean(r.get(f"algo/mismatch_{k}") for r in rows)
               for k in ("abs_mean", "kl", "clip_frac")}}


def last_total(rows: list[dict], key: str) -> float | None:
    """A cumulative counter's value in the last row that logs it: the run's total. None where no
    row logs it (a run made before the counter existed: unknown, not 0)."""
    for r in reversed(rows):
        if key in r:
            return _finite(r[key])
    return None


def read_curve(spec: RunSpec, run_dir: str, summary: dict, rows: list[dict]) -> Curve:
    """The run's curve. From `evals.jsonl` when the loop evaluated version 0 itself (a
    sample-scheduled run: every point, step 0 included, from one evaluator, with its sample mark
    and sampled accuracy); otherwise the launcher's evaluation of the warm start (step 0, 0
    samples, 0 s) then the loop's evaluations in metrics.jsonl."""
    ledger = _read_jsonl(os.path.join(run_dir, "evals.jsonl"))
    points = ledger if ledger and ledger[0].get("eval/version") == 0 else [r for r in rows if "eval/accuracy" in r]
    curve = Curve()
    if points is not ledger and "accuracy_before" in summary:
        curve.steps.append(0.0), curve.samples.append(0.0), curve.wall_s.append(0.0)
        curve.accuracy.append(float(summary["accuracy_before"]))
    for r in points:
        if "eval/samples_generated" not in r:
            raise RunFailed(f"{spec.name}: the evaluation of version {r['eval/version']:g} has no "
                            f"eval/samples_generated (the rollout manager had written no status yet)")
        curve.steps.append(float(r["eval/version"]))
        curve.samples.append(float(r["eval/samples_generated"]))
        curve.wall_s.append(float(r["eval/wall_s"]))
        curve.accuracy.append(float(r["eval/accuracy"]))
        if points is ledger:
            curve.marks.append(float(r["eval/sample_mark"]))
        if "eval/sampled_accuracy" in r:
            curve.sampled.append(float(r["eval/sampled_accuracy"]))
    if len(curve.accuracy) < 2:
        raise RunFailed(f"{spec.name}: {run_dir} has no evaluation during training (eval.every_steps, "
                        f"eval.every_samples, eval.num_problems) or no evaluation before it")
    return curve


def read_result(spec: RunSpec, run_dir: str) -> RunResult:
    """The measurements of a finished run (its curve: `read_curve`)."""
    summary = _load(os.path.join(run_dir, "summary.json")) or {}
    rows = _read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    if not rows:
        raise RunFailed(f"{spec.name}: {run_dir}/metrics.jsonl is empty")
    curve = read_curve(spec, run_dir, summary, rows)
    stale_mean = [v for v in (_finite(r.get("algo/staleness/batch/mean")) for r in rows) if v is not None]
    stale_max = [v for v in (_finite(r.get("algo/staleness/batch/max")) for r in rows) if v is not None]
    ess = [v for v in (_finite(r.get("algo/ess_frac")) for r in rows) if v is not None]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    eval_s = sum(float(r.get("perf/eval_s", 0.0)) for r in rows)
    wall = float(rows[-1]["time"]) - eval_s
    last_samples = max((float(r["eval/samples_generated"]) for r in rows if "eval/samples_generated" in r),
                       default=math.nan)
    return RunResult(
        spec=spec, curve=curve, **drift_diagnostics(rows),
        staleness_mean=sum(stale_mean) / len(stale_mean) if stale_mean else None,
        staleness_max=max(stale_max) if stale_max else None,
        ess_min=min(ess) if ess else None,
        train_wall_s=wall,
        nonfinite_loss=any(_finite(v) is None for v in losses),
        samples_generated=last_samples,
        steps_per_s=len(rows) / wall if wall > 0 else math.nan,
        run_cost=_load(os.path.join(run_dir, "experiment_cost.json")),
        evicted_untrained=last_total(rows, "replay/evicted_untrained"),
        filtered_groups=last_total(rows, "replay/filtered_groups"),
    )

"""`scripts/compare_async.py --quick` end to end: real `darl-train` runs (decoupled PPO and D-ARL at
eta 1, two seeds, 4 steps) into a temporary folder, then what only real runs can show: every run
finished with an evaluation at versions 2 and 4 (metrics.jsonl and TensorBoard, the step, samples
and wall-clock of each, the last one the launcher's final evaluation) and paced steps, D-ARL replayed and both logged
their KL and clip fraction, the table and D-ARL's paired tests come from those runs, and a
second invocation (`--report-only`) reuses every finished run (nothing is run twice) with the same
tables. The form of the outputs for four methods (markdown rows, plots, JSON) is checked on
synthetic runs in a second: tests/unit/experiment/test_compare_script.py. Checks no winner."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG = b"\x89PNG\r\n\x1a\n"


def _compare(out: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_async.py"), "--quick", "--out", out,
                           *extra], cwd=ROOT, capture_output=True, text=True, timeout=1500,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def check_periodic_evaluation(run_dir: str) -> None:
    """`eval.every_steps=2` in a real 4-step run (eval/periodic.py): held-out accuracy at versions
    2 and 4 only, in metrics.jsonl and TensorBoard, logged with the step whose update made that
    version, with the generated samples and the wall-clock without evaluation time; the last
    figure is the launcher's own evaluation of the final model."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        evals = [r for r in map(json.loads, fh) if "eval/accuracy" in r]
    assert [r["eval/version"] for r in evals] == [2.0, 4.0], run_dir
    assert [r["step"] for r in evals] == [1, 3]
    # the rollout manager's counters (its status is rewritten every second, so they may lag a step)
    assert 0 < evals[0]["eval/samples_generated"] <= evals[1]["eval/samples_generated"]
    for r in evals:
        assert 0 <= r["eval/wall_s"] <= r["time"] - r["perf/eval_s"]
    with open(os.path.join(run_dir, "summary.json")) as fh:
        assert evals[-1]["eval/accuracy"] == pytest.approx(json.load(fh)["accuracy_after"])
    acc = EventAccumulator(os.path.join(run_dir, "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [1, 3]


def check_outputs(out: str, stdout: str) -> dict:
    """The checks of one finished `--quick` folder and its stdout; returns the JSON object."""
    last = json.loads(stdout.strip().splitlines()[-1])
    with open(os.path.join(out, "results.json")) as fh:
        assert json.load(fh) == last
    assert last["failed"] == [] and last["not_run"] == []
    assert sorted(last["tables"]) == ["1"]
    table = last["tables"]["1"]
    assert list(table["rows"]) == ["decoupled_areal", "darl"]
    for row in table["rows"].values():
        assert row["seeds"] == 2 and 0.0 <= row["final_accuracy"] <= 1.0
        assert row["train_wall_s"] > 0 and row["samples_generated"] > 0 and 0 <= row["staleness_max"] <= 4
    tests = table["tests"]  # D-ARL paired with decoupled PPO on three figures, from these runs' seeds
    assert len(tests) == 3 and all(t["method"] == "decoupled_areal" and t["seeds"] == 2 for t in tests)
    runs = {r["name"]: r for r in last["runs"]}
    assert sorted(runs) == sorted(f"{m}_eta1_lr5e-05_s{s}" for m in ("decoupled_areal", "darl") for s in (0, 1))
    # D-ARL replays over K = 4 (3 versions beyond eta = 1); decoupled PPO trains fresh data only
    assert all(bool(r["reused_frac"]) == (r["method"] == "darl") for r in runs.values())
    assert all(r["kl_k3"] is not None and r["clip_frac"] is not None for r in runs.values())
    for name in runs:  # every run's curve has the warm start and each in-loop evaluation
        check_periodic_evaluation(os.path.join(out, "runs", name))
        with open(os.path.join(out, "runs", name, "metrics.jsonl")) as fh:
            rows = [json.loads(line) for line in fh]
        # the quick size paces the learner (demo.min_step_s=0.5): no step is shorter
        assert all(r["perf/step_s"] >= 0.5 and r["perf/pace_s"] >= 0.0 for r in rows)
    for axis in ("steps", "samples", "wall_s"):
        path = os.path.join(out, f"curves_{axis}.png")
        assert path in last["plots"]
        with open(path, "rb") as fh:
            assert fh.read(8) == PNG
    return last


@pytest.mark.timeout(1200)
def test_quick_comparison_runs_and_reports_from_real_runs(tmp_path):
    out = str(tmp_path / "cmp")
    proc = _compare(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = check_outputs(out, proc.stdout)

    # resumable: every finished run is reused (--report-only: it could run nothing), the same figures
    again = _compare(out, "--report-only")
    assert again.returncode == 0, again.stdout[-3000:]
    assert again.stdout.count(" reused: ") == len(last["runs"]) and "not run yet" not in again.stdout
    assert json.loads(again.stdout.strip().splitlines()[-1])["not_run"] == []
    assert json.loads(again.stdout.strip().splitlines()[-1])["tables"] == last["tables"]

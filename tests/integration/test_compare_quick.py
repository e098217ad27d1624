"""`scripts/compare_async.py --quick` end to end: real `darl-train` runs into a temporary folder,
then the outputs a user reads are there and well-formed -- a markdown table per eta whose rows
are the methods run (sync, the two replay baselines, D-ARL), D-ARL's paired tests, the three PNG
plots, `results.json` and the same JSON object as the last line of stdout, with a curve point for
every evaluation -- and a second invocation (`--report-only`) reuses every finished run
(nothing is run twice). Checks the form of the outputs, not which method wins."""

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


def check_outputs(out: str, stdout: str) -> dict:
    """The checks of one finished `--quick` folder and its stdout; returns the JSON object."""
    last = json.loads(stdout.strip().splitlines()[-1])
    with open(os.path.join(out, "results.json")) as fh:
        saved = json.load(fh)
    assert last == saved and last["failed"] == []
    methods = ["sync", "naive_replay", "decoupled_replay", "darl"]
    assert sorted(last["tables"]) == ["1"]
    for eta, table in last["tables"].items():
        assert list(table["rows"]) == methods
        for name, row in table["rows"].items():
            assert row["seeds"] == 2 and 0.0 <= row["final_accuracy"] <= 1.0
            lo, hi = row["final_accuracy_ci95"]
            assert lo <= row["final_accuracy"] <= hi
            assert 0.0 <= row["auc"] <= 1.0 and row["train_wall_s"] > 0 and row["samples_generated"] > 0
            assert row["staleness_max"] == 0 if name == "sync" else row["staleness_max"] >= 0
    runs = {r["name"]: r for r in last["runs"]}
    assert len(runs) == 2 + 3 * 2  # sync once per seed (eta 0), the replay methods at eta 1 x two seeds
    # the replay baselines and D-ARL replay over K = 4 (3 versions beyond eta = 1)
    assert any(r["reused_frac"] for r in runs.values() if r["method"] != "sync")
    assert all(r["clip_frac"] is not None for r in runs.values())
    # KL(mu || pi_prox) needs proximal log-probs: naive PPO never recomputes them
    assert all((r["kl_k3"] is None) == (r["method"] == "naive_replay") for r in runs.values())
    with open(os.path.join(out, "results.md")) as fh:
        md = fh.read()
    section = md.split("## eta = 1\n", 1)[1].split("\n## ", 1)[0].split("D-ARL minus")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 4 and all(line.count("|") == 11 for line in rows), section
    assert len(last["tables"]["1"]["tests"]) == 2 * 3  # D-ARL paired with each replay baseline on three figures
    for axis in ("steps", "samples", "wall_s"):
        path = os.path.join(out, f"curves_{axis}.png")
        assert path in last["plots"] and os.path.getsize(path) > 10_000
        with open(path, "rb") as fh:
            assert fh.read(8) == PNG
    for name in runs:  # every run's curve has the warm start and each in-loop evaluation
        with open(os.path.join(out, "runs", name, "metrics.jsonl")) as fh:
            rows = [json.loads(line) for line in fh]
        assert [r["eval/version"] for r in rows if "eval/accuracy" in r] == [2.0, 4.0]
        # the quick size paces the learner (demo.min_step_s=0.5): no step is shorter
        assert all(r["perf/step_s"] >= 0.5 and r["perf/pace_s"] >= 0.0 for r in rows)
    return last


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_quick_comparison_writes_tables_plots_and_json(tmp_path):
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

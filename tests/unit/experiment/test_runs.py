"""Reading a run folder back: which runs count as finished (resume of an experiment), and the
curve, staleness, ESS and wall time taken from `metrics.jsonl`."""

from __future__ import annotations

import json
import os

import pytest

from experiment.api import RunSpec
from experiment.runs import RUN_RECORD, NotRun, RunFailed, command, finished, read_result, run_or_reuse

SPEC = RunSpec("decoupled_areal", 2, 5e-5, 1)


def _write_run(run_dir: str, steps: int = 4, every: int = 2, final_version: int | None = None, summary=True,
               nan_loss=False) -> list[str]:
    os.makedirs(run_dir, exist_ok=True)
    cmd = command(SPEC, run_dir, "configs/cpu_demo_darl.yaml", SPEC.overrides(steps, every))
    with open(os.path.join(run_dir, RUN_RECORD), "w") as fh:
        json.dump({"command": cmd[1:]}, fh)
    with open(os.path.join(run_dir, "learner_summary.json"), "w") as fh:
        json.dump({"final_version": steps if final_version is None else final_version}, fh)
    if summary:
        with open(os.path.join(run_dir, "summary.json"), "w") as fh:
            json.dump({"accuracy_before": 0.2}, fh)
    rows = []
    for step in range(steps):
        r = {"step": step, "time": 3.0 * (step + 1), "train/loss": "nan" if nan_loss and step == 1 else 0.1,
             "algo/staleness/batch/mean": 0.5 * step, "algo/staleness/batch/max": float(step),
             "algo/ess_frac": 1.0 - 0.1 * step, "train/clip_frac": 0.01 * step, "algo/kl_k3": 0.001,
             "replay/reused_frac": 0.25 * (step > 1), f"algo/ess_frac/v{step}": 1.0,
             **({f"algo/ess_frac/v{step - 2}": 0.5 - 0.1 * step} if step >= 2 else {})}
        if (step + 1) % every == 0:
            r.update({"eval/accuracy": 0.2 + 0.05 * (step + 1), "eval/version": float(step + 1),
                      "eval/samples_generated": 100.0 * (step + 1), "eval/wall_s": 2.0 * (step + 1),
                      "perf/eval_s": 0.5})
        rows.append(r)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return cmd


def test_a_complete_run_with_the_same_command_is_finished(tmp_path):
    run = str(tmp_path / "r")
    cmd = _write_run(run)
    assert finished(run, cmd, steps=4, eval_on=True)
    other = RunSpec(SPEC.method, SPEC.eta, 1e-4, SPEC.seed)
    assert not finished(run, command(other, run, "configs/cpu_demo_darl.yaml", other.overrides(4, 2)), steps=4,
                        eval_on=True)  # same folder, other settings (a changed grid): redo


def test_report_only_reuses_a_finished_run_and_runs_nothing_else(tmp_path):
    """`run_or_reuse(..., run=False)` (compare_async --report-only): a finished folder is reused;
    a half-finished one is left as it is (not removed, not run) and reported as not run."""
    out = tmp_path / "exp"
    run_dir = str(out / "runs" / SPEC.name)
    cmd = _write_run(run_dir)
    over = SPEC.overrides(4, 2)
    assert run_or_reuse(SPEC, str(out), "configs/cpu_demo_darl.yaml", "/nonexistent", over, 4, True, 1.0,
                        run=False)[:2] == (os.path.abspath(run_dir), True)
    assert cmd[1:] == json.load(open(os.path.join(run_dir, RUN_RECORD)))["command"]
    _write_run(run_dir, final_version=2)  # half-finished
    with pytest.raises(NotRun, match=SPEC.name):
        run_or_reuse(SPEC, str(out), "configs/cpu_demo_darl.yaml", "/nonexistent", over, 4, True, 1.0, run=False)
    assert os.path.isfile(os.path.join(run_dir, "learner_summary.json"))  # left as it was


def test_half_finished_runs_are_not_finished(tmp_path):
    cmd = _write_run(str(tmp_path / "a"), final_version=2)  # preempted / killed learner
    assert not finished(str(tmp_path / "a"), cmd, steps=4, eval_on=True)
    cmd = _write_run(str(tmp_path / "b"), summary=False)  # launcher died before its summary
    assert not finished(str(tmp_path / "b"), cmd, steps=4, eval_on=True)
    cmd = _write_run(str(tmp_path / "c"), every=3)  # the last version was never evaluated
    assert not finished(str(tmp_path / "c"), cmd, steps=4, eval_on=True)
    assert finished(str(tmp_path / "c"), cmd, steps=4, eval_on=False)  # with evaluation off it is done


def test_read_result_curve_and_diagnostics(tmp_path):
    run = str(tmp_path / "r")
    _write_run(run)
    r = read_result(SPEC, run)
    assert r.curve.steps == [0.0, 2.0, 4.0] and r.curve.samples == [0.0, 200.0, 400.0]
    assert r.curve.accuracy == pytest.approx([0.2, 0.3, 0.4]) and r.curve.wall_s == [0.0, 4.0, 8.0]
    assert r.staleness_mean == pytest.approx(0.75) and r.staleness_max == 3.0 and r.ess_min == pytest.approx(0.7)
    assert r.train_wall_s == pytest.approx(12.0 - 1.0) and not r.nonfinite_loss
    # drift diagnostics: means over steps; the oldest version's ESS is v{step-2} once there is one
    assert r.clip_frac == pytest.approx(0.015) and r.kl_k3 == pytest.approx(0.001)
    assert r.reused_frac == pytest.approx(0.125) and r.ess_oldest == pytest.approx((1 + 1 + 0.3 + 0.2) / 4)
    _write_run(run, nan_loss=True)
    assert read_result(SPEC, run).nonfinite_loss


def test_read_result_names_a_run_without_evaluations(tmp_path):
    run = str(tmp_path / "r")
    _write_run(run, every=5)  # steps=4: no evaluation inside the loop
    with pytest.raises(RunFailed, match="no evaluation during training"):
        read_result(SPEC, run)


def test_report_of_the_seeds_size_tables_tests_and_drift(tmp_path):
    """Per (eta, rate) table with the decided figures and the drift diagnostics, D-ARL's paired
    tests against each method with Holm-corrected p-values, in markdown and JSON."""
    from experiment.api import Curve, RunResult
    from experiment.plan import SIZES, with_overrides
    from experiment.report import build_report, markdown

    size = with_overrides(SIZES["seeds"], lr_grid=(5e-5, 2e-4))
    results = []
    for lr in size.lr_grid:
        for m, gain in (("decoupled_areal", 0.0), ("naive_replay", -0.02), ("decoupled_replay", 0.01), ("darl", 0.03)):
            for seed in size.seeds:
                acc = [0.2, 0.25 + gain + 0.01 * seed, 0.3 + gain + 0.005 * seed]
                curve = Curve([0.0, 30.0, 60.0], [0.0, 900.0 + seed, 1800.0 + seed], [0.0, 40.0, 80.0], acc)
                results.append(RunResult(RunSpec(m, 1, lr, seed), curve, 0.8, 4.0, 0.6, 80.0, False, 1800.0, 0.7,
                                         clip_frac=0.04, ess_oldest=0.9, kl_k3=1e-3,
                                         reused_frac=0.3 * (m != "decoupled_areal")))
    rep = build_report(results, size, {}, {}, [], pilot={"rate": 2e-4})
    assert list(rep["tables"]) == ["1/lr5e-05", "1/lr0.0002"]
    fig = rep["tables"]["1/lr5e-05"]
    assert fig["x_common"] == 1800.0 and fig["rows"]["darl"]["accuracy_at_budget"] == pytest.approx(0.3375, abs=1e-3)
    tests = fig["tests"]
    others = ("decoupled_areal", "naive_replay", "decoupled_replay")
    figures = ("accuracy_at_budget", "auc", "final_accuracy")
    assert {(t["method"], t["figure"]) for t in tests} == {(m, f) for m in others for f in figures}
    final = next(t for t in tests if t["method"] == "naive_replay" and t["figure"] == "final_accuracy")
    assert final["diff"] == pytest.approx(0.05) and final["seeds"] == 4
    all_tests = [t for f in rep["tables"].values() for t in f["tests"]]
    assert len(all_tests) == 18 and all(t["p_holm"] >= t["p"] for t in all_tests)
    md = markdown(rep)
    assert "## eta = 1, lr 5e-05" in md and "## eta = 1, lr 0.0002" in md and "p Holm" in md
    assert "| D-ARL (K = eta + 3) |" in md and "ESS oldest version" in md


def _ledger(run_dir: str, points: list[tuple[int, float, float, float]]) -> None:
    """evals.jsonl of a sample-scheduled run: (version, mark, samples, accuracy) per evaluation."""
    with open(os.path.join(run_dir, "evals.jsonl"), "w") as fh:
        for v, mark, samples, acc in points:
            fh.write(json.dumps({"eval/version": float(v), "eval/sample_mark": mark, "eval/samples_generated": samples,
                                 "eval/wall_s": 2.0 * v, "eval/accuracy": acc, "eval/sampled_accuracy": acc / 2})
                     + "\n")


def test_a_budget_run_is_finished_when_it_stopped_on_the_budget(tmp_path):
    run = str(tmp_path / "r")
    cmd = _write_run(run, steps=4, every=2)
    with open(os.path.join(run, "learner_summary.json"), "w") as fh:
        json.dump({"final_version": 4, "stopped_on": "samples"}, fh)
    assert not finished(run, cmd, steps=100, eval_on=True)  # no budget: 4 of 100 steps is unfinished
    assert finished(run, cmd, steps=100, eval_on=True, budget=400)
    with open(os.path.join(run, "learner_summary.json"), "w") as fh:
        json.dump({"final_version": 4, "stopped_on": "preempted"}, fh)
    assert not finished(run, cmd, steps=100, eval_on=True, budget=400)


def test_the_curve_of_a_sample_scheduled_run_comes_from_its_ledger(tmp_path):
    run = str(tmp_path / "r")
    _write_run(run)
    _ledger(run, [(0, 0.0, 0.0, 0.3), (3, 1000.0, 1010.0, 0.35), (5, 2000.0, 2050.0, 0.4)])
    r = read_result(SPEC, run)
    assert r.curve.steps == [0.0, 3.0, 5.0] and r.curve.samples == [0.0, 1010.0, 2050.0]
    assert r.curve.marks == [0.0, 1000.0, 2000.0] and r.curve.accuracy == [0.3, 0.35, 0.4]  # not summary's 0.2
    assert r.curve.scored_on("sampled").accuracy == [0.15, 0.175, 0.2]
    plain = str(tmp_path / "p")
    _write_run(plain)
    with pytest.raises(ValueError, match="sampled"):
        read_result(SPEC, plain).curve.scored_on("sampled")


def test_the_replay_totals_are_the_last_logged_counters_and_unknown_where_never_logged(tmp_path):
    run = str(tmp_path / "r")
    _write_run(run)
    r = read_result(SPEC, run)
    assert r.evicted_untrained is None and r.filtered_groups is None  # a run without the counters: unknown
    path = os.path.join(run, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)]
    for i, row in enumerate(rows):  # cumulative counters; the last row logs only the behavior clip
        row.update({"replay/evicted_untrained": float(2 * i), "replay/filtered_groups": float(i * i)}
                   if i < len(rows) - 1 else {})
        row["algo/clip_frac_behavior"] = 0.1 * i
    with open(path, "w") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)
    r = read_result(SPEC, run)
    assert r.evicted_untrained == 2.0 * (len(rows) - 2) and r.filtered_groups == float((len(rows) - 2) ** 2)
    assert r.clip_frac_behavior == pytest.approx(0.1 * sum(range(len(rows))) / len(rows))

"""Reading a run folder back: which runs count as finished (resume of an experiment), and the
curve, staleness, ESS and wall time taken from `metrics.jsonl`."""

from __future__ import annotations

import json
import os

import pytest

from megatron_darl.experiment.api import RunSpec
from megatron_darl.experiment.runs import RUN_RECORD, RunFailed, command, finished, read_result

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
             "algo/ess_frac": 1.0 - 0.1 * step}
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
    _write_run(run, nan_loss=True)
    assert read_result(SPEC, run).nonfinite_loss


def test_read_result_names_a_run_without_evaluations(tmp_path):
    run = str(tmp_path / "r")
    _write_run(run, every=5)  # steps=4: no evaluation inside the loop
    with pytest.raises(RunFailed, match="no evaluation during training"):
        read_result(SPEC, run)

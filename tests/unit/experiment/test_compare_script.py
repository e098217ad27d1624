"""`scripts/compare_async.py` as a user runs it, on synthetic finished runs: every run of the
`--quick` plan with four methods (`--methods sync naive_replay decoupled_replay darl`) is a folder
written here (the exact command the script would run, its metrics and
evaluations), and `--report-only` turns them into the outputs a user reads -- a markdown table per
eta whose rows are the methods (sync, the two replay baselines, D-ARL), D-ARL's paired tests, the
three PNG plots, `results.json` and the same JSON object as the last line of stdout -- reusing
every run (nothing runs). The real runs behind such a folder are `test_compare_quick`'s (slow);
this checks the script's assembly of them in a second (the quick size runs decoupled PPO and
D-ARL only). A missing run is named, not invented.
What it is not: a check of the statistics (test_analysis, test_primary) or of which method wins."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from experiment import plan as P
from experiment.runs import RUN_RECORD, command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONFIG = "configs/cpu_demo_darl.yaml"
PNG = b"\x89PNG\r\n\x1a\n"
QUICK_METHODS = ["sync", "naive_replay", "decoupled_replay", "darl"]


def _script():
    spec = importlib.util.spec_from_file_location("compare_async", os.path.join(ROOT, "scripts", "compare_async.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _quick_specs() -> list:
    size = P.with_overrides(P.SIZES["quick"], methods=tuple(QUICK_METHODS))
    return P.main_specs(size, {m: size.grid()[0] for m in size.methods})


def _write_finished(out: str, spec, gain: float, spread: float = 1.0) -> None:
    """A run folder that `runs.finished` accepts for `spec`: its command record, learner and
    launcher summaries, one metrics row a step (drift diagnostics as the method logs them) and an
    evaluation every `every` steps."""
    size = P.SIZES["quick"]
    run_dir = os.path.abspath(os.path.join(out, "runs", spec.name))
    os.makedirs(run_dir)
    cmd = command(spec, run_dir, CONFIG, P.run_overrides(spec, size))
    with open(os.path.join(run_dir, RUN_RECORD), "w") as fh:
        json.dump({"spec": spec.__dict__, "command": cmd[1:]}, fh)
    with open(os.path.join(run_dir, "learner_summary.json"), "w") as fh:
        json.dump({"final_version": size.steps, "steps_done": size.steps}, fh)
    with open(os.path.join(run_dir, "summary.json"), "w") as fh:
        json.dump({"accuracy_before": 0.2}, fh)
    with open(os.path.join(run_dir, "experiment_cost.json"), "w") as fh:
        json.dump({"wall_s": 50.0, "cpu_s": 60.0, "load1": 1.0}, fh)
    replay, sync = spec.method != "sync", spec.method == "sync"
    rows = []
    for step in range(size.steps):
        r = {"step": step, "time": 2.0 * (step + 1), "train/loss": 0.1, "train/clip_frac": 0.02,
             "algo/staleness/batch/mean": 0.0 if sync else 0.5, "algo/staleness/batch/max": 0.0 if sync else 1.0,
             "algo/ess_frac": 0.9, "perf/step_s": 0.6, "perf/pace_s": 0.1,
             **({} if spec.method == "naive_replay" else {"algo/kl_k3": 1e-3}),
             **({"replay/reused_frac": 0.25 * (step > 0)} if replay else {})}
        if (step + 1) % size.every == 0:
            r.update({"eval/accuracy": 0.2 + (0.05 + gain) * (step + 1) / size.steps + 0.01 * spread * spec.seed,
                      "eval/version": float(step + 1), "eval/samples_generated": 32.0 * (step + 1),
                      "eval/wall_s": 2.0 * (step + 1), "perf/eval_s": 0.3})
        rows.append(r)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def _warm(out: str) -> None:
    model = os.path.join(out, "_warm", "model")
    os.makedirs(model)
    with open(os.path.join(model, "warmstart.json"), "w") as fh:
        json.dump({"sft_steps": 60, "source": "builtin:tiny-qwen3", "fingerprint": "x"}, fh)


def _report(out: str, capsys) -> tuple[int, str]:
    cwd = os.getcwd()
    os.chdir(ROOT)  # the recipe path is relative to the checkout, as in the README's command
    try:
        code = _script().main(["--quick", "--methods", *QUICK_METHODS, "--out", out, "--report-only"])
    finally:
        os.chdir(cwd)
    return code, capsys.readouterr().out


def test_the_plan_runs_the_replay_methods_at_eta_1_and_sync_at_0_with_two_seeds():
    names = sorted(s.name for s in _quick_specs())
    assert names == sorted([f"sync_eta0_lr5e-05_s{s}" for s in (0, 1)]
                           + [f"{m}_eta1_lr5e-05_s{s}" for m in QUICK_METHODS[1:] for s in (0, 1)])


def test_report_only_writes_tables_plots_and_json_from_finished_runs(tmp_path, capsys):
    out = str(tmp_path / "cmp")
    _warm(out)
    gains = {"sync": 0.0, "naive_replay": -0.02, "decoupled_replay": 0.01, "darl": 0.03}
    spread = {"sync": 1.0, "naive_replay": 1.5, "decoupled_replay": 2.0, "darl": 2.5}  # seeds differ per method
    specs = _quick_specs()
    for spec in specs:
        _write_finished(out, spec, gains[spec.method], spread[spec.method])
    code, stdout = _report(out, capsys)
    assert code == 0, stdout[-3000:]
    last = json.loads(stdout.strip().splitlines()[-1])
    with open(os.path.join(out, "results.json")) as fh:
        assert json.load(fh) == last
    assert last["failed"] == [] and last["not_run"] == [] and stdout.count(" reused: ") == len(specs)
    assert sorted(last["tables"]) == ["1"]
    table = last["tables"]["1"]
    assert list(table["rows"]) == QUICK_METHODS
    for name, row in table["rows"].items():
        assert row["seeds"] == 2 and 0.0 <= row["final_accuracy"] <= 1.0
        lo, hi = row["final_accuracy_ci95"]
        assert lo <= row["final_accuracy"] <= hi
        assert 0.0 <= row["auc"] <= 1.0 and row["train_wall_s"] > 0 and row["samples_generated"] > 0
        assert row["staleness_max"] == (0 if name == "sync" else 1)
    darl, naive = table["rows"]["darl"]["final_accuracy"], table["rows"]["naive_replay"]["final_accuracy"]
    assert darl - naive == pytest.approx(0.05 + 0.005)  # the curves written above, not a default
    runs = {r["name"]: r for r in last["runs"]}
    assert sorted(runs) == sorted(s.name for s in specs)
    assert all((r["kl_k3"] is None) == (r["method"] == "naive_replay") for r in runs.values())
    assert all(bool(r["reused_frac"]) == (r["method"] != "sync") for r in runs.values())
    assert len(table["tests"]) == 2 * 3  # D-ARL paired with each replay baseline on three figures
    with open(os.path.join(out, "results.md")) as fh:
        md = fh.read()
    section = md.split("## eta = 1\n", 1)[1].split("\n## ", 1)[0].split("D-ARL minus")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 4 and all(line.count("|") == 11 for line in rows), section
    for axis in ("steps", "samples", "wall_s"):
        path = os.path.join(out, f"curves_{axis}.png")
        assert path in last["plots"] and os.path.getsize(path) > 10_000
        with open(path, "rb") as fh:
            assert fh.read(8) == PNG


def test_report_only_names_the_runs_not_finished_and_reports_the_rest(tmp_path, capsys):
    out = str(tmp_path / "cmp")
    _warm(out)
    specs = _quick_specs()
    missing = [s for s in specs if s.method == "darl"]
    for spec in specs:
        if spec not in missing:
            _write_finished(out, spec, 0.0)
    code, stdout = _report(out, capsys)
    assert code == 0, stdout[-3000:]
    last = json.loads(stdout.strip().splitlines()[-1])
    assert sorted(last["not_run"]) == sorted(s.name for s in missing)
    assert stdout.count("not run yet (--report-only)") == len(missing) and all(s.name in stdout for s in missing)
    assert "darl" not in last["tables"]["1"]["rows"] and stdout.count(" reused: ") == len(specs) - len(missing)
    with open(os.path.join(out, "results.md")) as fh:
        md = fh.read()
    assert "**Interim report**" in md and all(s.name in md for s in missing)


def test_the_preregistered_plan_prints_every_phase_a_run_and_each_phases_estimate(capsys):
    code = _script().main(["--size", "budget2", "--plan"])
    out = capsys.readouterr().out
    assert code == 0
    names = [line.split()[1] for line in out.splitlines() if line.startswith("  A ")]
    assert sorted(names) == sorted(s.name for s in P.main_specs(P.SIZES["budget2"], {})) and len(names) == 110
    assert "gen_decoupled_hi_lr_eta1_lr0.0002_s0" in names and "stale_naive_eta4_lr0.0001_s4" in names
    assert out.count("phase B, ") == 2 and "at most 20 seeds (5-24)" in out and "futility" in out


def test_the_preregistered_size_writes_its_design_and_reports_what_is_missing(tmp_path, capsys, monkeypatch):
    """`--size budget2 --report-only` before any run finished: the design in results.json, phase A
    reported incomplete with every missing run named, no choice and no phase B."""
    mod = _script()

    class NothingFinished:
        def __init__(self, args, size, total):
            self.out, self.failed, self.missing = args.out, [], []

        def run(self, specs):
            assert os.path.isfile(os.path.join(self.out, "results.json"))  # the design came first
            self.missing += [s.name for s in specs]
            return []

    monkeypatch.setattr(mod, "Driver", NothingFinished)
    monkeypatch.setattr(mod, "_preflight", lambda *a: None)
    out = str(tmp_path / "b2")
    code = mod.main(["--size", "budget2", "--out", out, "--report-only"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout[-2000:]
    last = json.loads(stdout.strip().splitlines()[-1])
    with open(os.path.join(out, "results.json")) as fh:
        assert json.load(fh) == last
    assert last["status"] == "phase A incomplete" and last["phase_b"] is None and last["choice"]["chosen"] is None
    assert len(last["choice"]["missing"]) == 2 * 10 * 5 and last["design"]["phases"]["A"]["seeds"] == [0, 1, 2, 3, 4]
    assert sorted(set(last["not_run"])) == sorted(s.name for s in P.main_specs(P.SIZES["budget2"], {}))
    assert "Phase A's choice: not made yet" in open(os.path.join(out, "results.md")).read()

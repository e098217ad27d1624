"""The two-phase experiment end to end on synthetic runs (a driver that returns made-up results,
no training): the design is in results.json before the first run and phase B's plan before
phase B's first run; phase B's primary figures recomputed from the published curves with naive
code (trapezoids, paired differences, t-interval, p, Holm); phase B's seeds disjoint from phase A's;
the futility stop; the second task's gate; a rerun with a changed design or plan is refused."""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import replace

import numpy as np
import pytest

from experiment.api import Curve, RunResult
from experiment.plan import SIZES
from experiment.prereg_run import run_experiment, write_design
from tests.helpers.naive_auc import trapezoid_auc

SIZE = SIZES["budget2"]
BUDGET, EVERY = SIZE.budget, SIZE.every_samples
LEVELS = {"decoupled_areal": 0.30, "naive_replay": 0.29, "naive": 0.27, "darl_behav": 0.315, "darl_mixture": 0.33}
SECOND_GAIN = {"gen": 0.11, "stale": 0.05}  # the second task's baseline: the gate passes in gen only


class FakeDriver:
    """Returns a made-up finished run for each spec; records what results.json held at each call."""

    def __init__(self, out: str, size, levels: dict[str, float], log: list):
        self.out, self.size, self.levels, self.log, self.failed, self.missing = out, size, levels, log, [], []
        self.second = bool(size.prereg.secondary_task) and "data.dataset_kwargs.max_digits=3" in size.settings

    def _level(self, spec) -> float:
        if self.second:
            base = 0.2 + SECOND_GAIN[spec.regime]
            return base + (0.01 if spec.method.startswith("darl") else 0.0)
        return self.levels.get(spec.method, 0.25) + (0.02 if spec.regime == "stale" and spec.method == "naive_replay"
                                                     else 0.0)

    def run(self, specs) -> list[RunResult]:
        path = os.path.join(self.out, "results.json")
        self.log.append((self.second, [s.name for s in specs], json.load(open(path)) if os.path.isfile(path) else None))
        out = []
        for s in specs:
            noise = 0.02 * math.sin(3.1 * s.seed + sum(map(ord, s.method)) + (s.regime == "stale"))
            level = self._level(s) + noise
            acc = [0.2 + (level - 0.2) * (i / 8) ** 0.7 for i in range(9)]
            marks = [float(EVERY * i) for i in range(9)]
            curve = Curve([4.0 * i for i in range(9)], [m + 11.0 * (i > 0) for i, m in enumerate(marks)],
                          [2.0 * i for i in range(9)], acc, marks, [a - 0.05 for a in acc])
            replay = s.method not in ("decoupled_areal", "naive", "decoupled_hi_lr")
            out.append(RunResult(s, curve, 1.0, 2.0, 0.9, 100.0, False, float(BUDGET), 1.0,
                                 evicted_untrained=3.0 * s.seed if replay else None,
                                 filtered_groups=(2.0 + s.seed) if s.method.startswith("darl_") else None))
        return out


def _run(out: str, levels=LEVELS, size=SIZE, log=None):
    log = [] if log is None else log
    args = argparse.Namespace(out=out, no_gate=False, report_only=False)
    code, rep = run_experiment(args, size, lambda o, sz: FakeDriver(o, sz, levels, log), lambda d, s, skip: None)
    return code, rep, log


def _trap(curve: dict) -> float:
    return trapezoid_auc(curve["marks"], curve["accuracy"], BUDGET)


def test_the_design_comes_first_and_phase_b_is_planned_before_its_first_run(tmp_path):
    out = str(tmp_path / "exp")
    code, rep, log = _run(out)
    assert code == 0
    first_second, first_names, before_a = log[0]
    assert before_a["design"] == json.load(open(os.path.join(out, "results.json")))["design"]
    assert before_a["phase_b"] is None and before_a["status"] == "planned" and len(first_names) == 110
    _, b_names, before_b = log[1]
    plan = before_b["phase_b"]
    assert plan is not None and plan["chosen"] == "darl_mixture" and set(b_names) == {
        f"{reg}_{m}_eta{eta}_lr0.0001_s{s}" for reg, eta in (("gen", 1), ("stale", 4))
        for m in ("darl_mixture", plan["best_baseline"][reg]) for s in plan["seeds"]}
    assert plan["best_baseline"] == {"gen": "decoupled_areal", "stale": "naive_replay"}
    assert rep["status"] == "phase B complete" and rep["choice"]["chosen"] == "darl_mixture"


def test_phase_b_figures_follow_from_the_published_curves_by_naive_code(tmp_path):
    from scipy import stats

    out = str(tmp_path / "exp")
    _run(out)
    doc = json.load(open(os.path.join(out, "results.json")))
    plan, seeds_a = doc["phase_b"], set(doc["design"]["phases"]["A"]["seeds"])
    runs_b = [r for r in doc["runs"] if r["phase"] == "B" and r["task"] == "main"]
    assert {r["seed"] for r in runs_b} == set(plan["seeds"]) and not set(plan["seeds"]) & seeds_a
    assert min(plan["seeds"]) == doc["design"]["phases"]["B"]["first_seed"] == 5
    ps = []
    for fig in doc["primary"]:
        a = {r["seed"]: _trap(r["curve"]) for r in runs_b if r["regime"] == fig["regime"] and r["method"] == fig["a"]}
        b = {r["seed"]: _trap(r["curve"]) for r in runs_b if r["regime"] == fig["regime"] and r["method"] == fig["b"]}
        assert fig["a"] == plan["chosen"] and fig["b"] == plan["best_baseline"][fig["regime"]]
        d = np.array([a[s] - b[s] for s in sorted(a)])
        half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
        assert fig["seeds"] == len(plan["seeds"]) and fig["metric"] == "auc"
        assert fig["difference"] == pytest.approx(d.mean())
        assert [fig["ci_low"], fig["ci_high"]] == pytest.approx([d.mean() - half, d.mean() + half])
        p = stats.ttest_rel([a[s] for s in sorted(a)], [b[s] for s in sorted(a)]).pvalue
        assert fig["p"] == pytest.approx(p, rel=1e-6, abs=0)  # relative only: p can be tiny
        ps.append(fig["p"])
    lo, hi = sorted(ps)
    holm = {lo: min(1.0, 2 * lo), hi: max(min(1.0, 2 * lo), min(1.0, hi))}
    assert [f["p_holm"] for f in doc["primary"]] == pytest.approx([holm[p] for p in ps], rel=1e-9, abs=0)
    assert {f["metric"] for f in doc["secondary"]} == {"accuracy_at_budget", "last_three", "samples_to_target",
                                                       "sampled_auc"}


def test_every_run_carries_its_curve_and_replay_totals_unknown_where_not_logged(tmp_path):
    out = str(tmp_path / "exp")
    _, rep, _ = _run(out)
    doc = json.load(open(os.path.join(out, "results.json")))
    run = next(r for r in doc["runs"] if r["method"] == "darl_behav" and r["seed"] == 2)
    assert run["curve"]["marks"][-1] == BUDGET and len(run["curve"]["accuracy"]) == 9
    assert run["evicted_untrained"] == 6.0 and run["filtered_groups"] == 4.0
    base = next(r for r in doc["runs"] if r["method"] == "decoupled_areal")
    assert base["evicted_untrained"] is None and base["filtered_groups"] is None  # unknown, not 0
    cell = doc["phase_a"]["gen"]["naive_replay"]
    assert cell["evicted_untrained"] == pytest.approx(6.0) and cell["filtered_groups"] is None
    with open(os.path.join(out, "curves_samples.png"), "rb") as fh:
        assert rep["plots"] == [os.path.join(out, "curves_samples.png")] and fh.read(8) == b"\x89PNG\r\n\x1a\n"
    md = open(os.path.join(out, "results.md")).read()
    assert "## Phase B (confirmation)" in md and "Chosen: **D-ARL, clip against the balance mixture**" in md


def test_the_second_task_runs_its_gate_first_and_tests_only_the_regimes_it_passed(tmp_path):
    out = str(tmp_path / "exp")
    _, rep, log = _run(out)
    second = [names for is_second, names, _ in log if is_second]
    plan = rep["phase_b"]
    assert second[0] == [f"{reg}_decoupled_areal_eta{eta}_lr0.0001_s{s}" for reg, eta in (("gen", 1), ("stale", 4))
                         for s in plan["seeds"]]
    assert {n.split("_s")[0] for n in second[1]} == {"gen_decoupled_areal_eta1_lr0.0001",
                                                     "gen_darl_mixture_eta1_lr0.0001"}
    fam = rep["secondary_family"]
    assert fam["passed"] == ["gen"] and fam["gate_gain"]["gen"] == pytest.approx(0.11, abs=0.01)
    assert [t["regime"] for t in fam["tests"]] == ["gen"] and fam["tests"][0]["p_holm"] == fam["tests"][0]["p"]
    assert all(r["phase"] == "secondary" for r in rep["runs"] if r["task"] == "second")


def test_the_futility_stop_publishes_phase_a_and_runs_nothing_more(tmp_path):
    out = str(tmp_path / "exp")
    low = {**LEVELS, "darl_behav": 0.27, "darl_mixture": 0.27}
    code, rep, log = _run(out, levels=low)
    assert code == 0 and len(log) == 1 and rep["status"] == "futile: negative result"
    assert rep["phase_b"] is None and rep["primary"] == [] and rep["choice"]["futile"] is True
    assert "**Futility stop**" in open(os.path.join(out, "results.md")).read()


def test_a_rerun_with_a_changed_design_or_plan_is_refused(tmp_path, capsys):
    out = str(tmp_path / "exp")
    assert _run(out)[0] == 0
    before = open(os.path.join(out, "results.json")).read()
    code, rep, log = _run(out, size=replace(SIZE, seeds=(0, 1, 2)))
    assert code == 2 and rep is None and log == [] and "differs" in capsys.readouterr().err
    assert open(os.path.join(out, "results.json")).read() == before
    code, rep, log = _run(out, size=replace(SIZE, prereg=replace(SIZE.prereg, futility_margin=-0.01)))
    assert code == 2 and log == []  # a rule changed after the runs began
    code, rep, log = _run(out, levels={**LEVELS, "darl_behav": 0.36})  # phase A would now choose otherwise
    assert code == 2 and rep is None and "phase B's plan" in capsys.readouterr().err
    assert json.load(open(os.path.join(out, "results.json")))["phase_b"]["chosen"] == "darl_mixture"
    assert _run(out)[0] == 0  # the same experiment continues


def test_the_design_is_written_once(tmp_path):
    out = str(tmp_path / "exp")
    doc = write_design(out, SIZE)
    assert doc["status"] == "planned" and doc["design"]["phases"]["A"]["seeds"] == [0, 1, 2, 3, 4]
    assert write_design(out, SIZE) == doc


def test_phase_a_contrasts_follow_from_the_published_curves_by_naive_code(tmp_path):
    from scipy import stats

    from experiment.prereg_report import CONTRASTS

    out = str(tmp_path / "exp")
    low = {**LEVELS, "darl_behav": 0.27, "darl_mixture": 0.27}  # the futility stop: phase A is all there is
    _, rep, _ = _run(out, levels=low)
    doc = json.load(open(os.path.join(out, "results.json")))
    runs_a = [r for r in doc["runs"] if r["phase"] == "A"]
    rows = doc["phase_a_contrasts"]
    best = doc["choice"]["best_baseline"]
    for reg in ("gen", "stale"):
        against = {r["a"] for r in rows if r["regime"] == reg and r["contrast"] == "against the best baseline"}
        assert against == {*SIZE.prereg.candidates, *SIZE.prereg.references}
        assert {r["b"] for r in rows if r["regime"] == reg and r["contrast"] == "against the best baseline"} == {
            best[reg]}
        assert [(r["a"], r["b"]) for r in rows if r["regime"] == reg and r["contrast"] != "against the best "
                "baseline"] == [(a, b) for a, b, _ in CONTRASTS]
    for fig in rows:
        a, b = ({r["seed"]: _trap(r["curve"]) for r in runs_a if r["regime"] == fig["regime"] and r["method"] == m}
                for m in (fig["a"], fig["b"]))
        assert sorted(a) == sorted(b) == [0, 1, 2, 3, 4] and fig["seeds"] == 5
        d = np.array([a[s] - b[s] for s in sorted(a)])
        half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
        assert fig["difference"] == pytest.approx(d.mean())
        assert [fig["ci_low"], fig["ci_high"]] == pytest.approx([d.mean() - half, d.mean() + half])
        assert fig["p"] == pytest.approx(stats.ttest_rel([a[s] for s in sorted(a)], [b[s] for s in sorted(a)]).pvalue,
                                         rel=1e-6, abs=0)
    md = open(os.path.join(out, "results.md")).read()
    assert "### Phase A contrasts (exploratory: not preregistered, p not corrected)" in md
    assert md.count("| replay, naive async |") == 2  # one row per regime

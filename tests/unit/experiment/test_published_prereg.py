"""The published two-phase experiment (docs/results/budget2/results.json) against its own curves:
every phase-A run the design names is there once, with its replay totals; phase A's choice (each
regime's best baseline, every variant's margins, the futility stop) recomputed from the curves
with naive code; and what the stop implies (no phase B plan, no phase B or second-task run, no
primary figure). The README's per-regime figures are checked against the same curves.
What it is not: a rerun of the experiment (`scripts/compare_async.py --size budget2`) or a test of
the rules on made-up runs (test_prereg_run.py)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from tests.helpers.naive_auc import trapezoid_auc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PUBLISHED = os.path.join(ROOT, "docs", "results", "budget2", "results.json")


@pytest.fixture(scope="module")
def report():
    with open(PUBLISHED) as fh:
        return json.load(fh)


def _trap(curve: dict, budget: float) -> float:
    return trapezoid_auc(curve["marks"], curve["accuracy"], budget)


def _means(report: dict) -> dict[str, dict[str, float]]:
    d, budget = report["design"], report["design"]["budget_samples"]
    out: dict[str, dict[str, list]] = {}
    for r in report["runs"]:
        out.setdefault(r["regime"], {}).setdefault(r["method"], []).append(_trap(r["curve"], budget))
    return {reg: {m: sum(v) / len(v) for m, v in cells.items()} for reg, cells in out.items() if reg in d["regimes"]}


def test_every_phase_a_run_of_the_design_is_published_once(report):
    d = report["design"]
    a = d["phases"]["A"]
    assert a["seeds"] == [0, 1, 2, 3, 4] and d["phases"]["B"]["first_seed"] > max(a["seeds"])
    want = sorted((reg, m, s) for reg in d["regimes"] for m in a["cells"] for s in a["seeds"])
    got = sorted((r["regime"], r["method"], r["seed"]) for r in report["runs"] if r["phase"] == "A")
    assert got == want
    assert set(a["candidates"]) | set(a["baselines"]) | set(a["references"]) <= set(a["cells"])
    for r in report["runs"]:
        assert r["samples_generated"] >= d["budget_samples"], r["name"]
        assert r["evicted_untrained"] is not None and r["filtered_groups"] is not None, r["name"]


def test_the_futility_stop_follows_from_the_published_curves(report):
    d, choice = report["design"], report["choice"]
    a = d["phases"]["A"]
    means = _means(report)
    best = {}
    for reg, cells in means.items():
        top = a["baselines"][0]
        for m in a["baselines"]:
            if cells[m] > cells[top]:
                top = m
        best[reg] = top
    assert choice["best_baseline"] == best
    worst = {}
    for v in a["candidates"]:
        margins = {reg: means[reg][v] - means[reg][best[reg]] for reg in means}
        assert choice["margins"][v] == pytest.approx(margins, abs=1e-9)
        worst[v] = min(margins.values())
    futile = max(worst.values()) <= d["futility_margin"]
    assert choice["futile"] is futile and choice["missing"] == []
    assert futile, "the published phase A chose a variant: this test and the README's verdict must be rewritten"
    assert choice["chosen"] is None and report["status"] == "futile: negative result"
    assert report["phase_b"] is None and report["primary"] == []
    assert {r["phase"] for r in report["runs"]} == {"A"} and not report.get("secondary_family")


def test_the_phase_a_table_is_the_curves_means_and_ranges(report):
    means, budget = _means(report), report["design"]["budget_samples"]
    for reg, cells in report["phase_a"].items():
        for m, row in cells.items():
            v = [_trap(r["curve"], budget) for r in report["runs"] if r["regime"] == reg and r["method"] == m]
            assert row["seeds"] == 5 and row["auc"] == pytest.approx(means[reg][m], abs=1e-12), (reg, m)
            assert row["auc_range"] == pytest.approx([min(v), max(v)], abs=1e-12), (reg, m)
            assert row["auc_ci95"][0] <= row["auc"] <= row["auc_ci95"][1]


def test_the_cost_summary_is_the_runs_own(report):
    """Per regime, the runs' count, total and median wall time, range and median load, by hand."""
    for reg, c in report["phase_a_cost"].items():
        costs = sorted((r["cost"]["wall_s"], r["cost"]["load1"]) for r in report["runs"] if r["regime"] == reg)
        wall, load = [w for w, _ in costs], sorted(ld for _, ld in costs)
        n = len(wall)
        assert c["runs"] == n == 55 and c["wall_h"] == pytest.approx(sum(wall) / 3600)
        assert c["wall_s_median"] == pytest.approx(wall[n // 2]) and c["wall_s_range"] == [wall[0], wall[-1]]
        assert c["load1_median"] == pytest.approx(load[n // 2])
        md = open(os.path.join(os.path.dirname(PUBLISHED), "results.md"), encoding="utf-8").read()
        assert f"Phase A's {n} {reg} runs took {sum(wall) / 3600:.2f} h of their own wall time" in md


def test_the_readme_quotes_the_published_figures(report):
    """Every "<AUC> [<low>, <high>]" of the README's results table is the published mean AUC of that
    cell and its seed range as results.md prints them, and within 0.05 points of the mean, min and
    max over phase A's seeds recomputed from the curves; in bold, each regime's best cell and only it."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = readme.split("<!-- budget2 table -->")[1].split("<!-- end budget2 table -->")[0]
    budget = report["design"]["budget_samples"]
    rows = re.findall(r"^\| `(\w+)` \|(.+)\|$", block, flags=re.M)
    assert len(rows) == len(report["design"]["phases"]["A"]["cells"])
    regimes = list(report["design"]["regimes"])
    bold = {}
    for method, cells in rows:
        figs = re.findall(r"(\*\*)?([\d.]+)(?:\*\*)? \[([\d.]+), ([\d.]+)\]", cells)
        assert len(figs) == len(regimes), method
        for reg, (star, mean, lo, hi) in zip(regimes, figs):
            if star:
                bold.setdefault(reg, []).append(method)
            v = np.array([_trap(r["curve"], budget) for r in report["runs"]
                          if r["regime"] == reg and r["method"] == method])
            assert len(v) == 5
            assert [float(mean), float(lo), float(hi)] == pytest.approx(  # to 0.1: within half of it
                [100 * v.mean(), 100 * v.min(), 100 * v.max()], abs=0.05 + 1e-9), (reg, method)
            row = report["phase_a"][reg][method]
            assert [mean, lo, hi] == [f"{100 * x:.1f}" for x in (row["auc"], *row["auc_range"])], (reg, method)
    means = _means(report)
    assert bold == {reg: [max(means[reg], key=means[reg].get)] for reg in regimes}  # the best cell, in bold

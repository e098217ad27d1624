"""The comparison's statistics against naive references: AUC, threshold crossing, t-intervals,
collapse, the per-eta rows, and the learning-rate choice of the tuning phase."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiment import analysis as A
from experiment.api import Curve, RunResult, RunSpec, Setting
from experiment.plan import SIZES, best_settings, main_specs, tuning_specs, untuned, with_overrides


def _run(method, acc, samples=None, eta=1, lr=5e-5, seed=0, loss_ok=True, ess=0.9, stale=(0.5, 1.0)):
    n = len(acc)
    samples = samples or [100.0 * i for i in range(n)]
    curve = Curve(steps=[float(i) for i in range(n)], samples=list(samples), wall_s=[2.0 * i for i in range(n)],
                  accuracy=list(acc))
    return RunResult(RunSpec(method, eta, lr, seed), curve, stale[0], stale[1], ess, 10.0, not loss_ok,
                     samples[-1], 1.0)


def test_auc_is_the_mean_of_the_curve_over_the_common_budget():
    x, y = [0, 100, 300, 400], [0.2, 0.4, 0.3, 0.5]
    dense = np.linspace(0, 250, 250_001)
    assert A.auc(x, y, 250) == pytest.approx(np.interp(dense, x, y).mean(), abs=1e-6)
    assert A.auc(x, y, 400) == pytest.approx((30 + 70 + 40) / 400)  # trapezoids by hand


def test_first_reach_is_a_measured_evaluation_not_an_interpolation():
    """Samples to a threshold: the first evaluation that reached it (between evaluations nothing
    was measured; interpolating from the warm start put every crossing before the first one)."""
    assert A.first_reach([0, 100, 200], [0.2, 0.3, 0.5], 0.4) == (200.0, 2)
    assert A.first_reach([0, 100, 200], [0.2, 0.45, 0.5], 0.4) == (100.0, 1)
    assert A.first_reach([0, 100], [0.2, 0.3], 0.4) is None
    assert A.first_reach([0, 100], [0.5, 0.3], 0.4) == (0.0, 0)
    assert A.accuracy_at([0, 100, 200], [0.2, 0.3, 0.5], 150) == pytest.approx(0.4)


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7])
def test_t_pvalue_against_the_density(df):
    for p in (0.05,):
        assert A.t_pvalue(_t975(df), df) == pytest.approx(p, abs=1e-4)
    assert A.t_pvalue(0.0, df) == pytest.approx(1.0)
    assert A.t_pvalue(math.inf, df) == 0.0


def test_holm_and_paired_tests():
    assert A.holm([0.01, 0.04, 0.03, math.nan]) == pytest.approx([0.03, 0.06, 0.06, math.nan], nan_ok=True)
    assert A.holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    t = A.paired_test({0: 0.5, 1: 0.6, 2: 0.7, 3: 0.65}, {0: 0.4, 1: 0.45, 2: 0.62, 3: 0.6, 9: 0.0})
    d = np.array([0.1, 0.15, 0.08, 0.05])
    assert t["seeds"] == 4 and t["diff"] == pytest.approx(d.mean())
    tstat = d.mean() / (d.std(ddof=1) / 2)
    assert t["p"] < 0.05 and tstat > A.t95(3) and t["diff_ci95"][0] > 0


def _t975(df: int) -> float:
    """The 0.975 quantile of Student's t by integrating its density (a naive reference)."""
    t = np.linspace(0.0, 60.0, 2_000_001)
    logc = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    pdf = np.exp(logc - (df + 1) / 2 * np.log1p(t * t / df))
    cdf = 0.5 + np.concatenate([[0.0], np.cumsum((pdf[1:] + pdf[:-1]) / 2 * np.diff(t))])
    return float(np.interp(0.975, cdf, t))


@pytest.mark.parametrize("n", [2, 3, 5, 11, 31, 40, 200])
def test_mean_interval_is_students_t(n):
    v = np.random.default_rng(n).normal(0.3, 0.05, n)
    m, lo, hi = A.mean_interval(list(v))
    assert m == pytest.approx(v.mean())
    half = _t975(n - 1) * v.std(ddof=1) / math.sqrt(n)
    assert hi - m == pytest.approx(half, rel=2e-4 if n > 2 else 2e-3)
    assert m - lo == pytest.approx(hi - m)
    assert math.isnan(A.mean_interval([0.3])[1])


def test_collapse_is_a_drop_below_the_warm_start_or_a_nan_loss():
    assert A.collapsed(_run("darl", [0.3, 0.25, 0.15]))
    assert not A.collapsed(_run("darl", [0.3, 0.25, 0.22]))
    assert A.collapsed(_run("darl", [0.3, 0.4], loss_ok=False))


def test_eta_figures_threshold_and_rows():
    runs = [_run("decoupled_areal", [0.2, 0.3, 0.40], seed=0), _run("decoupled_areal", [0.2, 0.3, 0.30], seed=1),
            _run("decoupled_verl", [0.2, 0.25, 0.30], seed=0),
            _run("darl", [0.2, 0.4, 0.45], seed=0, ess=0.5), _run("darl", [0.2, 0.3, 0.05], seed=1, ess=0.7),
            _run("sync", [0.2, 0.3, 0.36], samples=[0, 90, 180], eta=0)]
    fig = A.eta_figures(runs, ["sync", "decoupled_areal", "darl"])
    assert fig["best_decoupled"] == pytest.approx(0.35)  # areal's seed mean at its last point
    assert fig["threshold"] == pytest.approx(0.28)
    assert fig["x_common"] == 180.0
    darl = fig["rows"]["darl"]
    assert darl["final_accuracy"] == pytest.approx(0.25) and darl["collapses"] == 1 and darl["ess_min"] == 0.5
    # both seeds first measure >= 0.28 at their first evaluation (100 samples)
    assert darl["samples_to_threshold"] == pytest.approx(100.0) and darl["reached_threshold"] == 2
    assert darl["reached_at_first_eval"] == 2
    assert darl["accuracy_at_budget"] == pytest.approx(np.mean([0.4 + 0.8 * 0.05, 0.3 - 0.8 * 0.25]))  # at 180
    assert set(fig["rows"]) == {"sync", "decoupled_areal", "darl"}


def test_the_seeds_plan_pilot_and_budget():
    from experiment.plan import estimate_s, pilot_choice, pilot_specs

    size = SIZES["seeds"]
    assert size.check() == [] and not tuning_specs(size)
    assert set(size.methods) == {"decoupled_areal", "naive_replay", "decoupled_replay", "darl"}
    assert size.etas == (1,) and len(size.seeds) == 4 and size.steps == 60
    assert "algo.ppo_n_minibatches=4" in size.settings
    for m in ("naive_replay", "decoupled_replay", "darl"):  # K = 4: three replay versions
        assert "algo.k=4" in RunSpec(m, 1, 5e-5, 0).overrides(60, 10)
    pilots = pilot_specs(size)
    assert [p.lr for p in pilots] == sorted(size.pilot_lrs) and all(p.name.startswith("pilot") for p in pilots)
    assert "train.steps=12" in pilots[0].overrides(size.steps, size.every)
    results = [_run("decoupled_areal", [0.2, 0.3]) for _ in pilots]
    for r, p, clip in zip(results, pilots, (0.01, 0.04, 0.09)):
        r.spec, r.clip_frac = p, clip
    assert pilot_choice(size, results)[0] == sorted(size.pilot_lrs)[1]
    grown = with_overrides(size, lr_grid=(*size.lr_grid, 4e-4))
    best, _ = best_settings(grown, [])  # two rates and no tuning: no method is missing a rate
    specs = main_specs(grown, best)
    assert len(specs) == 4 * 2 * 4 and {s.lr for s in specs} == {1e-4, 4e-4}
    assert untuned(grown, best) == []  # (it reported all four methods as failed, and exited 1)
    assert len(untuned(with_overrides(SIZES["etas"], methods=["darl"]), {})) == 1
    script = _script()  # the budget --plan prints
    assert estimate_s([*pilots, *specs], grown, script.STEP_S, script.EVAL_S, script.OVERHEAD_S) <= 95 * 60


def _script():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts", "compare_async.py")
    spec = importlib.util.spec_from_file_location("compare_async", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_best_learning_rate_by_auc_and_ties_to_the_smaller():
    size = with_overrides(SIZES["etas"], methods=["decoupled_areal", "darl"], lr_grid=[1e-5, 2e-5, 4e-5])
    tuning = [_run("decoupled_areal", [0.2, 0.3], lr=1e-5), _run("decoupled_areal", [0.2, 0.4], lr=2e-5),
              _run("decoupled_areal", [0.2, 0.1], lr=4e-5),
              _run("darl", [0.2, 0.3], lr=1e-5), _run("darl", [0.2, 0.3], lr=2e-5), _run("darl", [0.2, 0.2], lr=4e-5)]
    best, scores = best_settings(size, tuning)
    assert best == {"decoupled_areal": Setting(2e-5), "darl": Setting(1e-5)}
    assert scores["decoupled_areal"]["lr 2e-05"] == pytest.approx(0.3)
    best, _ = best_settings(size, tuning[:3])  # no D-ARL tuning run finished: no setting, no guess
    assert "darl" not in best and not any(s.method.startswith("darl") for s in main_specs(size, best))


def test_the_default_plan_covers_every_cell_once():
    size = SIZES["etas"]
    tune = tuning_specs(size)
    assert len(tune) == len(size.methods) * len(size.lr_grid) * len(size.tune_seeds)
    assert ({s.eta for s in tune if s.method != "sync"} == {size.tune_eta}
            and {s.eta for s in tune if s.method == "sync"} == {0})
    specs = main_specs(size, {m: Setting(5e-5) for m in size.methods})
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    assert sum(s.method == "sync" for s in specs) == len(size.seeds)
    for m in ("naive", "decoupled_areal", "decoupled_verl", "naive_replay", "decoupled_replay", "darl"):
        cells = {(s.eta, s.seed) for s in specs if s.method == m}
        assert cells == {(e, s) for e in size.etas for s in size.seeds}
    abl = {s.method for s in specs if s.method.startswith("darl_")}
    assert abl == {"darl_nosel", "darl_nopmis", "darl_d0", "darl_d1", "darl_d7"}  # depth 3 is darl itself
    assert all(s.eta == size.tune_eta for s in specs if s.method in abl)
    assert len(size.seeds) >= 3 and set(size.etas) == {1, 2, 4, 8}


def test_run_overrides_set_eta_window_and_learning_rate():
    over = RunSpec("darl", 8, 1e-4, 2).overrides(steps=40, every=5)
    assert "algo.max_head_offpolicyness=8" in over and "algo.k=11" in over  # eta + replay depth 3
    assert {"optim.lr=0.0001", "train.seed=2", "train.steps=40", "eval.every_steps=5"} <= set(over)
    sync = RunSpec("sync", 0, 1e-4, 0).overrides(steps=40, every=5)
    assert [o for o in sync if o.startswith("algo.max_head_offpolicyness")] == ["algo.max_head_offpolicyness=0"]
    assert "algo.k=5" in RunSpec("darl_d1", 4, 1e-4, 0).overrides(40, 5)
    assert [o for o in RunSpec("darl_d0", 4, 1e-4, 0).overrides(40, 5) if o.startswith("algo.k=")] == ["algo.k=4"]
    for m in ("naive_replay", "decoupled_replay"):  # the replay baselines: D-ARL's window, FIFO, one token mean
        over = RunSpec(m, 1, 1e-4, 0).overrides(40, 5)
        assert {"algo.k=4", "algo.replay=true", "algo.sg=false", "algo.pmis=false"} <= set(over)
    assert not any(o.startswith("algo.k=") for o in RunSpec("decoupled_areal", 1, 1e-4, 0).overrides(40, 5))


def test_minibatches_are_tuned_with_the_rate_when_asked():
    size = with_overrides(SIZES["etas"], methods=["naive"], ablations=[], lr_grid=[1e-4, 5e-5], mb_grid=[2, 1])
    assert [g.label for g in size.grid()] == ["lr 5e-05, 1 mb", "lr 5e-05, 2 mb", "lr 0.0001, 1 mb", "lr 0.0001, 2 mb"]
    tune = tuning_specs(size)
    assert {(s.lr, s.minibatches) for s in tune} == {(5e-5, 1), (5e-5, 2), (1e-4, 1), (1e-4, 2)}
    assert "algo.ppo_n_minibatches=1" in RunSpec("naive", 4, 5e-5, 0, 1).overrides(40, 5)
    runs = [_run("naive", [0.2, 0.3], lr=s.lr, eta=4) for s in tune]
    for r, s in zip(runs, tune):
        r.spec = s
    runs[2].curve.accuracy = [0.2, 0.5]  # lr 1e-4 with 1 minibatch
    best, _ = best_settings(size, runs)
    assert best["naive"] == Setting(1e-4, 1)
    assert {(s.lr, s.minibatches) for s in main_specs(size, best)} == {(1e-4, 1)}


def test_the_pacing_setting_is_checked_and_the_default_size_paces():
    from megatron_darl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="demo.min_step_s"):
        load_config("configs/cpu_demo_darl.yaml", ["demo.min_step_s=-1"])
    assert load_config("configs/cpu_demo_darl.yaml", []).demo.min_step_s == 0.0  # off unless asked
    assert "demo.min_step_s=1.0" in SIZES["etas"].settings


def test_the_report_says_what_the_warm_start_stop_selected_from(tmp_path):
    import json

    from experiment.report import _warm_lines
    from megatron_darl.launch.warmstart import read_stats

    model = tmp_path / "model"
    model.mkdir()
    checks = [[5, 0.02], [10, 0.08], [15, 0.05], [20, 0.07], [22, 0.122]]
    (model / "warmstart.json").write_text(json.dumps({
        "fingerprint": "x", "sft_steps": 22, "sft_target": 0.12, "sft_heldout_accuracy": 0.122, "sft_checks": checks}))
    warm = read_stats(str(model))
    assert "fingerprint" not in warm and warm["checks_summary"]["best_before_stop"] == 0.08
    line = " ".join(_warm_lines(warm))
    assert "stopped at 12.2%" in line and "first of 5 checks" in line and "median 6.0% (range 5.0-7.0%)" in line
    del warm["checks_summary"]  # a warm start made before the checks were recorded: no line
    assert _warm_lines(warm) == [] and _warm_lines(None) == []


def test_the_report_lists_mean_accuracy_by_step_per_cell():
    from experiment.report import _curve_lines

    def run(method, seed, acc, steps=(0.0, 10.0, 20.0)):
        return {"method": method, "eta": 1, "lr": 1e-4, "minibatches": None, "seed": seed,
                "curve": {"steps": list(steps), "accuracy": acc}}

    lines = _curve_lines([run("darl", 0, [0.1, 0.2, 0.3]), run("darl", 1, [0.1, 0.4, 0.1]),
                          run("decoupled_areal", 0, [0.1, 0.05, 0.2]),
                          run("naive_replay", 0, [0.1, 0.2], steps=(0.0, 10.0)),
                          run("naive_replay", 1, [0.1, 0.2, 0.2])])  # seeds at other steps: left out
    assert lines[2] == "| method | eta | lr | seeds | 0 | 10 | 20 |"
    assert lines[4].endswith("| 1 | 0.0001 | 2 | 10.0 | 30.0 | 20.0 |")  # means by hand
    assert lines[5].endswith("| 1 | 0.0001 | 1 | 10.0 | 5.0 | 20.0 |")
    assert len(lines) == 7 and not any("naive" in ln.lower() for ln in lines)
    assert _curve_lines([]) == []


def test_the_report_prints_the_pilot_and_the_runs_wall_time():
    from experiment.report import _cost_lines, _pilot_lines

    pilot = {"clip_frac": {"0.0002": 0.039, "0.0004": 0.071}, "final_accuracy": {"0.0002": 0.10, "0.0004": 0.006},
             "rate": 2e-4, "reached": True, "threshold": 0.03, "method": "decoupled_areal", "steps": 12,
             "runs_wall_s": 150.0}
    line = _pilot_lines(pilot)[0]
    assert "12 steps" in line and "at rates 0.0002 / 0.0004" in line
    assert "clip fraction 3.9 / 7.1%" in line and "final accuracy 10.0 / 0.6%" in line
    assert "Second rate 0.0002, the smallest whose clip fraction reached 3.0%" in line
    assert "none reached" in _pilot_lines({**pilot, "reached": False})[0]
    assert _pilot_lines({k: v for k, v in pilot.items() if k != "final_accuracy"}) == [] and _pilot_lines(None) == []
    report = {"runs_wall_s": 2661.0, "wall_s": 6.0, "pilot": pilot, "warm_start": {"sft_seconds": 288.0}}
    assert _cost_lines(report)[0] == ("Wall time, one run at a time: warm start (SFT) 4.8 min, pilot 2.5 min, "
                                      "main runs 44.4 min. This invocation: 0.1 min (less where it reused "
                                      "finished runs).")
    assert _cost_lines({"wall_s": 6.0}) == []  # a report from before runs_wall_s was recorded

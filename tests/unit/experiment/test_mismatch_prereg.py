"""The preregistered experiment under engine-learner mismatch (`--size bf16`, `--size fp8`): its
design holds the question, the default rule, the engine's dtype and every cell the issue names;
budget2's published design is unchanged by the fields it added; every cell's overrides make a
valid run config; the runs' mismatch figures are read from metrics.jsonl (means over the steps
that log them), published per cell where logged and absent where not; `--design-only` writes the
design before any run and refuses a changed one."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from experiment import prereg as R
from experiment import prereg_report as Q
from experiment.api import Curve, RunResult
from experiment.plan import SIZES, main_specs, run_overrides
from experiment.report import _run_json
from experiment.runs import drift_diagnostics
from megatron_darl.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CELLS = {"naive", "decoupled_areal", "decoupled_verl", "ppo_tis_mask", "darl_behav_tokens", "darl_mixture",
         "darl", "darl_behav", "darl_behav_oldsel"}


@pytest.mark.parametrize("name,dtype", [("bf16", "bfloat16"), ("fp8", "fp8_e4m3")])
def test_the_design_names_the_question_the_rule_the_dtype_and_every_cell(name, dtype):
    size = SIZES[name]
    assert size.check() == []
    d = R.design(size)
    assert f"rollout.engine_dtype={dtype}" in d["settings"] and dtype in d["question"]
    assert "recommended async recipe" in d["default_rule"] and "_darl recipes" in d["default_rule"]
    assert set(d["cells"]) == CELLS and d["phases"]["A"]["seeds"] == [0, 1, 2, 3, 4]
    assert d["phases"]["A"]["candidates"] == ["darl_behav_tokens", "darl_mixture"]  # budget2's best two
    assert set(d["phases"]["A"]["baselines"]) == {"naive", "decoupled_areal", "decoupled_verl", "ppo_tis_mask"}
    over = {m: set(c["overrides"]) for m, c in d["cells"].items()}
    assert {"algo.rollout_is=token", "algo.rollout_is_mode=mask"} <= over["ppo_tis_mask"]
    assert "algo.rollout_is=token" in over["decoupled_verl"] and not any("mode" in o for o in over["decoupled_verl"])
    # the two contrasts budget2 confounded: anchor alone (darl vs oldsel), selection alone (oldsel vs behav)
    assert over["darl_behav_oldsel"] - over["darl"] == {"algo.trust_anchor=behavior"}
    assert over["darl_behav_oldsel"] ^ over["darl_behav"] == {"algo.sg_new_first=false"}
    assert "fp32 engine" in d["published_cells"]
    assert len(main_specs(size, {})) == 9 * 2 * 5


def test_budget2s_published_design_is_what_the_code_still_writes():
    with open(os.path.join(ROOT, "docs", "results", "budget2", "results.json"), encoding="utf-8") as fh:
        published = json.load(fh)["design"]
    now = json.loads(json.dumps(R.design(SIZES["budget2"])))
    # the cells that ran under the anchor's former default (proximal) now name it; nothing else changed
    pinned = "algo.trust_anchor=proximal"
    named = {name for name, cell in now["cells"].items() if pinned in cell["overrides"]}
    for cell in now["cells"].values():
        cell["overrides"] = [o for o in cell["overrides"] if o != pinned]
    assert now == published and "default_rule" not in now and "question" not in now
    unset = {name for name, cell in published["cells"].items() if "algo.policy_loss=darl" in cell["overrides"]
             and not any(o.startswith("algo.trust_anchor=") for o in cell["overrides"])}
    assert named == unset == {"darl"}


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_every_cell_makes_a_valid_run_config(name):
    size = SIZES[name]
    for spec in main_specs(size, {}):
        if spec.seed:
            continue
        cfg = load_config(os.path.join(ROOT, "configs", "cpu_demo_darl.yaml"), run_overrides(spec, size))
        assert cfg.rollout.engine_dtype == {"bf16": "bfloat16", "fp8": "fp8_e4m3"}[name]


def _result(method: str, seed: int, mismatch: bool) -> RunResult:
    acc = [0.2 + 0.01 * i for i in range(9)]
    marks = [4096.0 * i for i in range(9)]
    curve = Curve([float(i) for i in range(9)], marks, [float(i) for i in range(9)], acc, marks, acc)
    spec = next(s for s in main_specs(SIZES["bf16"], {}) if s.method == method and s.seed == seed and s.regime == "gen")
    extra = ({"mismatch_abs_mean": 0.01 * (seed + 1), "mismatch_kl": 1e-4, "mismatch_clip_frac": 0.002}
             if mismatch else {})
    return RunResult(spec, curve, 1.0, 2.0, 0.9, 100.0, False, 32768.0, 1.0, **extra)


def test_mismatch_figures_are_step_means_and_published_only_where_logged():
    rows = [{"algo/mismatch_abs_mean": 0.01, "algo/mismatch_kl": 1e-4, "algo/mismatch_clip_frac": 0.0},
            {"algo/mismatch_abs_mean": 0.03, "algo/mismatch_kl": 3e-4, "algo/mismatch_clip_frac": 0.02}, {}]
    d = drift_diagnostics(rows)
    assert d["mismatch_abs_mean"] == pytest.approx(0.02) and d["mismatch_kl"] == pytest.approx(2e-4)
    assert d["mismatch_clip_frac"] == pytest.approx(0.01)
    assert drift_diagnostics([{}])["mismatch_abs_mean"] is None
    assert _run_json(_result("naive", 0, True))["mismatch_abs_mean"] == pytest.approx(0.01)
    assert "mismatch_abs_mean" not in _run_json(_result("naive", 0, False))  # budget2's runs read as published
    size = SIZES["bf16"]
    logged = Q.phase_a_table([_result("naive", s, True) for s in size.seeds], size)["gen"]["naive"]
    assert logged["mismatch_abs_mean"] == pytest.approx(0.03) and logged["mismatch_clip_frac"] == pytest.approx(0.002)
    lines = Q._phase_a_lines({"phase_a": {"gen": {"naive": logged}}})
    assert "clipped at lr 0" in lines[2] and lines[4].endswith("| 0.03 | 0.002 |"), lines
    unlogged = Q.phase_a_table([_result("naive", s, False) for s in size.seeds], size)["gen"]["naive"]
    assert "mismatch_abs_mean" not in unlogged
    assert "clipped at lr 0" not in Q._phase_a_lines({"phase_a": {"gen": {"naive": unlogged}}})[2]


def _script():
    spec = importlib.util.spec_from_file_location("compare_async", os.path.join(ROOT, "scripts", "compare_async.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_design_only_writes_the_design_before_any_run_and_refuses_a_changed_one(tmp_path, capsys):
    mod = _script()
    out, pub = str(tmp_path / "run"), str(tmp_path / "pub")
    assert mod.main(["--size", "bf16", "--out", out, "--publish", pub, "--design-only"]) == 0
    with open(os.path.join(pub, "results.json"), encoding="utf-8") as fh:
        doc = json.load(fh)
    assert doc["status"] == "planned" and doc["runs"] == [] and doc["design"] == json.loads(
        json.dumps(R.design(SIZES["bf16"])))
    assert not [p for p in os.listdir(out) if p != "results.json"]  # nothing ran
    assert mod.main(["--size", "bf16", "--out", out, "--design-only"]) == 0  # the same design: kept
    assert mod.main(["--size", "fp8", "--out", out, "--design-only"]) == 2  # another one: refused
    assert "differs" in capsys.readouterr().err

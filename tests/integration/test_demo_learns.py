"""The README's demo recipe learns (issue 19, item 3): a change that breaks learning fails CI
instead of the README.

The recipe of `configs/cpu_demo_darl.yaml` (model, warm start stopped on held-out accuracy,
D-ARL with replay and selection, rollout and reward settings, learning rate), reduced in size
only: one-digit terms instead of two (the warm start reaches its target in tens of steps instead
of hundreds), fewer and smaller RL steps, 200 held-out problems. It runs `darl-train` end to end
and asserts that held-out greedy accuracy rises with the paired 95% interval above 0.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from e2e_harness import DarlRun, assert_nothing_left, write_config

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "cpu_demo_darl.yaml")
REDUCED = {
    "data": {"dataset_kwargs": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
             "size": 20000, "eval_size": 200},
    "eval": {"num_problems": 200},
    "train": {"steps": 40, "batch_prompts": 32, "sft_steps": 150, "sft_target": 0.3},
    "checkpoint": {"every_steps": 0},
    "logging": {"progress": False, "tensorboard": False},
}


def reduced_demo(tmp_path) -> DarlRun:
    with open(DEMO, encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    for section, values in REDUCED.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    run_dir = str(tmp_path / "demo")
    cfg["train"]["run_dir"] = run_dir
    os.makedirs(run_dir)
    path = write_config(os.path.join(run_dir, "demo.yaml"), cfg)
    return DarlRun(path, run_dir, str(tmp_path / "demo.out"))


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_the_demo_recipe_learns_at_reduced_size(tmp_path):
    run = reduced_demo(tmp_path).start()
    try:
        assert run.wait(600) == 0, run.output()[-4000:]
    finally:
        run.kill()
    with open(os.path.join(run.run_dir, "model", "warmstart.json"), encoding="utf-8") as fh:
        warm = json.load(fh)
    assert warm["sft_reached_target"] is True, warm
    with open(os.path.join(run.run_dir, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    lo, hi = summary["gain_ci95"]
    print(f"warm start {warm['sft_steps']} steps, held-out {summary['accuracy_before']:.3f} -> "
          f"{summary['accuracy_after']:.3f}, gain {summary['gain']:+.3f} [{lo:+.3f}, {hi:+.3f}]")  # -rP shows it
    assert lo > 0, (f"the demo recipe did not learn: held-out accuracy {summary['accuracy_before']:.3f} -> "
                    f"{summary['accuracy_after']:.3f}, gain {summary['gain']:+.3f} [{lo:+.3f}, {hi:+.3f}]\n"
                    + run.output()[-3000:])
    assert_nothing_left(run, run.run_info()["run_id"])

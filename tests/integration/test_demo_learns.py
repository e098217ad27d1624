"""The README's demo recipe learns: a change that breaks learning fails CI instead of the README.

The recipe of `configs/cpu_demo_darl.yaml` (model, warm start stopped on held-out accuracy,
D-ARL with replay and selection, rollout and reward settings, learning rate), reduced in size
only: one-digit terms instead of two (the warm start reaches its target in tens of steps instead
of hundreds), fewer and smaller RL steps, 200 evaluation problems. It runs `darl-train` end to
end and asserts that the sampled reward rises (last quarter of the steps against the first, by
more than 3 standard errors) and that greedy accuracy on the evaluation problems does not fall by
5 points. At this size the evaluation problems are not held out: one-digit two-term sums number
200 (10 x 10 digits, + or -); the evaluation's 200 draws are 119 distinct sums, and training
draws every one of the 200 (`test_the_evaluation_problems_are_also_training_problems`). The
accuracy check says the recipe does not unlearn the task, not that it generalizes to unseen
problems.

It runs as a user in a container or on a cluster node would meet it: with the ring the README
suggests where `/dev/shm` is small (`ring.size_bytes=16777216`, 16 MiB instead of 256) and with a
dead proxy exported for every scheme and no `no_proxy` (HPC sites export one on compute nodes):
nothing of the run may go through it.
"""

from __future__ import annotations

import json
import os
import statistics

import pytest
import yaml

from megatron_darl.launch.warmstart import read_stats
from tests.helpers.e2e import DarlRun, assert_nothing_left, write_config
from tests.helpers.network import dead_proxy_env

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "cpu_demo_darl.yaml")
REDUCED = {
    "data": {"dataset_kwargs": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
             "size": 20000, "eval_size": 200},
    "eval": {"num_problems": 200},
    "train": {"steps": 80, "batch_prompts": 32},
    "demo": {"sft_steps": 150, "sft_target": 0.3},
    "checkpoint": {"every_steps": 0},
    "logging": {"progress": False, "tensorboard": False},
    "ring": {"size_bytes": 16777216},  # the README's suggestion for a small /dev/shm
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
    return DarlRun(path, run_dir, str(tmp_path / "demo.out"), env=dead_proxy_env(dict(os.environ)))


@pytest.mark.timeout(660)
def test_the_demo_recipe_learns_at_reduced_size(tmp_path):
    run = reduced_demo(tmp_path).run_to_end(600)
    with open(os.path.join(run.run_dir, "config.yaml"), encoding="utf-8") as fh:
        assert yaml.safe_load(fh)["ring"]["size_bytes"] == 16777216  # the run used the small ring
    warm = read_stats(os.path.join(run.run_dir, "model"))
    assert warm["sft_reached_target"] is True, warm
    with open(os.path.join(run.run_dir, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    lo, hi = summary["gain_ci95"]
    # The gate is the sampled reward, 80 steps x 256 samples: the last quarter's per-step mean above
    # the first quarter's by more than 3 standard errors. Greedy accuracy on the 200 evaluation draws
    # (of the only 200 one-digit two-term sums there are, seen in training too) is too noisy to gate
    # on: from the same warm start (44.0%), four runs of 80 steps gained +0.5, +3.5, +9.0, +14.0 points and four of 40
    # steps +5.0 to +8.0, with paired intervals of about +-9 (7 of the 8 reach below 0). The reward
    # of three of the 80-step runs rose 0.27 -> 0.34, 0.27 -> 0.36 and 0.26 -> 0.36 (the one that
    # gained +0.5, se 0.011); with optim.lr=0 it went 0.266 -> 0.260 (se 0.006) and this test failed.
    # Accuracy on the evaluation problems may not fall by 5 points. The line printed below
    # (`pytest -rP` shows it) gives these figures for a run.
    reward = [m["rollout/reward_mean"] for m in sorted(run.metrics(), key=lambda m: m.get("step", -1))
              if "train/batch_groups" in m and "rollout/reward_mean" in m]
    q = len(reward) // 4
    first, last = reward[:q], reward[-q:]
    before, after = statistics.fmean(first), statistics.fmean(last)
    se = (statistics.variance(first) / q + statistics.variance(last) / q) ** 0.5
    print(f"warm start {warm['sft_steps']} steps, evaluation (not held out) {summary['accuracy_before']:.3f} -> "
          f"{summary['accuracy_after']:.3f}, gain {summary['gain']:+.3f} [{lo:+.3f}, {hi:+.3f}]; sampled reward "
          f"{before:.3f} -> {after:.3f} (first and last {q} steps, se {se:.3f})")
    assert q >= 10 and after - before > 3 * se, (f"the demo recipe did not learn: sampled reward {before:.3f} -> "
                                                 f"{after:.3f} (first and last {q} steps, se {se:.3f})\n"
                                                 + run.output()[-3000:])
    assert summary["gain"] > -0.05, (f"accuracy on the evaluation problems fell: {summary['accuracy_before']:.3f} -> "
                                     f"{summary['accuracy_after']:.3f}, gain {summary['gain']:+.3f} "
                                     f"[{lo:+.3f}, {hi:+.3f}]")
    assert_nothing_left(run, run.run_info()["run_id"])


def test_the_evaluation_problems_are_also_training_problems():
    """What the docstring says of the reduced recipe: its 200 evaluation draws repeat sums (119
    distinct) and every one of them is a training problem too (not held out)."""
    from megatron_darl.config.data import DataConfig
    from megatron_darl.data.sources import build_source

    with open(DEMO, encoding="utf-8") as fh:
        data = {**yaml.safe_load(fh)["data"], **REDUCED["data"]}
    data["dataset_kwargs"] = {**data.get("dataset_kwargs", {}), **REDUCED["data"]["dataset_kwargs"]}
    cfg = DataConfig(**data)
    evaluation, train = build_source(cfg, "eval"), build_source(cfg, "train")
    asked = [evaluation.record(i).question for i in range(len(evaluation))]
    trained = {train.record(i).question for i in range(2000)}
    assert len(asked) == 200 and len(set(asked)) == 119, len(set(asked))
    assert len(trained) == 200 and set(asked) <= trained  # the whole space, the evaluation's sums among them

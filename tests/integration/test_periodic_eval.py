"""Held-out accuracy inside training (`eval.every_steps`, eval/periodic.py) is the accuracy the
existing evaluation gives.

(a) On the same model folder, the in-process evaluator scores every held-out problem exactly as
the engine-served evaluation of `darl-eval` and the launcher (`eval/session.py` through a real
embedded engine over HTTP) does, on a model that answers some problems right and some wrong.
(b) Only due versions are evaluated, and evaluation time is taken out of the wall-clock. A real
`darl-train` run with `eval.every_steps=2` is checked on the quick comparison's runs
(`check_periodic_evaluation` in tests/integration/test_compare_quick.py): accuracy at versions 2
and 4 only, in metrics.jsonl and TensorBoard, the last one the launcher's final evaluation.
"""

from __future__ import annotations

import tempfile

import pytest

from megatron_darl.config import load_config
from tests.helpers.e2e import base_config, write_config

N = 60


@pytest.mark.timeout(300)
def test_in_process_scores_equal_the_engine_served_evaluation(tmp_path, warm_model):
    from megatron_darl.eval.heldout import evaluate_with_engines
    from megatron_darl.eval.periodic import PeriodicEvaluator
    from megatron_darl.launch.local import start_local_engines
    from megatron_darl.launch.supervisor import Supervisor

    cfg = load_config(write_config(str(tmp_path / "c.yaml"), base_config(
        str(tmp_path / "run"), warm_model, eval={"num_problems": N, "every_steps": 1}, data={"eval_size": N})))
    with tempfile.TemporaryDirectory() as logs, Supervisor(logs, echo=None) as sup:
        urls = start_local_engines(cfg, sup)
        served, _ = evaluate_with_engines(cfg, urls, "of the warm start")
    ev = PeriodicEvaluator(cfg)
    try:
        mine = ev.evaluate_folder(warm_model)
    finally:
        ev.close()
    assert mine.uids == served.uids and len(mine.uids) == N
    assert 0 < served.scores.mean() < 1, "a model that is always right or always wrong proves nothing"
    assert (mine.scores == served.scores).all(), (mine.scores.ravel().tolist(), served.scores.ravel().tolist())


class _Publisher:
    def __init__(self, folder):
        self.path = folder

    def eval_folder(self, version):
        return self.folder(version)

    def folder(self, version):
        return self.path

    def rollout_metrics(self):
        return {"rollout/samples_written": 96.0, "rollout/filtered_groups": 2.0}


@pytest.mark.timeout(300)
def test_only_due_versions_are_evaluated_and_eval_time_is_taken_out(tmp_path, warm_model):
    from megatron_darl.eval.periodic import PeriodicEvaluator

    cfg = load_config(write_config(str(tmp_path / "c.yaml"), base_config(
        str(tmp_path / "run"), warm_model, eval={"num_problems": 20, "every_steps": 3}, data={"eval_size": 20})))
    ev = PeriodicEvaluator(cfg)
    try:
        assert ev.maybe_run(2, _Publisher("/nonexistent")) == {}  # not due: nothing is loaded
        out = ev.maybe_run(3, _Publisher(warm_model))
        again = ev.maybe_run(6, _Publisher(warm_model))  # the decoder swaps weights in place
    finally:
        ev.close()
    assert out["eval/version"] == 3 and out["eval/problems"] == 20
    assert out["eval/samples_generated"] == 96 + 2 * cfg.rollout.group_size
    assert out["eval/accuracy_lo"] <= out["eval/accuracy"] <= out["eval/accuracy_hi"]
    assert again["eval/accuracy"] == out["eval/accuracy"]  # same weights, same greedy answers
    # nothing but evaluation happened between the two calls: the wall-clock without it stood still
    assert again["perf/eval_s"] > 0 and again["eval/wall_s"] == pytest.approx(out["eval/wall_s"], abs=0.5)
